// Paged attention for decode on the GPU, and the KV-cache ops around it.
//
// Each decoding sequence brings one query per head and attends to the first seq_len
// tokens of its K/V, which live scattered in a pool of blocks
//
//     key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
//
// in the order its block table lists them: token t sits in slot
// block_table[t / block_size] * block_size + t % block_size (PagedAttention paper §4.1).
// The PyTorch reference (nanopaged/layers/attention.py) gathers those blocks into a fresh
// contiguous tensor and calls SDPA; this kernel reads them in place, once.
//
// It is vLLM's paged_attention_v1 (csrc/attention/attention_kernels.cu) re-derived for
// our layout: 128 threads per (query head, sequence), 4 warps walking the block table,
// each token's K row read with 16-byte loads, the logits kept in shared memory, softmax
// by max/sum reductions over the 128 threads, fp32 everywhere inside. Decode attention
// does two flops per byte of K/V it reads, so it is memory-bound: everything below is
// about reading the cache at full bandwidth. One change of plan for GQA: the query heads
// that share a kv head (up to 4) are packed into one thread block, one 128-thread slice
// each, so that they read their common K/V through one SM's L1 instead of each pulling
// it from L2. kernels/dev/paged_attention_dev.cu grows this kernel from a naive one step
// by step, with timings.
//
// Also here, so the CUDA backend is one file: reshape_and_cache (write this step's K/V
// into their slots), copy_blocks (copy-on-write) and swap_blocks (GPU <-> CPU pool).
// Everything above the "PyTorch bindings" line is plain CUDA: the dev file includes it.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cassert>
#include <cfloat>
#include <cstdint>

namespace nanopaged {

constexpr int WARP_SIZE = 32;
constexpr int NUM_WARPS = 4;                      // 128 threads: vLLM's choice too
constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;   // per query head: a "slice" of the block
constexpr int MAX_HEADS_PER_BLOCK = 4;            // 512 threads: up to 128 registers each
constexpr unsigned FULL_MASK = 0xffffffffu;
// Tokens each lane has in flight per step. One 16-byte load per lane per token would
// leave the warp waiting a full memory latency (most of a microsecond under load) per
// 512 bytes; eight independent loads issued before the first is used hide most of it.
// (A register-count vs latency trade: 8 keeps 4 KB in flight per warp, any head size.)
constexpr int UNROLL = 8;

// The math is fp32; these convert one element to and from the storage type. (PyTorch
// builds extensions with the implicit half/bfloat16 conversions switched off, so the
// conversions are spelled out.)
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// How the 32 lanes of a warp cover K/V rows. A token's row (head_size elements of one
// kv head) is contiguous, so LANES_PER_TOKEN adjacent lanes read it together, one
// 16-byte piece each: a warp-wide load reads whole rows, every byte of every 32-byte
// sector it touches is used. (vLLM instead ties lanes to block_size, which suits its
// interleaved K layout, not ours; see the dev file, v3 -> v4.)
template <typename T, int HEAD_SIZE>
struct RowMap {
  static constexpr int VEC = 16 / sizeof(T);                       // elements per 16-byte load
  static constexpr int PIECES = HEAD_SIZE / VEC;                   // 16-byte pieces per row
  static constexpr int LANES_PER_TOKEN = PIECES < WARP_SIZE ? PIECES : WARP_SIZE;
  static constexpr int PIECES_PER_LANE = PIECES / LANES_PER_TOKEN; // 2 only for fp32, head 256
  static constexpr int TOKENS_PER_LOAD = WARP_SIZE / LANES_PER_TOKEN;
  static constexpr int CHUNK = TOKENS_PER_LOAD * UNROLL;           // tokens a warp takes per step
  static_assert(HEAD_SIZE % VEC == 0 && PIECES % LANES_PER_TOKEN == 0, "unsupported head size");
};

// Sum (or max) over the NUM_THREADS threads of a slice: shuffles inside each warp, then
// the warps' results through shared memory (red: NUM_WARPS floats of this slice). Every
// thread of the block must call it (it has block-wide barriers); each gets its slice's result.
template <typename Op>
__device__ float block_reduce(float x, float* red, Op op) {
  for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2) x = op(x, __shfl_xor_sync(FULL_MASK, x, mask));
  if (threadIdx.x % WARP_SIZE == 0) red[threadIdx.x / WARP_SIZE % NUM_WARPS] = x;
  __syncthreads();            // also publishes everything written to shared memory before it
  x = red[0];
  for (int w = 1; w < NUM_WARPS; ++w) x = op(x, red[w]);
  __syncthreads();            // red[] is reused by the next reduction
  return x;
}

