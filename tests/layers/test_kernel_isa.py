"""Every instruction-set body of the CPU kernel against the portable one, in one process.

The CPU kernels (kernels/cpu/, and the quantized matmuls' extension, kernels/cpu/quant/)
are one source with a body per instruction set, picked when it is compiled (vec.h's
namespace mm): AVX512 (16 lanes; with AVX512-BF16's vdpbf16ps for bf16
`linear` and AMX tiles for `linear_amx` where the CPU has them), AVX2 (8 lanes), and the
portable one (one lane, no vector extension). This run's own build (load_kernels) and, on
an AVX512 CPU, the AVX2 build too, are each compared with the portable build
(load_cpu_build("DEFAULT")) on the same inputs, so no body that this CPU can run ships
untried. On a CPU, or under ATEN_CPU_CAPABILITY, whose own build is the portable one,
there is nothing to compare it with, and the tests say so as skips.

Equal (the same operations in the same order in every body, so the same bits): the cache
ops (copies), quantize_activations_a8 (a max, one division, one multiply and rounding a
value), the residual add of fused_add_rms_norm, and bf16 RoPE (each product and the sum
rounded to bf16 apart: nothing to fuse or reorder).
Close (the lanes change the order of the sums, and an FMA build fuses what the portable
one rounds twice): attention, the matmuls, RMSNorm, SiLU-and-mul, fp32 RoPE; each bound
is derived in tests/error_bounds.py or beside the test, from the reduction's length and u.
"""
from __future__ import annotations

import gguf
import pytest
import torch
from error_bounds import (assert_within, matmul_bound, paged_attention_bound, rms_norm_bound, rope_bound,
                          rounded_apart, silu_and_mul_bound)
from gguf_blocks import kernel_roundings, random_quantized
from test_kernels import mixed_batch

from nanopaged.layers import build
from nanopaged.quantization.gguf_a8 import quantize_activations
from nanopaged.quantization.kernels import load_quant_kernels

T = gguf.GGMLQuantizationType
GGUF_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
OWN = torch.backends.cpu.get_cpu_capability()
# the bodies this CPU runs, as torch dispatches, other than the portable one
BODIES = [c for c in ("AVX512", "AVX2") if OWN.startswith("AVX512") or (c == "AVX2" and OWN == "AVX2")]


@pytest.fixture(scope="module")
def portable():
    return build.load_cpu_build("DEFAULT")


@pytest.fixture(scope="module", params=BODIES or ["none"])
def body(request):
    """(name, module): this run's own build for its own capability, else that build."""
    if request.param == "none":
        pytest.skip(f"torch runs this CPU at capability {OWN}: its build is the portable body itself")
    own = OWN.startswith(request.param)
    return request.param, build.load_kernels("cpu") if own else build.load_cpu_build(request.param)


@pytest.fixture(scope="module")
def quant_portable():
    return load_quant_kernels("DEFAULT")


@pytest.fixture(scope="module")
def quant_body(body):
    """(name, module): the quantization extension built as `body` is."""
    name, _ = body
    return name, load_quant_kernels(None if OWN.startswith(name) else name)


def test_each_build_compiled_the_body_it_is_named_for(body, portable):
    name, ops = body
    info = ops.build_info()
    assert info["vector"] == name.lower() and info["lanes"] == {"AVX512": 16, "AVX2": 8}[name]
    assert portable.build_info() == dict(vector="portable", lanes=1, avx512_bf16=False, amx=False, vnni=False)
    if name == "AVX512" and OWN.startswith("AVX512"):              # this run's own build: the CPU's units
        assert info["avx512_bf16"] == torch.cpu._is_avx512_bf16_supported()
        assert info["amx"] == torch.cpu._is_amx_tile_supported()


# ---- equal ----------------------------------------------------------------------------

