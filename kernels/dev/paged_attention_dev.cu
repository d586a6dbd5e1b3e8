/*
Paged attention for decode, grown from a naive kernel to the shipped one, the way llm.c's
dev/cuda grows its kernels: every version computes the same thing, is checked against a
CPU reference, and is timed, so each step's reason can be weighed against its effect.

The problem (nanopaged/layers/attention.py has the PyTorch reference): each of num_seqs
sequences has one new query per head, q: [num_seqs, num_heads, head_size], and attends
to its first seq_len tokens, whose K and V sit scattered in a pool of blocks

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]

in the order of its block table: token t is slot table[t / block_size] * block_size +
t % block_size. Query head h reads kv head h / (num_heads / num_kv_heads) (GQA).
out = softmax(scale * q . K^T) V. Decode does 2 flops per byte of K/V it reads: the
kernel is memory-bound, and its figure of merit is KV bytes read per second against the
GPU's memory bandwidth (H200: 4.8 TB/s on the datasheet).

This file is plain CUDA (no torch) with bf16 K/V, like llm.c's floatX. Versions 4 and 5
are not copies: they run the kernel of ../cuda/attention.cu, included below.

Compile and run (a GPU machine; kernels/gpu_check.py does this and fills in the
"measured" lines below):
    nvcc -O3 -std=c++17 -arch=sm_90 kernels/dev/paged_attention_dev.cu -o /tmp/pa_dev
    /tmp/pa_dev                 # every version on the default problem
    /tmp/pa_dev 3               # version 3 only
    /tmp/pa_dev 0 256 2048 32 8 128 16
        # version (0 = all), num_seqs, context, num_heads, num_kv_heads, head_size, block_size
Default problem: 256 sequences x 2048 tokens, 32 query heads over 8 kv heads, head_size
128, block_size 16 (a Llama-3-8B layer): 2.1 GB of K/V.

version 1: naive. One thread per output element (seq, head, d). Each thread walks the
whole context itself: pass 1 finds the max logit, pass 2 sums exp(logit - max) and
exp(..) * v[d]. The simplest correct kernel; every thread recomputes all head_size-long
dot products of its (seq, head), so the K reads are repeated head_size times (the
repeats hit in L1/L2, but the loads still have to be issued, serially).
measured v1: <not yet: no GPU>

version 2: one thread block per (head, seq). The dot products are done once: thread i
takes tokens i, i + 128, ... and writes logit[t] to shared memory; max and sum are
block-wide reductions (warp shuffles, then shared memory across the 4 warps); then
thread d sums p_t * v[t][d] over all tokens. Should help: head_size times fewer
instructions. Still slow: in the dot products adjacent threads read different rows
(uncoalesced, 2-byte loads); in the V sum each thread has one 2-byte load in flight.
measured v2: <not yet: no GPU>

version 3: vLLM's paged_attention_v1 mapping. Warps walk the KV blocks of the block
table (warp w takes blocks w, w + 4, ...); inside a block, a thread group of
32 / block_size lanes owns one token and splits its dot product, each lane loading
16 / group bytes at a time, and the group adds its parts with shuffles. V: the warp's
lanes own 16-byte pieces of a row and walk the block's tokens. Should help: coalesced,
vectorized loads, and a whole KV block's loads in flight per warp. What it still does
not fit: the mapping is vLLM's, designed for vLLM's K layout [num_blocks, num_kv_heads,
head_size / x, block_size, x] where consecutive tokens' pieces are adjacent; in ours a
token's row is contiguous, so a warp load touches block_size rows with 16 bytes of each
(half of every 32-byte sector per instruction), and the lane map changes with block_size.
measured v3: <not yet: no GPU>

version 4: the shipped kernel's algorithm (../cuda/attention.cu), one query head per
thread block. The lane map follows the row, not the block: head_size / 8 adjacent lanes
read a token's row, 16 bytes each, so a warp load reads whole rows; a warp takes 8 such
loads' worth of consecutive tokens at a time wherever the block boundaries fall, with
all 8 loads issued before the first is used; the V pass uses the same map. Should help:
full sectors and 16-byte loads for K, loads in flight no longer tied to block_size
(block_size 1..32 all run the same code), and one mapping for K and V.
measured v4: <not yet: no GPU>

version 5: the shipped kernel as the engine launches it: the query heads that share a kv
head (up to 4) in one thread block, a 128-thread slice each. Why: with GQA every version
above reads each kv head's K/V once per query head (4 times for 32/8 heads). L2 serves
the repeats, but the SMs still pull 4x the bytes through it, likely more than L2 can
deliver at HBM-like rates (a hypothesis: gpu_check.py's MHA row, the same bytes with no
repeats, tests it). Slices of one block run on one SM and walk the same rows in step, so
the repeats become L1 hits (or merge with the first slice's miss in flight).
measured v5: <not yet: no GPU>
*/