// Shared memory per query head: its logits, then its warps' partial outputs.
inline int64_t smem_per_head(int max_context, int head_size) {
  return (int64_t(max_context) + NUM_WARPS * head_size) * int64_t(sizeof(float));
}

// Query heads per thread block: the largest divisor of the GQA group (num_heads /
// num_kv_heads) up to MAX_HEADS_PER_BLOCK whose shared memory fits in smem_limit.
inline int heads_per_block_for(int group, int64_t per_head, int64_t smem_limit) {
  for (int h = MAX_HEADS_PER_BLOCK; h > 1; --h)
    if (group % h == 0 && h * per_head <= smem_limit) return h;
  return 1;
}

// out[seq, head] = softmax(scale * q . K^T) V over the sequence's first seq_len tokens.
// Grid: (num_heads / heads_per_block, num_seqs); block: heads_per_block * NUM_THREADS
// threads, slice s computing head blockIdx.x * heads_per_block + s exactly as if it were
// a block of its own. The slices of a block share a kv head (heads_per_block divides the
// GQA group) and walk its K/V in step, so one slice's load misses in L1 and the others'
// hit. Dynamic shared memory: heads_per_block * smem_per_head(max_blocks * block_size).
template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(MAX_HEADS_PER_BLOCK * NUM_THREADS) paged_attention_kernel(
    T* __restrict__ out,                        // [num_seqs, num_heads, HEAD_SIZE]
    const T* __restrict__ query,                // [num_seqs, num_heads, HEAD_SIZE], strided
    const T* __restrict__ key_cache,            // [num_blocks, block_size, num_kv_heads, HEAD_SIZE]
    const T* __restrict__ value_cache,          // same
    const int64_t* __restrict__ block_tables,   // [num_seqs, max_blocks]
    const int64_t* __restrict__ seq_lens,       // [num_seqs]
    int64_t q_stride_seq, int64_t q_stride_head,
    int num_kv_heads, int block_size, int max_blocks, float scale) {
  using Map = RowMap<T, HEAD_SIZE>;
  constexpr int VEC = Map::VEC, LANES = Map::LANES_PER_TOKEN, PPL = Map::PIECES_PER_LANE;
  extern __shared__ float smem[];
  __shared__ float red[MAX_HEADS_PER_BLOCK][NUM_WARPS];

  const int heads_per_block = blockDim.x / NUM_THREADS, slice = threadIdx.x / NUM_THREADS;
  const int tid = threadIdx.x % NUM_THREADS;    // thread index within the slice
  const int head = blockIdx.x * heads_per_block + slice, seq = blockIdx.y;
  const int num_heads = gridDim.x * heads_per_block;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
  const int max_context = max_blocks * block_size;
  float* logits = smem + slice * max_context;   // [seq_len]: logits, then exp(logit - max)
  float* partial_out =                          // [NUM_WARPS][HEAD_SIZE], after all slices' logits
      smem + heads_per_block * max_context + slice * NUM_WARPS * HEAD_SIZE;
  const int token_in_load = lane / LANES;       // which of the TOKENS_PER_LOAD rows
  const int piece = lane % LANES;               // which 16-byte piece(s) of that row
  const int seq_len = static_cast<int>(seq_lens[seq]);
  assert(seq_len >= 1 && seq_len <= max_context);
  const int64_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks;

  // Element 0 of this lane's first piece of token t's row. Tokens past the end (in a
  // warp's last chunk) read token seq_len - 1 instead: padded block-table entries are
  // never touched, and the loads need no branch, so all UNROLL of them (and the block-table
  // reads they depend on) issue back to back. Their results are ignored (K) or weighted
  // by 0 (V: a real token's values, finite, so 0 * v = 0).
  auto row = [&](const T* cache, int t) {
    t = t < seq_len ? t : seq_len - 1;
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    return cache + (slot * num_kv_heads + kv_head) * HEAD_SIZE + piece * VEC;
  };
  auto load16 = [](const T* p) { return *reinterpret_cast<const uint4*>(p); };

  // This lane's pieces of q, pre-scaled: (scale * q) . k == scale * (q . k).
  float q[PPL][VEC];
  const T* q_row = query + seq * q_stride_seq + head * q_stride_head;
  for (int i = 0; i < PPL; ++i)
    for (int j = 0; j < VEC; ++j) q[i][j] = scale * to_float(q_row[(i * LANES + piece) * VEC + j]);

  // 1. logits. Warp w takes tokens [base, base + CHUNK) for base = w * CHUNK, stepping by
  // NUM_WARPS * CHUNK; all UNROLL loads go out before the first is used.
  float qk_max = -FLT_MAX;
  for (int base = warp * Map::CHUNK; base < seq_len; base += NUM_WARPS * Map::CHUNK) {
    uint4 k[UNROLL][PPL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * Map::TOKENS_PER_LOAD + token_in_load;
      for (int i = 0; i < PPL; ++i) k[u][i] = load16(row(key_cache, t) + i * LANES * VEC);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float dot = 0.f;
      for (int i = 0; i < PPL; ++i) {
        const T* kv = reinterpret_cast<const T*>(&k[u][i]);
        for (int j = 0; j < VEC; ++j) dot += q[i][j] * to_float(kv[j]);
      }
      // The LANES lanes of a token hold partial dot products: add them up (xor masks
      // below LANES stay inside the token's lane group).
      for (int mask = LANES / 2; mask >= 1; mask /= 2) dot += __shfl_xor_sync(FULL_MASK, dot, mask);
      const int t = base + u * Map::TOKENS_PER_LOAD + token_in_load;
      if (piece == 0 && t < seq_len) {
        logits[t] = dot;
        qk_max = fmaxf(qk_max, dot);
      }
    }
  }

  // 2. softmax numerators, max-subtracted so exp never overflows; the division by the
  // sum waits until the very end (one multiply per output instead of one per token).
  // __expf is the fast hardware exp: its argument is <= 0 here, where it is accurate to
  // a few ulp, so the kernel needs no --use_fast_math.
  qk_max = block_reduce(qk_max, red[slice], [](float a, float b) { return fmaxf(a, b); });
  float sum = 0.f;
  for (int t = tid; t < seq_len; t += NUM_THREADS) {
    const float e = __expf(logits[t] - qk_max);
    logits[t] = e;
    sum += e;
  }
  sum = block_reduce(sum, red[slice], [](float a, float b) { return a + b; });   // >= 1: exp(0) is in it

  // 3. out = sum_t p_t * v_t, same walk and lane map as for K: this lane accumulates its
  // pieces of the output over the tokens it reads. (Slots past seq_len may hold anything,
  // even NaN, and 0 * NaN is NaN: row() never reads them.)
  float acc[PPL][VEC] = {};
  for (int base = warp * Map::CHUNK; base < seq_len; base += NUM_WARPS * Map::CHUNK) {
    uint4 v[UNROLL][PPL];
    float p[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * Map::TOKENS_PER_LOAD + token_in_load;
      p[u] = t < seq_len ? logits[t] : 0.f;
      for (int i = 0; i < PPL; ++i) v[u][i] = load16(row(value_cache, t) + i * LANES * VEC);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      for (int i = 0; i < PPL; ++i) {
        const T* vv = reinterpret_cast<const T*>(&v[u][i]);
        for (int j = 0; j < VEC; ++j) acc[i][j] += p[u] * to_float(vv[j]);
      }
  }
  // Lanes with the same piece but different tokens add up (xor masks >= LANES), then the
  // warps add up through shared memory, and the sum's division happens once per element.
  for (int mask = LANES; mask < WARP_SIZE; mask *= 2)
    for (int i = 0; i < PPL; ++i)
      for (int j = 0; j < VEC; ++j) acc[i][j] += __shfl_xor_sync(FULL_MASK, acc[i][j], mask);
  if (token_in_load == 0)
    for (int i = 0; i < PPL; ++i)
      for (int j = 0; j < VEC; ++j) partial_out[warp * HEAD_SIZE + (i * LANES + piece) * VEC + j] = acc[i][j];
  __syncthreads();
  T* out_row = out + (static_cast<int64_t>(seq) * num_heads + head) * HEAD_SIZE;
  for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) {
    float o = 0.f;
    for (int w = 0; w < NUM_WARPS; ++w) o += partial_out[w * HEAD_SIZE + d];
    out_row[d] = from_float<T>(o / sum);
  }
}

