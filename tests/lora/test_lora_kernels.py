"""The batched LoRA kernels, Punica's BGMV shrink and expand (kernels/cpu/lora/bgmv.cpp,
kernels/cuda/lora.cu), against the PyTorch reference (nanopaged/lora/punica.py).

Close to the reference, within bounds derived from each sum's length (tests/error_bounds.py).
Equal, bit for bit, where the kernel promises it: a row alone and in a batch (batch
invariance), rows without an adapter (slot -1), and every instruction-set body of the CPU
kernel (shrink's dot products in 16 fp32 lanes and one fixed tree, expand's one chain of
FMAs per output column, in every body). The CUDA
kernel is compiled by nvcc here, and run on a GPU by kernels/gpu_check.py.
"""
from __future__ import annotations

import shutil
import sysconfig

import pytest
import torch
from error_bounds import FP32_U, assert_within, rounded_apart
from torch.utils._python_dispatch import TorchDispatchMode

from nanopaged.layers import build
from nanopaged.layers.backends import TorchOps, get_ops
from nanopaged.lora.kernels import load_lora_kernels
from nanopaged.lora.punica import add_lora, bgmv_expand, bgmv_shrink

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SLOTS = [2, -1, 0, 1, 2, 2, -1, 0, 1, 0, 2]        # 11 rows over 3 slots; -1: no adapter
SCALES = [0.5, 2.0, 0.125]
HAS_GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def lora():
    return load_lora_kernels()


def lora_case(dtype, rank, in_features, out_features, seed=0, device="cpu"):
    """x [n, in], a [3, rank, in], b [3, out, rank] in dtype; slots [n]; scales [3];
    t [n, rank] fp32; y [n, out] in dtype, a column slice of a wider `wide`."""
    g = torch.Generator().manual_seed(seed)
    n = len(SLOTS)
    x = torch.randn(n, in_features, generator=g).to(dtype)
    a = (torch.randn(3, rank, in_features, generator=g) / in_features ** 0.5).to(dtype)
    b = torch.randn(3, out_features, rank, generator=g).to(dtype)
    t = torch.randn(n, rank, generator=g)
    wide = torch.randn(n, out_features + 40, generator=g).to(dtype)
    case = dict(x=x, a=a, b=b, slots=torch.tensor(SLOTS), scales=torch.tensor(SCALES), t=t, wide=wide)
    case = {k: v.to(device) for k, v in case.items()}
    case["y"] = case["wide"][:, 24:24 + out_features]        # rows out + 40 apart: qkv's middle
    return case