def test_cache_ops_are_the_same_copies(body, portable):
    _, ops = body
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k, v = (torch.randn(9, 3, 40, generator=g).to(dtype) for _ in range(2))
        slots = torch.tensor([5, 0, 33, -1, 12, 7, 2, 40, 19])         # -1: padding, skipped
        caches = [torch.zeros(12, 4, 3, 40, dtype=dtype) for _ in range(4)]
        ops.reshape_and_cache(k, v, caches[0], caches[1], slots)
        portable.reshape_and_cache(k, v, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        kv = torch.randn(2, 2, 10, 4, 3, 8, generator=g).to(dtype)
        pool = [torch.zeros(2, 2, 6, 4, 3, 8, dtype=dtype) for _ in range(2)]
        copies = [kv.clone(), kv.clone()]
        for m, c, p in ((ops, copies[0], pool[0]), (portable, copies[1], pool[1])):
            m.copy_blocks(c, torch.tensor([1, 2]), torch.tensor([7, 8]))
            m.swap_blocks(c, p, torch.tensor([7, 3]), torch.tensor([0, 5]))
        assert torch.equal(copies[0], copies[1]) and torch.equal(pool[0], pool[1])


def test_int8_rounding_of_activations_is_the_same(quant_body, quant_portable):
    _, ops = quant_body
    x = torch.randn(7, 320, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0
    x[2, :32] = torch.arange(32) * 0.5 - 8                          # ties
    for a, b in zip(ops.quantize_activations_a8(x), quant_portable.quantize_activations_a8(x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_rope_and_the_residual_add_are_the_same(body, portable, dtype):
    _, ops = body
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(13, 6 * 64 + 2 * 2 * 64, generator=g).to(dtype)
    cos, sin = (torch.randn(50, 64, generator=g).to(dtype) for _ in range(2))
    positions = torch.randint(0, 50, (13,), generator=g)
    rotated = []
    for m in (ops, portable):
        q, k, _ = qkv.clone().split([384, 128, 128], dim=-1)
        m.rotary_embedding(positions, q, k, cos, sin, 64)
        rotated.append((q, k))
    assert torch.equal(rotated[0][0], rotated[1][0]) and torch.equal(rotated[0][1], rotated[1][1])
    x, res, w = torch.randn(5, 96, generator=g).to(dtype), torch.randn(5, 96, generator=g).to(dtype), \
        torch.randn(96, generator=g).to(dtype)
    residuals = []
    for m in (ops, portable):
        r = res.clone()
        m.fused_add_rms_norm(x.clone(), r, w, 1e-5)
        residuals.append(r)
    assert torch.equal(*residuals)


# ---- close ----------------------------------------------------------------------------



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(16, 4, 4), (32, 6, 2), (64, 9, 3), (128, 8, 2),
                                                              (40, 6, 6)])
def test_attention_agrees_within_fp32_summation(body, portable, dtype, head_size, num_heads, num_kv_heads):
    """Decodes, whole prompts, chunks and prefix-hit tails in one call; head size 40
    takes the run-time head loop, the others the compiled-in ones."""
    _, ops = body
    seq_lens, q_lens = [1, 7, 37, 13, 8, 40, 20], [1, 1, 37, 13, 4, 17, 1]
    query, kc, vc, meta = mixed_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_size, 4, dtype)
    outs = []
    for m in (ops, portable):
        out = torch.full_like(query, float("nan"))
        m.paged_attention(out, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                          head_size ** -0.5)
        outs.append(out)
    exact, bound = paged_attention_bound(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                         head_size ** -0.5, dtype)
    assert_within(outs[0], outs[1], bound)                    # two computations apart (attention_bound)
    assert_within(outs[0], exact, bound)                      # and so each from the exact value


def assert_both_near_the_product(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Two matmuls of x [m, k] and w [n, k] (fp32, or bf16 whose products are exact in
    fp32), each a k-term fp32 sum (k + 1 roundings a side) and one rounding to a bf16
    output: each within that of the exact product."""
    exact = x.double() @ w.double().T
    bound = rounded_apart(matmul_bound(x, w, x.shape[1] + 1), exact, got.dtype)
    assert_within(got, exact, bound)
    assert_within(want, exact, bound)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)], ids=str)
def test_linear_agrees_within_fp32_summation(body, portable, dtype, out_dtype):
    """k = 570 (not a multiple of 32: vdpbf16ps' masked tail), m = 1, 5 and 37 rows (the
    tiles' shapes), n = 37 (a short group of weight rows)."""
    _, ops = body
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 570, generator=g).to(dtype)
    for m in (1, 5, 37):
        x = torch.randn(m, 570, generator=g).to(dtype)
        got, want = torch.empty(m, 37, dtype=out_dtype), torch.empty(m, 37, dtype=out_dtype)
        ops.linear(got, x, w)
        portable.linear(want, x, w)
        assert_both_near_the_product(got, want, x, w)


def test_amx_tiles_agree_with_the_portable_matmul(portable):
    """linear_amx (tdpbf16ps: bf16 pairs summed into fp32 tiles, 32 of k a step) against
    the portable fp32 dot product, m = 1, 17 and 33 (one and three tiles of rows)."""
    from nanopaged.layers.backends import KernelOps
    ops = build.load_kernels("cpu")
    if not hasattr(ops, "linear_amx"):
        pytest.skip(f"this run's build ({ops.__name__}) has no AMX tiles: the CPU, or torch's capability, lacks them")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 576, generator=g).to(torch.bfloat16)
    packed = KernelOps(ops, "cpu").pack_weight(w)
    assert packed is not None
    for m in (1, 17, 33):
        x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
        for out_dtype in (torch.float32, torch.bfloat16):
            got, want = torch.empty(m, 40, dtype=out_dtype), torch.empty(m, 40, dtype=out_dtype)
            ops.linear_amx(got, x, packed)
            portable.linear(want, x, w)
            assert_both_near_the_product(got, want, x, w)
    assert ops.path_counts()["amx"] > 0


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_matmuls_agree_within_fp32_summation(quant_body, quant_portable, qtype):
    """gguf_linear: each body widens the blocks to the dequantized weights exactly and runs
    its fp32 matmul on them (tests/quantization/test_gguf_linear.py), so k + 1 roundings a side;
    gguf_linear_a8: integer block products (exact), then kernel_roundings(k) a side."""
    _, ops = quant_body
    k = 512 if qtype in K_QUANTS else 160
    qw, w = random_quantized(37, k, qtype)
    for m in (1, 3, 20):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got, want = torch.empty(m, 37), torch.empty(m, 37)
        ops.gguf_linear(got, x, qw, int(qtype))
        quant_portable.gguf_linear(want, x, qw, int(qtype))
        assert_both_near_the_product(got, want, x, w)
        ops.gguf_linear_a8(got, x, qw, int(qtype))
        quant_portable.gguf_linear_a8(want, x, qw, int(qtype))
        qx, dx, _ = quantize_activations(x)
        x_hat = (qx.double().view(m, -1, 32) * dx.double()[..., None]).view(m, k)
        exact = x_hat @ w.double().T
        assert_within(got, exact, matmul_bound(x_hat, w, kernel_roundings(k)))
        assert_within(want, exact, matmul_bound(x_hat, w, kernel_roundings(k)))


def test_int8_weights_agree_within_fp32_summation(quant_body, quant_portable):
    """int8_linear: each row widened to q * scale (one rounding, the same in every body)
    and summed as `linear` sums it: k + 1 roundings a side."""
    _, ops = quant_body
    g = torch.Generator().manual_seed(5)
    qw = torch.randint(-127, 128, (37, 576), generator=g, dtype=torch.int8)
    scale = torch.rand(37, generator=g) * 0.02
    w = qw.float() * scale[:, None]
    for m in (1, 7, 40):
        x = torch.randn(m, 576, generator=g)
        got, want = torch.empty(m, 37), torch.empty(m, 37)
        ops.int8_linear(got, x, qw, scale)
        quant_portable.int8_linear(want, x, qw, scale)
        assert_both_near_the_product(got, want, x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_ops_agree_within_their_roundings(body, portable, dtype):
    """RMSNorm, SiLU-and-mul and fp32 RoPE: the bounds of tests/error_bounds.py
    (rms_norm_bound, silu_and_mul_bound, rope_bound), each for two computations apart."""
    _, ops = body
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(9, 576, generator=g) * 3).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    outs = []
    for m in (ops, portable):
        out = torch.empty_like(x)
        m.rms_norm(out, x, weight, 1e-5)
        outs.append(out)
    assert_within(outs[0], outs[1], rms_norm_bound(x, weight, 1e-5)[1])
    gate_up = (torch.randn(9, 2 * 300, generator=g) * 4).to(dtype)
    outs = []
    for m in (ops, portable):
        out = torch.empty(9, 300, dtype=dtype)
        m.silu_and_mul(out, gate_up)
        outs.append(out)
    assert_within(outs[0], outs[1], silu_and_mul_bound(gate_up)[1])
    if dtype == torch.float32:
        qkv = torch.randn(11, 4 * 64 + 2 * 64, generator=g)
        cos, sin = torch.randn(30, 64, generator=g), torch.randn(30, 64, generator=g)
        positions = torch.randint(0, 30, (11,), generator=g)
        rotated = []
        for m in (ops, portable):
            q, k, _ = qkv.clone().split([256, 64, 64], dim=-1)
            m.rotary_embedding(positions, q, k, cos, sin, 64)
            rotated.append(torch.cat([q, k], dim=-1).view(11, 5, 64))
        bound = rope_bound(qkv[:, :320].view(11, 5, 64), cos[positions], sin[positions])
        assert_within(rotated[0], rotated[1], bound)


def test_each_build_counts_its_own_paths(body, portable):
    """A bf16 `linear` counts one kernel call, and one on vdpbf16ps where the build has it,
    in that build's counters alone: two builds in one process share no static object
    (layers/build.py builds with -fno-gnu-unique), scratch buffers included."""
    _, ops = body
    before, portable_before = dict(ops.path_counts()), dict(portable.path_counts())
    x, w = torch.randn(2, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    ops.linear(torch.empty(2, 3), x, w)
    after = ops.path_counts()
    assert after["vector"] == before["vector"] + 1
    assert after["avx512_bf16"] == before["avx512_bf16"] + int(ops.build_info()["avx512_bf16"])
    assert portable.path_counts() == portable_before
