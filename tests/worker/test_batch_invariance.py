"""Batch invariance (chapter 05, "Batch invariance"): a sequence's logits are bit-identical
whatever else runs with it, in float32 and in bfloat16, on every CPU.

The same request, run alone in a fresh engine, is the reference. Then it runs
- in a batch, beside requests of other lengths (its decode rows share steps with
  their prefill rows);
- after a prefix-cache hit, computing only the tokens past the cached blocks;
- prefilled in chunks under a small token budget;
- recomputed after a preemption (its prompt and outputs again, as one prefill);
and every step's top-5 logprobs (log_softmax of its logits row, in fp32) must be equal as
floats, not close. Why a row could differ at all: MKL and oneDNN choose their blocking,
and so the order of a dot product's additions, by the number of rows in the call
(measured on an AMX Xeon: oneDNN's bf16 matmul gives a row other bits at 33 rows than at
32; MKL's fp32 at 2 rows than at 1). The kernels' matmul adds in one order for every row
(kernels/cpu/gemm.cpp and gemm_amx.cpp, `linear` and `linear_amx`), and the attention kernel
computes each query row alone.

bfloat16 runs on every CPU: where the CPU has no bf16 units the kernels widen bf16 to
fp32 (slower, the same claims). The two tiny models take the two matmul paths a bf16
model can take: hidden size 64 goes to AMX tiles on a CPU that has them, 48 (not a
multiple of 32) to the vector loop everywhere.
"""
import pytest
import torch

from nanopaged import LLM, SamplingParams
from nanopaged.layers.backends import KernelOps, get_ops

from conftest import make_tiny_llama
from error_bounds import matmul_bound

# bfloat16's unit roundoff: 8 significant bits, neighbours 2^-7 apart at 1, so rounding
# to nearest moves a value by at most 2^-8 of it (measured: 0.0039 on the kernel's output)
BF16_U = 2.0 ** -8

pytestmark = pytest.mark.exactness

DTYPES = ["float32", "bfloat16"]
TARGET = list(range(20, 50))                    # the watched request: 30 prompt tokens
OTHERS = [list(range(100, 107)), list(range(60, 101)), [5, 6, 7]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module", params=[64, 48], ids=["hidden64", "hidden48"])
def model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"invariance-{request.param}")
    make_tiny_llama(folder, hidden_size=request.param, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=2 * request.param)
    return folder