// The cache ops only move bits, so they are templated on the element width, not dtype.

// cache[slot_mapping[i]] = new[i] for K and V; one thread block per new token. Negative
// slots are padding (vLLM's convention) and are skipped. key/value may be strided views
// (e.g. split from a fused qkv projection); only the last dim must be contiguous.
template <typename W>
__global__ void reshape_and_cache_kernel(const W* __restrict__ key, const W* __restrict__ value,
                                         W* __restrict__ key_cache, W* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         int64_t k_stride_tok, int64_t k_stride_head,
                                         int64_t v_stride_tok, int64_t v_stride_head,
                                         int num_kv_heads, int head_size) {
  const int64_t token = blockIdx.x, slot = slot_mapping[token];
  if (slot < 0) return;
  const int row = num_kv_heads * head_size;       // elements per slot
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    key_cache[slot * row + i] = key[token * k_stride_tok + h * k_stride_head + d];
    value_cache[slot * row + i] = value[token * v_stride_tok + h * v_stride_head + d];
  }
}

// kv_cache: [num_layers * 2, num_blocks, chunk] words; block src[i] -> dst[i] in each of
// the num_layers * 2 (layer, K/V) planes. Grid: (num_pairs, num_layers * 2).
template <typename W>
__global__ void copy_blocks_kernel(W* __restrict__ kv_cache, const int64_t* __restrict__ src,
                                   const int64_t* __restrict__ dst, int64_t num_blocks, int64_t chunk) {
  W* plane = kv_cache + blockIdx.y * num_blocks * chunk;
  const W* from = plane + src[blockIdx.x] * chunk;
  W* to = plane + dst[blockIdx.x] * chunk;
  for (int64_t i = threadIdx.x; i < chunk; i += blockDim.x) to[i] = from[i];
}

}  // namespace nanopaged