def gathered(w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """w [num_slots, ...] in float64, the slot of each row (slot -1: slot 0, masked later)."""
    return w.double()[slots.clamp(min=0)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers: NaN and -0.0 compare as themselves."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def shrink_bound(x, a, slots):
    """(exact, bound) [n, r] float64: t[i, k] is an in-term fp32 sum of exact products
    (bf16 and fp16 widen exactly), in + 1 roundings a side of sum |x a| (matmul_bound)."""
    ag = gathered(a, slots)
    exact = torch.einsum("ni,nri->nr", x.double(), ag)
    return exact, (x.shape[1] + 1) * FP32_U * torch.einsum("ni,nri->nr", x.double().abs(), ag.abs())


def expand_bound(y, t, b, slots, scales):
    """(exact, bound) [n, out] float64, from the same fp32 t and y on both sides: the r-term
    sum (r + 1 roundings of sum |t b|), the scale and the add (one each; the kernel fuses
    them): (r + 3) u |scale| sum |t b| + u |y| a side, twice that apart, then each side
    rounded once to y's dtype (rounded_apart)."""
    bg, scale = gathered(b, slots), scales.double()[slots.clamp(min=0)][:, None]
    exact = y.double() + scale * torch.einsum("nr,nor->no", t.double(), bg)
    size = scale.abs() * torch.einsum("nr,nor->no", t.double().abs(), bg.abs())
    fp32 = (t.shape[1] + 3) * FP32_U * size + FP32_U * y.double().abs()
    return exact, rounded_apart(2 * fp32, exact, y.dtype)


# ---- close to the reference ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [1, 8, 16, 64])
@pytest.mark.parametrize("in_features", [64, 333, 2048])
def test_shrink_is_close_to_the_reference(lora, dtype, rank, in_features):
    c = lora_case(dtype, rank, in_features, 8)
    got, want = (torch.full((len(SLOTS), rank), float("nan")) for _ in range(2))
    lora.lora_shrink(got, c["x"], c["a"], c["slots"])
    bgmv_shrink(want, c["x"], c["a"], c["slots"])
    exact, bound = shrink_bound(c["x"], c["a"], c["slots"])
    keep = c["slots"] >= 0
    assert_within(got[keep], exact[keep], bound[keep], "kernel")
    assert_within(want[keep], exact[keep], bound[keep], "reference")
    assert (got[~keep] == 0).all() and (want[~keep] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [1, 8, 16, 64])
@pytest.mark.parametrize("out_features", [64, 300])
def test_expand_into_a_column_slice_is_close_to_the_reference(lora, dtype, rank, out_features):
    c = lora_case(dtype, rank, 64, out_features)
    exact, bound = expand_bound(c["y"], c["t"], c["b"], c["slots"], c["scales"])
    got_wide, want_wide = c["wide"].clone(), c["wide"].clone()
    got, want = got_wide[:, 24:24 + out_features], want_wide[:, 24:24 + out_features]
    lora.lora_expand(got, c["t"], c["b"], c["slots"], c["scales"])
    bgmv_expand(want, c["t"], c["b"], c["slots"], c["scales"])
    assert_within(got, want, bound)
    for w in (got_wide, want_wide):           # the columns outside the slice are not touched
        assert torch.equal(w[:, :24], c["wide"][:, :24]) and torch.equal(w[:, 24 + out_features:],
                                                                          c["wide"][:, 24 + out_features:])


# ---- equal: batch invariance, untouched rows -------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_alone_gets_the_bits_it_gets_in_a_batch(lora, dtype):
    c = lora_case(dtype, 16, 333, 300)
    t = torch.empty(len(SLOTS), 16)
    lora.lora_shrink(t, c["x"], c["a"], c["slots"])
    y = c["y"].clone()
    lora.lora_expand(y, t, c["b"], c["slots"], c["scales"])
    for i in range(len(SLOTS)):
        row, alone = torch.empty(1, 16), c["y"][i:i + 1].clone()
        lora.lora_shrink(row, c["x"][i:i + 1], c["a"], c["slots"][i:i + 1])
        lora.lora_expand(alone, row, c["b"], c["slots"][i:i + 1], c["scales"])
        assert torch.equal(row, t[i:i + 1]) and torch.equal(alone, y[i:i + 1]), f"row {i}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_without_an_adapter_keep_their_bits(lora, dtype):
    """Slot -1 rows hold NaN, -0.0 and inf: the kernel and the reference leave every bit."""
    c = lora_case(dtype, 8, 64, 64)
    none = c["slots"] < 0
    c["y"][none] = torch.tensor([float("nan"), -0.0, float("inf"), 1.0]).to(dtype).repeat(16)
    for expand in (lora.lora_expand, bgmv_expand):
        y = c["y"].clone()
        expand(y, c["t"], c["b"], c["slots"], c["scales"])
        assert torch.equal(bits(y[none]), bits(c["y"][none]))
        assert not torch.equal(y[~none], c["y"][~none])


# ---- equal: every instruction-set body -------------------------------------------------

@pytest.fixture(scope="module", params=["AVX2", "DEFAULT"])
def other_body(request):
    """The extension built for another capability than this run's own, or a skip."""
    if build.cpu_build_name(request.param) == build.cpu_build_name():
        pytest.skip(f"this run's own build is the {request.param} body: nothing to compare it with")
    try:
        return request.param, load_lora_kernels(request.param)
    except ValueError as e:                  # above this CPU: its instructions would fault
        pytest.skip(str(e))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_body_gives_the_native_bits(lora, other_body, dtype):
    """16 lanes in one AVX512 register, two AVX2 ones or 16 portable floats: the same FMAs
    and the same tree (shrink), the same chain per column (expand), so the same bits;
    lengths below, at and past the 16 lanes, 300 columns (a partial tile of 64)."""
    name, other = other_body
    assert other.build_info()["vector"] == {"AVX2": "avx2", "DEFAULT": "portable"}[name]
    for rank, in_features in ((1, 64), (8, 333), (16, 2048), (64, 1000), (3, 7)):
        c = lora_case(dtype, rank, in_features, 300, seed=rank)
        outs = []
        for module in (lora, other):
            t, y = torch.empty(len(SLOTS), rank), c["y"].clone()
            module.lora_shrink(t, c["x"], c["a"], c["slots"])
            module.lora_expand(y, c["t"], c["b"], c["slots"], c["scales"])
            outs.append((t, y))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (rank, in_features)


# ---- the dispatch ----------------------------------------------------------------------

def test_add_lora_runs_the_compiled_kernels_on_the_cpu_backend(lora):
    c = lora_case(torch.bfloat16, 8, 64, 64)
    ops, before = get_ops("cpu", "cpu"), lora.path_counts()["vector"]
    y, t = c["y"].clone(), torch.empty(len(SLOTS), 8)
    add_lora(ops, y, c["x"], c["a"], c["b"], c["slots"], c["scales"], t)
    assert lora.path_counts()["vector"] == before + 2
    want, t2 = c["y"].clone(), torch.empty(len(SLOTS), 8)
    lora.lora_shrink(t2, c["x"], c["a"], c["slots"])
    lora.lora_expand(want, t2, c["b"], c["slots"], c["scales"])
    assert torch.equal(y, want)


class _NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func not in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default), func
        return func(*args, **(kwargs or {}))


def test_the_reference_reads_no_slot_into_python():
    """No .item() or host read of slots (a CPU or CUDA graph could not replay one)."""
    c = lora_case(torch.float32, 8, 64, 64)
    y, want, t = c["y"].clone(), c["y"].clone(), torch.empty(len(SLOTS), 8)
    with _NoHostReads():
        add_lora(TorchOps(), y, c["x"], c["a"], c["b"], c["slots"], c["scales"], t)
    bgmv_shrink(t, c["x"], c["a"], c["slots"])
    bgmv_expand(want, t, c["b"], c["slots"], c["scales"])
    assert torch.equal(y, want)


# ---- bad inputs ------------------------------------------------------------------------

BAD_INPUTS = {   # name: (kernel, change to lora_case's inputs, message)
    "slot_past_the_end": ("lora_shrink", lambda c: {**c, "slots": c["slots"].clone().fill_(3)},
                          r"lora_shrink: slots\[0\] = 3 is outside \[-1, num_slots = 3\)"),
    "slot_below_minus_one": ("lora_expand", lambda c: {**c, "slots": torch.full_like(c["slots"], -2)},
                             r"lora_expand: slots\[0\] = -2 is outside \[-1, num_slots = 3\)"),
    "int32_slots": ("lora_shrink", lambda c: {**c, "slots": c["slots"].int()},
                    r"lora_shrink: slots must be a contiguous CPU int64 \[n = 11\]"),
    "a_in_another_dtype": ("lora_shrink", lambda c: {**c, "a": c["a"].bfloat16()},
                           r"lora_shrink: a must be Float \(the model's dtype\), got BFloat16"),
    "a_of_other_in_features": ("lora_shrink", lambda c: {**c, "a": c["a"][..., :60].contiguous()},
                               r"lora_shrink: a must be a contiguous CPU \[num_slots, 8, 64\] tensor, "
                               r"got \[3, 8, 60\]"),
    "float64": ("lora_shrink", lambda c: {**c, "x": c["x"].double(), "a": c["a"].double()},
                r"lora_shrink: dtype Double is not supported \(float32, bfloat16, float16\)"),
    "strided_x": ("lora_shrink", lambda c: {**c, "x": torch.randn(11, 128)[:, ::2]},
                  r"lora_shrink: x must be a CPU \[11, 64\] tensor with dense rows"),
    "out_of_other_rank": ("lora_shrink", lambda c: {**c, "t": torch.empty(11, 9)},
                          r"lora_shrink: out must be a CPU \[11, 8\] tensor"),
    "bf16_t": ("lora_expand", lambda c: {**c, "t": c["t"].bfloat16()}, r"lora_expand: t must be Float, got BFloat16"),
    "b_of_other_out_features": ("lora_expand", lambda c: {**c, "b": c["b"][:, :30].contiguous()},
                                r"lora_expand: b must be a contiguous CPU \[num_slots, 64, 8\] tensor"),
    "short_scales": ("lora_expand", lambda c: {**c, "scales": c["scales"][:2]},
                     r"lora_expand: scales must be a contiguous CPU float32 \[num_slots = 3\]"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_are_refused_by_name(lora, case):
    kernel, change, message = BAD_INPUTS[case]
    c = change(lora_case(torch.float32, 8, 64, 64))
    args = ((c["t"], c["x"], c["a"], c["slots"]) if kernel == "lora_shrink"
            else (c["y"], c["t"], c["b"], c["slots"], c["scales"]))
    with pytest.raises(RuntimeError, match=message):
        getattr(lora, kernel)(*args)


# ---- CUDA ------------------------------------------------------------------------------

@pytest.mark.slow          # ~3 minutes on 2 cores (torch's headers)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    """As tests/layers/test_kernels_cuda.py compiles attention.cu: torch's extension flags."""
    from layers.test_kernels_cuda import EXTENSION_FLAGS, nvcc_compile
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths
    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    flags = ["-DTORCH_EXTENSION_NAME=nanopaged_cuda_lora", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",      # a CPU-only torch lacks that one generated header
             *COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", *EXTENSION_FLAGS,
             *(arg for p in includes for arg in ("-isystem", p))]
    nvcc_compile(build.KERNELS_DIR / "cuda" / "lora.cu", tmp_path / "lora.o", flags)


@pytest.fixture(scope="module")
def cuda_lora():
    if not HAS_GPU:
        pytest.skip("no CUDA GPU")
    return build.load_extension("nanopaged_cuda_lora", ("cuda/lora.cu",), "cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [1, 16, 64])
def test_cuda_kernels_are_close_batch_invariant_and_leave_unadapted_rows(cuda_lora, dtype, rank):
    """The CUDA twin: close to the exact values as the CPU kernel is (32 lanes and a
    shuffle tree: the same bound), a row alone equal to it in the batch, slot -1 untouched."""
    c = lora_case(dtype, rank, 2048, 300, device="cuda")
    t = torch.empty(len(SLOTS), rank, device="cuda")
    cuda_lora.lora_shrink(t, c["x"], c["a"], c["slots"])
    exact, bound = shrink_bound(c["x"].cpu(), c["a"].cpu(), c["slots"].cpu())
    keep = c["slots"].cpu() >= 0
    assert_within(t.cpu()[keep], exact[keep], bound[keep])
    assert (t.cpu()[~keep] == 0).all()
    y = c["y"].clone()
    cuda_lora.lora_expand(y, c["t"], c["b"], c["slots"], c["scales"])
    want = c["y"].cpu().clone()
    bgmv_expand(want, c["t"].cpu(), c["b"].cpu(), c["slots"].cpu(), c["scales"].cpu())
    _, bound = expand_bound(c["y"].cpu(), c["t"].cpu(), c["b"].cpu(), c["slots"].cpu(), c["scales"].cpu())
    assert_within(y.cpu(), want, bound)
    assert torch.equal(bits(y.cpu()[~keep]), bits(c["y"].cpu()[~keep]))
    for i in (0, 4, 10):
        row, alone = torch.empty(1, rank, device="cuda"), c["y"][i:i + 1].clone()
        cuda_lora.lora_shrink(row, c["x"][i:i + 1], c["a"], c["slots"][i:i + 1])
        cuda_lora.lora_expand(alone, c["t"][i:i + 1], c["b"], c["slots"][i:i + 1], c["scales"])
        assert torch.equal(row, t[i:i + 1]) and torch.equal(alone, y[i:i + 1]), f"row {i}"