#define NANOPAGED_NO_TORCH
#include "../cuda/attention.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using nanopaged::NUM_THREADS;
using nanopaged::NUM_WARPS;
using nanopaged::WARP_SIZE;
using nanopaged::FULL_MASK;
using nanopaged::to_float;
using nanopaged::from_float;
using nanopaged::block_reduce;
typedef __nv_bfloat16 T;

#define CUDA_CHECK(call)                                                                     \
  do {                                                                                       \
    cudaError_t err_ = (call);                                                               \
    if (err_ != cudaSuccess) {                                                               \
      fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

struct Problem {
  int num_seqs, context, num_heads, num_kv_heads, head_size, block_size, max_blocks;
  float scale;
};

// Test data: element i of tensor `seed` is a fixed hash of (seed, i) in [-1, 1), so the
// GPU fills gigabytes in microseconds and the CPU reference recomputes any element.
__host__ __device__ inline float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;   // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) / float(1 << 23) - 1.f;
}
__global__ void fill(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16_rn(hash_uniform(seed, i));
}
enum Seed : uint64_t { SEED_Q = 1, SEED_K = 2, SEED_V = 3 };

// ----------------------------------------------------------------------------- version 1
__global__ void attention_v1(T* out, const T* query, const T* key_cache, const T* value_cache,
                             const int64_t* block_tables, const int64_t* seq_lens, Problem p) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= int64_t(p.num_seqs) * p.num_heads * p.head_size) return;
  const int d = idx % p.head_size, head = idx / p.head_size % p.num_heads, seq = idx / p.head_size / p.num_heads;
  const int kv_head = head / (p.num_heads / p.num_kv_heads), seq_len = seq_lens[seq];
  const T* q = query + (int64_t(seq) * p.num_heads + head) * p.head_size;
  auto row = [&](const T* cache, int t) {
    const int64_t slot = block_tables[int64_t(seq) * p.max_blocks + t / p.block_size] * p.block_size + t % p.block_size;
    return cache + (slot * p.num_kv_heads + kv_head) * p.head_size;
  };
  auto logit = [&](int t) {
    const T* k = row(key_cache, t);
    float dot = 0.f;
    for (int i = 0; i < p.head_size; ++i) dot += to_float(q[i]) * to_float(k[i]);
    return p.scale * dot;
  };
  float max_logit = -FLT_MAX;
  for (int t = 0; t < seq_len; ++t) max_logit = fmaxf(max_logit, logit(t));
  float sum = 0.f, acc = 0.f;
  for (int t = 0; t < seq_len; ++t) {
    const float e = expf(logit(t) - max_logit);
    sum += e;
    acc += e * to_float(row(value_cache, t)[d]);
  }
  out[idx] = from_float<T>(acc / sum);
}