// ---------------------------------------------------------------- PyTorch bindings
#ifndef NANOPAGED_NO_TORCH
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace {
using namespace nanopaged;

void check_on(const torch::Tensor& t, const char* fn, const char* name, const torch::Device& device) {
  TORCH_CHECK(t.device() == device, fn, ": ", name, " must be on ", device, ", got ", t.device());
}

void check_index(const torch::Tensor& t, const char* fn, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kLong, fn, ": ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), fn, ": ", name, " must be a contiguous ", dim,
              "-d tensor, got shape ", t.sizes(), " strides ", t.strides());
}

// c10::Half and __half (c10::BFloat16 and __nv_bfloat16) are the same 16 bits; the
// kernels take CUDA's types so that the code above needs nothing from torch.
template <typename F>
void dispatch_dtype(at::ScalarType dtype, const char* fn, F f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(__half{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    default: TORCH_CHECK(false, fn, ": dtype ", dtype, " is not supported (float32, float16, bfloat16)");
  }
}

template <typename F>
void dispatch_width(int64_t bytes, const char* fn, F f) {
  switch (bytes) {
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    default: TORCH_CHECK(false, fn, ": element size ", bytes, " is not supported (2 or 4 bytes)");
  }
}

template <typename T, int HEAD_SIZE>
void launch_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                   const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, float scale, cudaStream_t stream) {
  const int num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  const int block_size = key_cache.size(1), max_blocks = block_tables.size(1);
  auto kernel = paged_attention_kernel<T, HEAD_SIZE>;
  // Each head's logits, for the longest context the block table can describe, live in
  // shared memory. Past 48 KB a kernel must opt in, up to the device's limit (227 KB on
  // Hopper: ~55K tokens for one head). vLLM's v2 kernel splits longer contexts into
  // partitions; we do not.
  int device = 0, limit = 0;
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const int64_t available = limit - int64_t(attr.sharedSizeBytes);
  const int64_t per_head = smem_per_head(max_blocks * block_size, HEAD_SIZE);
  TORCH_CHECK(per_head <= available, "paged_attention_decode: block_tables of ", max_blocks, " blocks x block_size ",
              block_size, " need ", per_head, " bytes of shared memory per head; this GPU allows ", available);
  const int heads_per_block = heads_per_block_for(num_heads / num_kv_heads, per_head, available);
  const int64_t smem = heads_per_block * per_head;
  if (smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<dim3(num_heads / heads_per_block, query.size(0)), heads_per_block * NUM_THREADS, smem, stream>>>(
      reinterpret_cast<T*>(out.data_ptr()), reinterpret_cast<const T*>(query.data_ptr()),
      reinterpret_cast<const T*>(key_cache.data_ptr()), reinterpret_cast<const T*>(value_cache.data_ptr()),
      block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), query.stride(0), query.stride(1),
      num_kv_heads, block_size, max_blocks, scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out = softmax(scale * q K^T) V per (sequence, head) over the first seq_lens[i] tokens
// of sequence i's blocks. Preconditions the host cannot see (the kernel asserts the
// first): 1 <= seq_lens[i] <= block_tables.size(1) * block_size, and the first
// ceil(seq_lens[i] / block_size) entries of each block-table row are valid block ids.
void paged_attention_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                            double scale) {
  const char* fn = "paged_attention_decode";
  TORCH_CHECK(query.is_cuda(), fn, ": query must be a CUDA tensor, got ", query.device());
  const auto device = query.device();
  for (const auto& [name, t] : {std::pair{"out", out}, {"key_cache", key_cache}, {"value_cache", value_cache},
                                {"block_tables", block_tables}, {"seq_lens", seq_lens}})
    check_on(t, fn, name, device);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, fn, ": query must be [num_seqs, num_heads, "
              "head_size] with a contiguous last dim, got shape ", query.sizes(), " strides ", query.strides());
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), fn, ": out must be contiguous and "
              "shaped like query ", query.sizes(), ", got ", out.sizes(), " strides ", out.strides());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous(), fn, ": key_cache must be a contiguous "
              "[num_blocks, block_size, num_kv_heads, head_size] tensor, got shape ", key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(), fn,
              ": value_cache must be contiguous and shaped like key_cache ", key_cache.sizes(), ", got ",
              value_cache.sizes());
  for (const auto& [name, t] : {std::pair{"out", out}, {"key_cache", key_cache}, {"value_cache", value_cache}})
    TORCH_CHECK(t.scalar_type() == query.scalar_type(), fn, ": ", name, " is ", t.scalar_type(),
                " but query is ", query.scalar_type());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(0) > 0 && key_cache.size(1) > 0 && num_kv_heads > 0, fn,
              ": key_cache must have blocks, block_size and num_kv_heads > 0, got ", key_cache.sizes());
  TORCH_CHECK(key_cache.size(3) == head_size, fn, ": key_cache head_size ", key_cache.size(3),
              " != query head_size ", head_size);
  TORCH_CHECK(num_heads % num_kv_heads == 0, fn, ": num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  check_index(block_tables, fn, "block_tables", 2);
  check_index(seq_lens, fn, "seq_lens", 1);
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs && block_tables.size(1) >= 1,
              fn, ": block_tables ", block_tables.sizes(), " and seq_lens ", seq_lens.sizes(),
              " must have num_seqs = ", num_seqs, " rows");
  TORCH_CHECK(num_seqs <= 65535, fn, ": num_seqs ", num_seqs, " exceeds the grid's 65535");
  for (const auto& [name, t] : {std::pair{"key_cache", key_cache}, {"value_cache", value_cache}})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, fn, ": ", name,
                " must start 16-byte aligned (the kernel reads 16-byte vectors)");
  if (num_seqs == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(query.scalar_type(), fn, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto launch) {
      launch(out, query, key_cache, value_cache, block_tables, seq_lens, float(scale), stream);
    };
    switch (head_size) {
      case 16: return run(launch_decode<T, 16>);
      case 32: return run(launch_decode<T, 32>);
      case 64: return run(launch_decode<T, 64>);
      case 128: return run(launch_decode<T, 128>);
      case 256: return run(launch_decode<T, 256>);
      default: TORCH_CHECK(false, fn, ": head_size ", head_size, " is not supported (16, 32, 64, 128, 256)");
    }
  });
}

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping) {
  const char* fn = "reshape_and_cache";
  TORCH_CHECK(key.is_cuda(), fn, ": key must be a CUDA tensor, got ", key.device());
  const auto device = key.device();
  for (const auto& [name, t] : {std::pair{"value", value}, {"key_cache", key_cache}, {"value_cache", value_cache},
                                {"slot_mapping", slot_mapping}})
    check_on(t, fn, name, device);
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.sizes() == key.sizes() && value.stride(2) == 1,
              fn, ": key and value must be [num_tokens, num_kv_heads, head_size] with a contiguous last dim, "
              "got ", key.sizes(), " strides ", key.strides(), " and ", value.sizes(), " strides ", value.strides());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
              value_cache.is_contiguous(), fn, ": key_cache and value_cache must be contiguous [num_blocks, "
              "block_size, num_kv_heads, head_size] tensors, got ", key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2), fn, ": key ", key.sizes(),
              " does not match the cache's [num_kv_heads, head_size] = ", key_cache.sizes().slice(2));
  for (const auto& [name, t] : {std::pair{"value", value}, {"key_cache", key_cache}, {"value_cache", value_cache}})
    TORCH_CHECK(t.scalar_type() == key.scalar_type(), fn, ": ", name, " is ", t.scalar_type(), " but key is ",
                key.scalar_type());
  check_index(slot_mapping, fn, "slot_mapping", 1);
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), fn, ": slot_mapping has ", slot_mapping.size(0),
              " entries for ", key.size(0), " tokens");
  const int64_t num_tokens = key.size(0), row = key.size(1) * key.size(2);
  if (num_tokens == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_width(key.element_size(), fn, [&](auto tag) {
    using W = decltype(tag);
    reshape_and_cache_kernel<W><<<num_tokens, std::min<int64_t>(row, 512), 0, stream>>>(
        reinterpret_cast<const W*>(key.data_ptr()), reinterpret_cast<const W*>(value.data_ptr()),
        reinterpret_cast<W*>(key_cache.data_ptr()), reinterpret_cast<W*>(value_cache.data_ptr()),
        slot_mapping.data_ptr<int64_t>(), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key.size(1), key.size(2));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]; the caller
// guarantees that no dst block is also a src block (copy-on-write targets are fresh).
void copy_blocks(torch::Tensor kv_cache, torch::Tensor src, torch::Tensor dst) {
  const char* fn = "copy_blocks";
  TORCH_CHECK(kv_cache.is_cuda(), fn, ": kv_cache must be a CUDA tensor, got ", kv_cache.device());
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(), fn, ": kv_cache must "
              "be a contiguous [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size] tensor, got ",
              kv_cache.sizes());
  for (const auto& [name, t] : {std::pair{"src", src}, {"dst", dst}}) {
    check_on(t, fn, name, kv_cache.device());
    check_index(t, fn, name, 1);
  }
  TORCH_CHECK(src.size(0) == dst.size(0), fn, ": src has ", src.size(0), " entries, dst ", dst.size(0));
  const int64_t num_pairs = src.size(0), planes = kv_cache.size(0) * 2, num_blocks = kv_cache.size(2);
  const int64_t chunk_bytes = kv_cache[0][0][0].numel() * kv_cache.element_size();
  if (num_pairs == 0) return;

  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto tag) {
    using W = decltype(tag);
    copy_blocks_kernel<W><<<dim3(num_pairs, planes), 256, 0, stream>>>(
        reinterpret_cast<W*>(kv_cache.data_ptr()), src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(),
        num_blocks, chunk_bytes / int64_t(sizeof(W)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // 16-byte words whenever the block chunks allow it (they do for every real model).
  if (chunk_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0) launch(uint4{});
  else dispatch_width(kv_cache.element_size(), fn, launch);
}

// Caches shaped like copy_blocks' kv_cache, one on the GPU and one on the CPU (or both on
// one GPU); they may differ in num_blocks. src/dst: int64 block ids on the CPU. Each
// (layer, K/V, block) is one contiguous chunk, so a swap is a series of cudaMemcpyAsync
// on the current stream: asynchronous to the host, so synchronize before the host reads
// a CPU destination. The CPU cache should be pinned, or the copies are staged and slow.
void swap_blocks(torch::Tensor src_cache, torch::Tensor dst_cache, torch::Tensor src, torch::Tensor dst) {
  const char* fn = "swap_blocks";
  TORCH_CHECK(src_cache.is_cuda() || dst_cache.is_cuda(), fn, ": one of src_cache, dst_cache must be on a "
              "CUDA device, got ", src_cache.device(), " and ", dst_cache.device());
  TORCH_CHECK(!(src_cache.is_cuda() && dst_cache.is_cuda()) || src_cache.device() == dst_cache.device(), fn,
              ": src_cache and dst_cache are on different GPUs: ", src_cache.device(), ", ", dst_cache.device());
  for (const auto& [name, t] : {std::pair{"src_cache", src_cache}, {"dst_cache", dst_cache}})
    TORCH_CHECK(t.dim() == 6 && t.size(1) == 2 && t.is_contiguous(), fn, ": ", name, " must be a contiguous "
                "[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size] tensor, got ", t.sizes());
  auto without_blocks = [](const torch::Tensor& t) {
    auto s = t.sizes().vec();
    s[2] = 0;
    return s;
  };
  TORCH_CHECK(without_blocks(src_cache) == without_blocks(dst_cache) &&
              src_cache.scalar_type() == dst_cache.scalar_type(), fn, ": src_cache ", src_cache.sizes(), " ",
              src_cache.scalar_type(), " and dst_cache ", dst_cache.sizes(), " ", dst_cache.scalar_type(),
              " differ in more than num_blocks");
  for (const auto& [name, t] : {std::pair{"src", src}, {"dst", dst}}) {
    TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got ", t.device());
    check_index(t, fn, name, 1);
  }
  TORCH_CHECK(src.size(0) == dst.size(0), fn, ": src has ", src.size(0), " entries, dst ", dst.size(0));

  const cudaMemcpyKind kind = !src_cache.is_cuda() ? cudaMemcpyHostToDevice
                              : dst_cache.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost;
  const c10::cuda::CUDAGuard guard(src_cache.is_cuda() ? src_cache.device() : dst_cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t planes = src_cache.size(0) * 2, src_blocks = src_cache.size(2), dst_blocks = dst_cache.size(2);
  const int64_t chunk = src_cache[0][0][0].numel() * src_cache.element_size();   // bytes
  const auto* from = static_cast<const char*>(src_cache.data_ptr());
  auto* to = static_cast<char*>(dst_cache.data_ptr());
  for (int64_t i = 0; i < src.size(0); ++i) {
    const int64_t s = src.data_ptr<int64_t>()[i], d = dst.data_ptr<int64_t>()[i];
    TORCH_CHECK(0 <= s && s < src_blocks && 0 <= d && d < dst_blocks, fn, ": pair ", i, " (", s, " -> ", d,
                ") is out of range for ", src_blocks, " -> ", dst_blocks, " blocks");
    for (int64_t p = 0; p < planes; ++p)
      C10_CUDA_CHECK(cudaMemcpyAsync(to + (p * dst_blocks + d) * chunk, from + (p * src_blocks + s) * chunk,
                                     chunk, kind, stream));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.doc() = "nanopaged's CUDA kernels: paged attention for decode and the KV-cache ops";
  m.def("paged_attention_decode", &paged_attention_decode, "out = softmax(scale * q K^T) V over each paged context",
        arg("out"), arg("query"), arg("key_cache"), arg("value_cache"), arg("block_tables"), arg("seq_lens"),
        arg("scale"));
  m.def("reshape_and_cache", &reshape_and_cache, "write new K/V into their slots (negative slot: skip)",
        arg("key"), arg("value"), arg("key_cache"), arg("value_cache"), arg("slot_mapping"));
  m.def("copy_blocks", &copy_blocks, "copy blocks src[i] -> dst[i] in every layer, K and V",
        arg("kv_cache"), arg("src"), arg("dst"));
  m.def("swap_blocks", &swap_blocks, "copy blocks between the GPU and the CPU pool",
        arg("src_cache"), arg("dst_cache"), arg("src"), arg("dst"));
}
#endif  // NANOPAGED_NO_TORCH