def watched(llm, prompts, params=PARAMS):
    """The target's output (token ids, per-step top-5 logprobs) from a generate of prompts."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    out = next(o for o in outs if o.prompt_token_ids == TARGET).outputs[0]
    return out.token_ids, out.logprobs


def engine(folder, dtype, **kw):
    kw = dict(block_size=4, num_gpu_blocks=128, enable_prefix_caching=False, dtype=dtype) | kw
    return LLM(str(folder), **kw)


@pytest.fixture(scope="module")
def alone(model_dir):
    return {dtype: watched(engine(model_dir, dtype), [TARGET]) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_alone_and_in_any_batch(model_dir, alone, dtype):
    llm = engine(model_dir, dtype)
    for batch in ([TARGET, *OTHERS], [*OTHERS[:2], TARGET], [OTHERS[2], TARGET, OTHERS[0]]):
        assert watched(llm, batch) == alone[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_after_a_prefix_cache_hit(model_dir, alone, dtype):
    llm = engine(model_dir, dtype, enable_prefix_caching=True)
    llm.generate([TARGET[:17] + [3, 4]], PARAMS, use_tqdm=False)     # caches TARGET's first 4 blocks
    hits = llm.engine.get_stats()["prefix_cache_hits"]
    assert watched(llm, [TARGET]) == alone[dtype]
    assert llm.engine.get_stats()["prefix_cache_hits"] > hits
    assert watched(llm, [TARGET, *OTHERS]) == alone[dtype]           # a hit of 28 tokens, batched


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_prefilled_in_chunks(model_dir, alone, dtype):
    llm = engine(model_dir, dtype, max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=True)
    chunks = []
    model = llm.engine.model_runner.model
    forward = model.forward
    model.forward = lambda ids, *a: chunks.append(len(ids)) or forward(ids, *a)
    assert watched(llm, [TARGET]) == alone[dtype]
    assert chunks[:4] == [8, 8, 8, 6]                                  # 30 prompt tokens in 4 chunks
    assert watched(llm, [OTHERS[1], TARGET, OTHERS[0]]) == alone[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_after_a_recompute_preemption(model_dir, alone, dtype):
    # 14 blocks of 4: the three requests cannot all keep growing; the latest arrival
    # (the target) is preempted and later recomputes its prompt and outputs in one prefill
    llm = engine(model_dir, dtype, num_gpu_blocks=14, preemption_mode="recompute")
    assert watched(llm, [OTHERS[1], OTHERS[0], TARGET]) == alone[dtype]
    assert llm.engine.get_stats()["num_preemptions_recompute"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_n2_chat_is_the_same_on_a_cache_hit(model_dir, dtype):
    """Field case C45 (C45s in CASES.md): LLM.chat of one user message, n=2, temperature 1, seed 1234, three
    times in one engine: the second and third run hit the prefix cache, and all three
    give the same two samples (in bf16 the first once differed from the two hits)."""
    llm = engine(model_dir, dtype, enable_prefix_caching=True)
    params = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=16)
    chat = [{"role": "user", "content": "Paged attention splits the KV cache into blocks."}]
    runs = [[c.token_ids for c in llm.chat(chat, params, use_tqdm=False)[0].outputs] for _ in range(3)]
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_sampling_gives_the_same_text_on_a_cache_hit(model_dir, dtype):
    llm = engine(model_dir, dtype, enable_prefix_caching=True)
    params = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    runs = [[c.token_ids for c in llm.generate([TARGET], params, use_tqdm=False)[0].outputs] for _ in range(3)]
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    assert runs[0] == runs[1] == runs[2]


# -- the matmul itself --------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels():
    backend = get_ops("cpu", "cpu")
    assert isinstance(backend, KernelOps)
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (77, 64), (33, 48)])
@pytest.mark.parametrize("path", ["vector", "packed"])
def test_the_kernel_matmul_gives_a_row_the_same_bits_in_every_batch(kernels, dtype, n, k, path):
    """Every m from 1 to 40 and a few larger, every row position: equal to the row alone.
    "packed" is the AMX path where the CPU has it and the weight fits it (bf16, k a
    multiple of 32); pack_weight says None elsewhere and the vector loop runs."""
    torch.manual_seed(n + k)
    weight = torch.randn(n, k, dtype=dtype) * 0.05
    x = torch.randn(100, k, dtype=dtype)
    packed = kernels.pack_weight(weight) if path == "packed" else None
    for out_dtype in {dtype, torch.float32}:
        def linear(rows):
            return kernels.linear(rows, weight, out_dtype, packed=packed)
        alone = torch.cat([linear(x[i:i + 1]) for i in range(len(x))])
        for m in [*range(1, 41), 47, 64, 65, 100]:
            assert torch.equal(linear(x[:m]), alone[:m]), (m, out_dtype)
        assert torch.equal(linear(x.flip(0)), alone.flip(0))
        # an fp32 dot product of k terms (bf16 products are exact in fp32) in any order:
        # within (k + 1) u sum |x||w| of exact (matmul_bound); a bf16 output rounds once
        # more, BF16_U of its magnitude. Measured: fp32 outputs at most 0.04 of it; bf16
        # outputs 0.99 (a rounding to nearest can move a value by nearly half a step)
        exact = torch.nn.functional.linear(x.double(), weight.double())
        bound = matmul_bound(x, weight, k + 1)
        if out_dtype == torch.bfloat16:
            bound = bound + BF16_U * (exact.abs() + bound)
        err = (alone.double() - exact).abs()
        assert (err <= bound).all(), (err / bound).max()


def test_pack_weight_takes_bf16_weights_whose_k_is_a_multiple_of_32(kernels):
    has_amx = hasattr(kernels.ops, "linear_amx")
    assert (kernels.pack_weight(torch.zeros(10, 64, dtype=torch.bfloat16)) is not None) == has_amx
    assert kernels.pack_weight(torch.zeros(10, 48, dtype=torch.bfloat16)) is None
    assert kernels.pack_weight(torch.zeros(10, 64)) is None


# -- the attention kernel itself ----------------------------------------------------------

def _paged(kernels, q, k, v, q_lens, block_size, seed):
    """paged_attention over sequences whose K/V (lists of [len, kv_heads, head_size]) are
    scattered into shuffled blocks of `block_size` slots. q: [sum(q_lens), heads, head_size]."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-len(kk) // block_size) for kk in k)
    num_blocks = len(k) * max_blocks
    kv_heads, head_size = k[0].shape[1:]
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_size, dtype=q.dtype)
    value_cache = torch.zeros_like(key_cache)
    block_tables = torch.randperm(num_blocks, generator=g).view(len(k), max_blocks).contiguous()
    for s, (kk, vv) in enumerate(zip(k, v)):
        slots = (block_tables[s].repeat_interleave(block_size) * block_size +
                 torch.arange(block_size).repeat(max_blocks))[:len(kk)]
        key_cache.view(-1, kv_heads, head_size)[slots] = kk
        value_cache.view(-1, kv_heads, head_size)[slots] = vv
    seq_lens = torch.tensor([len(kk) for kk in k])
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0)
    out = torch.empty_like(q)
    kernels.ops.paged_attention(out, q.contiguous(), key_cache, value_cache, block_tables, seq_lens,
                                query_start_loc, len(q[0][0]) ** -0.5)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_size", [(9, 3, 64), (14, 2, 64), (4, 4, 80)])