// ----------------------------------------------------------------------------- version 2
__global__ void __launch_bounds__(NUM_THREADS) attention_v2(T* out, const T* query, const T* key_cache,
                                                            const T* value_cache, const int64_t* block_tables,
                                                            const int64_t* seq_lens, Problem p) {
  extern __shared__ float logits[];
  __shared__ float red[NUM_WARPS];
  const int head = blockIdx.x, seq = blockIdx.y, seq_len = seq_lens[seq];
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const T* q = query + (int64_t(seq) * p.num_heads + head) * p.head_size;
  auto row = [&](const T* cache, int t) {
    const int64_t slot = block_tables[int64_t(seq) * p.max_blocks + t / p.block_size] * p.block_size + t % p.block_size;
    return cache + (slot * p.num_kv_heads + kv_head) * p.head_size;
  };
  float max_logit = -FLT_MAX;
  for (int t = threadIdx.x; t < seq_len; t += NUM_THREADS) {
    const T* k = row(key_cache, t);
    float dot = 0.f;
    for (int i = 0; i < p.head_size; ++i) dot += to_float(q[i]) * to_float(k[i]);
    logits[t] = p.scale * dot;
    max_logit = fmaxf(max_logit, logits[t]);
  }
  max_logit = block_reduce(max_logit, red, [](float a, float b) { return fmaxf(a, b); });
  float sum = 0.f;
  for (int t = threadIdx.x; t < seq_len; t += NUM_THREADS) {
    logits[t] = expf(logits[t] - max_logit);
    sum += logits[t];
  }
  sum = block_reduce(sum, red, [](float a, float b) { return a + b; });
  for (int d = threadIdx.x; d < p.head_size; d += NUM_THREADS) {
    float acc = 0.f;
    for (int t = 0; t < seq_len; ++t) acc += logits[t] * to_float(row(value_cache, t)[d]);
    out[(int64_t(seq) * p.num_heads + head) * p.head_size + d] = from_float<T>(acc / sum);
  }
}

// ----------------------------------------------------------------------------- version 3
template <int BYTES> struct Word;                    // a load of BYTES bytes
template <> struct Word<16> { typedef uint4 type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<4> { typedef uint32_t type; };

template <int BLOCK_SIZE, int HEAD_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) attention_v3(T* out, const T* query, const T* key_cache,
                                                            const T* value_cache, const int64_t* block_tables,
                                                            const int64_t* seq_lens, Problem p) {
  static_assert(BLOCK_SIZE <= WARP_SIZE && WARP_SIZE % BLOCK_SIZE == 0, "v3 covers block sizes 8..32");
  constexpr int GROUP = WARP_SIZE / BLOCK_SIZE;            // lanes per token (vLLM's THREAD_GROUP_SIZE)
  constexpr int VEC = 16 / GROUP / sizeof(T);              // a group loads 16 bytes at a time
  constexpr int VECS_PER_LANE = HEAD_SIZE / (VEC * GROUP);
  typedef typename Word<VEC * sizeof(T)>::type KWord;
  constexpr int PIECES = HEAD_SIZE * sizeof(T) / 16;       // 16-byte pieces of a V row
  constexpr int ROWS_PER_LOAD = WARP_SIZE / PIECES;
  extern __shared__ float logits[];
  __shared__ float red[NUM_WARPS];
  __shared__ float partial_out[NUM_WARPS][HEAD_SIZE];
  const int head = blockIdx.x, seq = blockIdx.y, seq_len = seq_lens[seq];
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int64_t* table = block_tables + int64_t(seq) * p.max_blocks;
  const int num_blocks = (seq_len + BLOCK_SIZE - 1) / BLOCK_SIZE;
  auto row = [&](const T* cache, int64_t block, int offset) {
    return cache + ((block * BLOCK_SIZE + offset) * p.num_kv_heads + kv_head) * HEAD_SIZE;
  };

  // K: token `token` of the warp's block belongs to lanes [token * GROUP, token * GROUP + GROUP).
  const int token = lane / GROUP, in_group = lane % GROUP;
  float q[VECS_PER_LANE][VEC];
  const T* q_row = query + (int64_t(seq) * p.num_heads + head) * HEAD_SIZE;
  for (int i = 0; i < VECS_PER_LANE; ++i)
    for (int j = 0; j < VEC; ++j) q[i][j] = p.scale * to_float(q_row[(i * GROUP + in_group) * VEC + j]);
  float max_logit = -FLT_MAX;
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const T* k_row = row(key_cache, table[b], token);      // inside an allocated block: safe to read
    KWord k[VECS_PER_LANE];
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i) k[i] = *reinterpret_cast<const KWord*>(k_row + (i * GROUP + in_group) * VEC);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VECS_PER_LANE; ++i)
      for (int j = 0; j < VEC; ++j) dot += q[i][j] * to_float(reinterpret_cast<const T*>(&k[i])[j]);
    for (int mask = GROUP / 2; mask >= 1; mask /= 2) dot += __shfl_xor_sync(FULL_MASK, dot, mask);
    const int t = b * BLOCK_SIZE + token;
    if (in_group == 0 && t < seq_len) {
      logits[t] = dot;
      max_logit = fmaxf(max_logit, dot);
    }
  }
  max_logit = block_reduce(max_logit, red, [](float a, float b) { return fmaxf(a, b); });
  float sum = 0.f;
  for (int t = threadIdx.x; t < seq_len; t += NUM_THREADS) {
    logits[t] = __expf(logits[t] - max_logit);
    sum += logits[t];
  }
  sum = block_reduce(sum, red, [](float a, float b) { return a + b; });

  // V: lane owns 16-byte piece lane % PIECES of rows lane / PIECES, + ROWS_PER_LOAD, ...
  const int piece = lane % PIECES;
  float acc[8] = {};
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const int64_t block = table[b];
#pragma unroll
    for (int offset = lane / PIECES; offset < BLOCK_SIZE; offset += ROWS_PER_LOAD) {
      const int t = b * BLOCK_SIZE + offset;
      if (t >= seq_len) continue;                       // past the end: may hold NaN
      const uint4 v = *reinterpret_cast<const uint4*>(row(value_cache, block, offset) + piece * 8);
      for (int j = 0; j < 8; ++j) acc[j] += logits[t] * to_float(reinterpret_cast<const T*>(&v)[j]);
    }
  }
  for (int mask = PIECES; mask < WARP_SIZE; mask *= 2)
    for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(FULL_MASK, acc[j], mask);
  if (lane < PIECES)
    for (int j = 0; j < 8; ++j) partial_out[warp][piece * 8 + j] = acc[j];
  __syncthreads();
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float o = 0.f;
    for (int w = 0; w < NUM_WARPS; ++w) o += partial_out[w][d];
    out[(int64_t(seq) * p.num_heads + head) * HEAD_SIZE + d] = from_float<T>(o / sum);
  }
}

// ----------------------------------------------------------------------------- launchers
// Returns false when the version does not cover this problem.
bool attention_forward(int version, T* out, const T* q, const T* k, const T* v, const int64_t* tables,
                       const int64_t* lens, const Problem& p) {
  const dim3 grid(p.num_heads, p.num_seqs);
  const size_t smem = size_t(p.max_blocks) * p.block_size * sizeof(float);
  auto launch = [&](auto kernel) {     // the logits may need more than the default 48 KB
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<grid, NUM_THREADS, smem>>>(out, q, k, v, tables, lens, p);
  };
  auto launch_shipped = [&](auto kernel, bool pack_heads) {    // versions 4 and 5
    const int64_t per_head = nanopaged::smem_per_head(p.max_blocks * p.block_size, p.head_size);
    const int heads = pack_heads ? nanopaged::heads_per_block_for(p.num_heads / p.num_kv_heads, per_head,
                                                                   200 * 1024) : 1;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(heads * per_head)));
    kernel<<<dim3(p.num_heads / heads, p.num_seqs), heads * NUM_THREADS, heads * per_head>>>(
        out, q, k, v, tables, lens, p.num_heads * int64_t(p.head_size), p.head_size, p.num_kv_heads,
        p.block_size, p.max_blocks, p.scale);
  };
  const int bs = p.block_size, hs = p.head_size;
  if (version == 1) {
    const int64_t n = int64_t(p.num_seqs) * p.num_heads * p.head_size;
    attention_v1<<<(n + 255) / 256, 256>>>(out, q, k, v, tables, lens, p);
  } else if (version == 2) {
    launch(attention_v2);
  } else if (version == 3) {
    if (bs == 8 && hs == 64) launch(attention_v3<8, 64>);
    else if (bs == 8 && hs == 128) launch(attention_v3<8, 128>);
    else if (bs == 16 && hs == 64) launch(attention_v3<16, 64>);
    else if (bs == 16 && hs == 128) launch(attention_v3<16, 128>);
    else if (bs == 32 && hs == 64) launch(attention_v3<32, 64>);
    else if (bs == 32 && hs == 128) launch(attention_v3<32, 128>);
    else return false;
  } else if (version == 4 || version == 5) {
    if (hs == 64) launch_shipped(nanopaged::paged_attention_kernel<T, 64>, version == 5);
    else if (hs == 128) launch_shipped(nanopaged::paged_attention_kernel<T, 128>, version == 5);
    else return false;
  } else {
    return false;
  }
  CUDA_CHECK(cudaGetLastError());
  return true;
}