def test_attention_kernel_gives_a_row_the_same_bits_in_every_batch_and_block_size(
        kernels, dtype, heads, kv_heads, head_size):
    """A sequence's output rows are equal, bit for bit, computed alone at block size 16
    and beside other sequences at block sizes 16, 4 and 1 (keys land at other offsets of
    a block, so the kernel's groups of four keys fall elsewhere), for prefill, chunk and
    decode rows. Groups of 3 and 7 query heads per KV head: the kernel takes up to 4
    heads per pass over a K/V row, so 7 is a pass of 4 and one of 3."""
    torch.manual_seed(heads + head_size)
    lens, q_lens = [37, 1, 50, 23], [37, 1, 9, 1]           # prefill, decode, chunk, decode
    k = [torch.randn(n, kv_heads, head_size, dtype=dtype) for n in lens]
    v = [torch.randn(n, kv_heads, head_size, dtype=dtype) for n in lens]
    q = [torch.randn(n, heads, head_size, dtype=dtype) for n in q_lens]
    together = {bs: _paged(kernels, torch.cat(q), k, v, q_lens, bs, seed=bs).split(q_lens)
                for bs in (16, 4, 1)}
    for s in range(len(lens)):
        alone = _paged(kernels, q[s], [k[s]], [v[s]], [q_lens[s]], 16, seed=s)
        for bs, outs in together.items():
            assert torch.equal(outs[s], alone), (s, bs)


# -- the real model ----------------------------------------------------------------------

ROMAN = "The history of the Roman empire"
FIFTEEN = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
           "def fibonacci(n):", "Once upon a time", "The three laws of motion are", "List five fruits:",
           "Translate 'good morning' into Spanish:", "SELECT * FROM users WHERE", "The mitochondria is",
           "Dear hiring manager,", "In 1969, Apollo 11", "A recipe for pancakes:", "import numpy as np",
           "The best way to learn a language is"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_real_model_gives_a_prompt_the_same_bits_as_the_7th_of_16(default_model_dir, dtype):
    """Field case C63 on SmolLM2-135M-Instruct: greedy, 64 new tokens, the prompt alone and
    then as the 7th of 16 different prompts: the same text, and the sampled tokens'
    logprobs equal as floats, in float32 and in bfloat16 (where `auto` picks bf16, on an
    AMX CPU, the text once parted at the 4th character)."""
    llm = LLM(str(default_model_dir), dtype=dtype, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=1)
    alone = llm.generate([ROMAN], params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate(FIFTEEN[:6] + [ROMAN] + FIFTEEN[6:], params, use_tqdm=False)[6].outputs[0]
    assert batched.text == alone.text
    assert batched.token_ids == alone.token_ids and batched.logprobs == alone.logprobs