// CPU reference in double for one sequence, all heads, from the same hashes.
void reference(const Problem& p, const std::vector<int64_t>& tables, int seq, int seq_len, std::vector<double>& out) {
  out.assign(size_t(p.num_heads) * p.head_size, 0.0);
  auto bf = [](float x) { return double(__bfloat162float(__float2bfloat16_rn(x))); };
  std::vector<double> logit(seq_len);
  for (int head = 0; head < p.num_heads; ++head) {
    const int kv_head = head / (p.num_heads / p.num_kv_heads);
    auto elem = [&](int t, int d) {    // element index of (token t, kv_head, d) in a cache
      const int64_t slot = tables[int64_t(seq) * p.max_blocks + t / p.block_size] * p.block_size + t % p.block_size;
      return (slot * p.num_kv_heads + kv_head) * p.head_size + d;
    };
    std::vector<double> q(p.head_size);
    for (int d = 0; d < p.head_size; ++d) q[d] = bf(hash_uniform(SEED_Q, (int64_t(seq) * p.num_heads + head) * p.head_size + d));
    double max_logit = -1e300, sum = 0.0;
    for (int t = 0; t < seq_len; ++t) {
      double dot = 0.0;
      for (int d = 0; d < p.head_size; ++d) dot += q[d] * bf(hash_uniform(SEED_K, elem(t, d)));
      logit[t] = p.scale * dot;
      max_logit = std::max(max_logit, logit[t]);
    }
    for (int t = 0; t < seq_len; ++t) sum += (logit[t] = std::exp(logit[t] - max_logit));
    for (int t = 0; t < seq_len; ++t)
      for (int d = 0; d < p.head_size; ++d)
        out[size_t(head) * p.head_size + d] += logit[t] / sum * bf(hash_uniform(SEED_V, elem(t, d)));
  }
}

int main(int argc, char** argv) {
  int args[7] = {0, 256, 2048, 32, 8, 128, 16};
  for (int i = 1; i < argc && i <= 7; ++i) args[i - 1] = atoi(argv[i]);
  const int only = args[0];
  Problem p{args[1], args[2], args[3], args[4], args[5], args[6], 0, 0.f};
  p.max_blocks = (p.context + p.block_size - 1) / p.block_size;
  p.scale = 1.f / std::sqrt(float(p.head_size));
  if (p.num_heads % p.num_kv_heads || (p.head_size != 64 && p.head_size != 128)) {
    fprintf(stderr, "need num_heads %% num_kv_heads == 0 and head_size 64 or 128\n");
    return 2;
  }

  // Full contexts except seq 1 (one token) and seq 2 (ragged end), blocks shuffled over
  // the pool, padding entries of the tables poisoned: a kernel that reads one faults.
  std::vector<int64_t> lens(p.num_seqs, p.context), tables(size_t(p.num_seqs) * p.max_blocks, -1000000000);
  if (p.num_seqs > 1) lens[1] = 1;
  if (p.num_seqs > 2) lens[2] = std::max(1, p.context - p.block_size / 2 - 1);
  std::vector<int64_t> pool(size_t(p.num_seqs) * p.max_blocks);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = int64_t(i);
  std::shuffle(pool.begin(), pool.end(), std::mt19937(0));
  size_t next = 0;
  double kv_bytes = 0;
  for (int s = 0; s < p.num_seqs; ++s) {
    for (int b = 0; b < (lens[s] + p.block_size - 1) / p.block_size; ++b) tables[size_t(s) * p.max_blocks + b] = pool[next++];
    kv_bytes += 2.0 * lens[s] * p.num_kv_heads * p.head_size * sizeof(T);
  }
  const int64_t cache_elems = int64_t(pool.size()) * p.block_size * p.num_kv_heads * p.head_size;
  const int64_t q_elems = int64_t(p.num_seqs) * p.num_heads * p.head_size;
  printf("%d seqs x %d tokens, %d/%d heads, head_size %d, block_size %d, bf16: %.2f GB of K/V read per call\n",
         p.num_seqs, p.context, p.num_heads, p.num_kv_heads, p.head_size, p.block_size, kv_bytes / 1e9);

  T *q, *k, *v, *out;
  int64_t *d_tables, *d_lens;
  CUDA_CHECK(cudaMalloc(&q, q_elems * sizeof(T)));
  CUDA_CHECK(cudaMalloc(&out, q_elems * sizeof(T)));
  CUDA_CHECK(cudaMalloc(&k, cache_elems * sizeof(T)));
  CUDA_CHECK(cudaMalloc(&v, cache_elems * sizeof(T)));
  CUDA_CHECK(cudaMalloc(&d_tables, tables.size() * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&d_lens, lens.size() * sizeof(int64_t)));
  fill<<<1024, 256>>>(q, q_elems, SEED_Q);
  fill<<<1024, 256>>>(k, cache_elems, SEED_K);
  fill<<<1024, 256>>>(v, cache_elems, SEED_V);
  CUDA_CHECK(cudaMemcpy(d_tables, tables.data(), tables.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_lens, lens.data(), lens.size() * sizeof(int64_t), cudaMemcpyHostToDevice));

  // The reference for a few sequences: first, the one-token one, the ragged one, last.
  std::vector<int> checked = {0, std::min(1, p.num_seqs - 1), std::min(2, p.num_seqs - 1), p.num_seqs - 1};
  std::vector<std::vector<double>> expected(checked.size());
  for (size_t i = 0; i < checked.size(); ++i) reference(p, tables, checked[i], lens[checked[i]], expected[i]);

  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  int failures = 0;
  for (int version = 1; version <= 5; ++version) {
    if (only && version != only) continue;
    CUDA_CHECK(cudaMemset(out, 0, q_elems * sizeof(T)));
    if (!attention_forward(version, out, q, k, v, d_tables, d_lens, p)) {
      printf("version %d: skipped (does not cover this block_size/head_size)\n", version);
      continue;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    // bf16 output: rounding is 2^-8 relative; 1% + 1e-4 leaves room and still catches a
    // dropped token (its weight is ~1/context of an O(0.01) output).
    std::vector<T> got(q_elems);
    CUDA_CHECK(cudaMemcpy(got.data(), out, q_elems * sizeof(T), cudaMemcpyDeviceToHost));
    double worst = 0;
    bool ok = true;
    for (size_t i = 0; i < checked.size(); ++i)
      for (size_t j = 0; j < expected[i].size(); ++j) {
        const double g = __bfloat162float(got[size_t(checked[i]) * p.num_heads * p.head_size + j]), e = expected[i][j];
        worst = std::max(worst, std::fabs(g - e));
        ok = ok && std::fabs(g - e) <= 1e-4 + 1e-2 * std::fabs(e);
      }
    // Time: as many calls as fit in ~0.3 s (version 1 is slow), at least 3.
    CUDA_CHECK(cudaEventRecord(start));
    attention_forward(version, out, q, k, v, d_tables, d_lens, p);
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    const int reps = std::max(3, std::min(100, int(300 / std::max(ms, 1e-3f))));
    CUDA_CHECK(cudaEventRecord(start));
    for (int r = 0; r < reps; ++r) attention_forward(version, out, q, k, v, d_tables, d_lens, p);
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    ms /= reps;
    const double gbps = kv_bytes / (ms * 1e-3) / 1e9;
    printf("version %d: %s (max abs err %.2e)  %.3f ms  %.0f GB/s  %.0f%% of 4.8 TB/s\n", version,
           ok ? "PASS" : "FAIL", worst, ms, gbps, gbps / 4800 * 100);
    failures += !ok;
  }
  CUDA_CHECK(cudaFree(q));
  CUDA_CHECK(cudaFree(k));
  CUDA_CHECK(cudaFree(v));
  CUDA_CHECK(cudaFree(out));
  CUDA_CHECK(cudaFree(d_tables));
  CUDA_CHECK(cudaFree(d_lens));
  return failures ? 1 : 0;
}
