"""The CUDA kernels (kernels/cuda/attention.cu) agree with the PyTorch reference.

Three layers, so that the kernels are checked on every machine, GPU or not:

1. nvcc compiles the extension (with the flags torch uses for extensions) and the dev
   file kernels/dev/paged_attention_dev.cu for sm_90; a compile that passed is not
   repeated while its preprocessed code, flags and compilers stay the same
   (nvcc_check_key). Skipped without nvcc.
2. The kernels' own source, compiled for the CPU against tests/layers/simt/simt.h (a tiny SIMT
   emulator), runs the attention and cache-op cases below. Skipped without g++ and
   CUDA's headers.
3. The built extension runs the same cases and more on a GPU. Skipped without one.

Tolerances: the kernel reads the dtype's values exactly and does all its math in fp32, so
its error is fp32 rounding plus one rounding of the output to the dtype. We compare with
the reference in float64, within a bound derived per output element from the row's
context length, head size and values (decode_bound): fp32's unit roundoff u = 2^-24 times
the roundings each sum's terms pass, plus one rounding to fp16 (u = 2^-11) or bf16
(2^-8) of the output.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from nanopaged.model.model_loader import cache_dir
from nanopaged.layers.attention import _decode, write_kv

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "kernels" / "cuda" / "attention.cu"
DEV = ROOT / "kernels" / "dev" / "paged_attention_dev.cu"
SIMT = ROOT / "tests" / "layers" / "simt"
EXTENSION_FLAGS = ["-O3"]          # what kernels/cuda/attention.cu needs from the loader
FP32_U = 2.0 ** -24
# a rounding to nearest moves a value by at most u of it: p significant bits, u = 2^-p
OUTPUT_U = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
HAS_GPU = torch.cuda.is_available()


def load_cuda_extension():
    """Build (first time, ~1-3 minutes) and import the extension through the engine's loader."""
    from nanopaged.layers.build import load_kernels
    return load_kernels("cuda")


# ---------------------------------------------------------------- 1. nvcc compile check

def cuda_include_dir() -> Path | None:
    """CUDA's include folder (cuda_fp16.h), or None. /usr/local/bin/nvcc may be a wrapper
    script, so its location alone does not say where the toolkit is."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", nvcc and Path(nvcc).resolve().parents[1]]
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_fp16.h").exists():
            return Path(home) / "include"
    return None


def nvcc_compile(source: Path, out: Path, flags: list[str]) -> None:
    """nvcc -c `source` for sm_90; fails the test with nvcc's output. Skipped when this
    exact compile has passed before (a marker named by nvcc_check_key, written only after
    a compile succeeds): ~10 s of preprocessing instead of ~3 minutes for the extension.
    Delete cache_dir()/nvcc-check (or point $NANOPAGED_CACHE elsewhere) to force a compile."""
    cmd = ["nvcc", "-c", str(source), "-std=c++17", "-O3", "-gencode", "arch=compute_90,code=sm_90", *flags]
    key = nvcc_check_key(cmd)
    marker = cache_dir() / "nvcc-check" / key if key else None
    if marker is not None and marker.exists():
        return
    proc = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(" ".join(cmd) + "\n")


def nvcc_check_key(cmd: list[str]) -> str | None:
    """sha256 of what the nvcc command `cmd` compiles, or None (then the test compiles).

    ccache's preprocessor mode: same preprocessed translation units + same flags + same
    compilers = same result, so a compile that passed once passes again. nvcc
    preprocesses a .cu file twice, for the device (__CUDA_ARCH__ defined) and for the host,
    and `nvcc -E` prints only the device pass; so we run the two preprocessor commands
    that `nvcc --dryrun` lists, as listed, writing to stdout instead of their -o file
    (byte for byte the .ii files `nvcc -keep` leaves). The key covers their output (the
    text of every header either pass reads, as the compile reads it), the listed
    commands of every step (all flags, temp file names masked; NVCC_APPEND_FLAGS shows
    here) and `--version` of nvcc and of the host compiler, all with the checkout's and
    the venv's folders masked (_without_checkout_paths). Not covered: the toolkit's
    own files that its steps read after preprocessing (crt/host_runtime.h, libdevice),
    which change with nvcc's version.
    """
    listing = subprocess.run([*cmd, "--dryrun"], capture_output=True, text=True)
    commands = [line[3:] for line in listing.stderr.splitlines()
                if line.startswith("#$ ") and not re.match(r"#\$ \w+=", line)]      # not VAR=value
    passes = [argv for argv in map(shlex.split, commands) if "-E" in argv and "-o" in argv]
    if listing.returncode != 0 or len(passes) < 2:           # a host pass and a device pass
        return None
    passes = [argv[:argv.index("-o")] + argv[argv.index("-o") + 2:] for argv in passes]
    with ThreadPoolExecutor(2) as pool:             # ~4 s each for the extension
        runs = list(pool.map(lambda argv: subprocess.run(argv, capture_output=True), passes))
    versions = [subprocess.run([tool, "--version"], capture_output=True).stdout
                for tool in ("nvcc", passes[0][0])]
    if any(run.returncode != 0 for run in runs):
        return None                                 # the compile will say why
    key = hashlib.sha256()
    masked = re.sub(r"tmpxft_\w+?-", "tmpxft-", "\n".join(commands))     # tmpxft_<pid>_<n>-
    for part in [masked.encode(), *versions, *(run.stdout for run in runs)]:
        key.update(hashlib.sha256(_without_checkout_paths(part)).digest())
    return key.hexdigest()


def _without_checkout_paths(text: bytes) -> bytes:
    """`text` with the repository's folder and the one torch is installed in (a venv's
    site-packages) replaced by placeholders: they appear in the commands, the line
    markers and __FILE__ strings, but where a checkout lies does not change whether it
    compiles. Checked: two clones sharing one venv get the same key. Not yet: a clone
    with its own fresh venv (CI's) missed the marker of another such clone in one trial
    (2026-12-01), cause not found; it then compiles, as without the cache."""
    site_packages = Path(torch.__file__).resolve().parents[1]     # first: it may lie in the repo
    for folder, name in ((site_packages, b"<site-packages>"), (ROOT, b"<repo>")):
        text = text.replace(str(folder).encode(), name)
    return text


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.mark.slow          # ~3 minutes on 2 cores (torch's headers), ~10 s once cached
@needs_nvcc
def test_extension_compiles_with_nvcc(tmp_path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths
    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    flags = ["-DTORCH_EXTENSION_NAME=nanopaged_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             # A CPU-only torch wheel ships c10/cuda's headers but not the one file CMake
             # generates for them (c10/cuda/impl/cuda_cmake_macros.h, which only defines
             # C10_CUDA_BUILD_SHARED_LIBS for Windows DLL exports); this macro is c10's
             # own switch to skip it. A CUDA wheel has the file; the flag is then a no-op.
             "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
             *COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", *EXTENSION_FLAGS,
             *(arg for p in includes for arg in ("-isystem", p))]
    nvcc_compile(KERNEL, tmp_path / "attention.o", flags)


@needs_nvcc
def test_dev_kernels_compile_with_nvcc(tmp_path):
    nvcc_compile(DEV, tmp_path / "paged_attention_dev.o", [])


@needs_nvcc
def test_nvcc_check_key_follows_both_passes(tmp_path):
    """The cache's key changes with the code of either pass (`nvcc -E` alone would miss
    the host's), and is stable: the same command twice gives the same key."""
    source = tmp_path / "k.cu"

    def key(device_value, host_value):
        source.write_text(f"#ifdef __CUDA_ARCH__\n__device__ int x = {device_value};\n"
                          f"#else\nint x = {host_value};\n#endif\n")
        return nvcc_check_key(["nvcc", "-c", str(source), "-gencode", "arch=compute_90,code=sm_90"])

    base = key(1, 1)
    assert base is not None and key(1, 1) == base
    assert len({base, key(2, 1), key(1, 2)}) == 3


# ---------------------------------------------------------------- backends

class SimtOps:
    """The kernels run by the SIMT emulator on CPU tensors, same calls as the extension."""

    device = "cpu"
    DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def _ptrs(*tensors):
        return [ctypes.c_void_p(t.data_ptr()) for t in tensors]

    def paged_attention_decode(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale):
        assert out.is_contiguous() and query.stride(2) == 1 and key_cache.is_contiguous()
        _, block_size, num_kv_heads, head_size = key_cache.shape
        rc = self.lib.simt_paged_attention(
            self.DTYPE_CODE[query.dtype], head_size, *self._ptrs(out, query, key_cache, value_cache,
                                                                 block_tables, seq_lens),
            ctypes.c_int64(query.stride(0)), ctypes.c_int64(query.stride(1)), query.shape[0], query.shape[1],
            num_kv_heads, block_size, block_tables.shape[1], ctypes.c_float(scale))
        assert rc == 0

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        rc = self.lib.simt_reshape_and_cache(
            key.element_size(), *self._ptrs(key, value, key_cache, value_cache, slot_mapping),
            *(ctypes.c_int64(s) for s in (key.stride(0), key.stride(1), value.stride(0), value.stride(1))),
            key.shape[0], key.shape[1], key.shape[2])
        assert rc == 0

    def copy_blocks(self, kv_cache, src, dst):
        chunk_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        rc = self.lib.simt_copy_blocks(*self._ptrs(kv_cache, src, dst), len(src), kv_cache.shape[0] * 2,
                                       ctypes.c_int64(kv_cache.shape[2]), ctypes.c_int64(chunk_bytes))
        assert rc == 0


class CudaOps:
    """The built extension on the GPU."""

    device = "cuda"

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        return getattr(self.module, name)


@pytest.fixture(scope="session")
def simt_ops(tmp_path_factory):
    include = cuda_include_dir()
    if shutil.which("g++") is None or include is None:
        pytest.skip("the SIMT emulator needs g++ and CUDA's headers (cuda_fp16.h)")
    folder = tmp_path_factory.mktemp("simt")
    # The one rewrite: dynamic shared memory becomes the emulator's per-block buffer.
    source, n = re.subn(r"extern __shared__ (\w+) (\w+)\[\];",
                        r"\1* \2 = reinterpret_cast<\1*>(::simt::dynamic_smem.data());", KERNEL.read_text())
    assert n == 1, "expected one `extern __shared__` declaration in cuda/attention.cu"
    (folder / "kernel.inc").write_text(source)
    lib = folder / "libsimt.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", f"-I{include}", f"-I{SIMT}",
           f'-DKERNEL_SOURCE="{folder / "kernel.inc"}"', str(SIMT / "harness.cpp"), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return SimtOps(ctypes.CDLL(str(lib)))


@pytest.fixture(scope="session")
def cuda_ops():
    if not HAS_GPU:
        pytest.skip("no CUDA GPU")
    return CudaOps(load_cuda_extension())


@pytest.fixture(params=["simt", "cuda"])
def ops(request):
    return request.getfixturevalue(f"{request.param}_ops")


# ---------------------------------------------------------------- attention

def make_decode_case(seq_lens, block_size, num_heads, num_kv_heads, head_size, dtype, seed=0):
    """Random q and caches, blocks scattered over the pool. Returns (kernel inputs, reference).

    The kernel's inputs are poisoned where it must not look: block-table padding points
    far outside the pool, and the unused slots of each last block hold NaN. The reference
    gets the same values with padding -> block 0 and NaN -> 0, in float64.
    """
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1          # + 1: a padded column
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=g).to(dtype)
    block_tables = torch.full((len(seq_lens), max_blocks), 1 << 40, dtype=torch.int64)
    perm, used = torch.randperm(num_blocks, generator=g), 0
    for i, n in enumerate(seq_lens):
        blocks = perm[used: used + -(-n // block_size)]
        used += len(blocks)
        block_tables[i, :len(blocks)] = blocks
        if n % block_size:
            for cache in (key_cache, value_cache):
                cache[blocks[-1], n % block_size:] = float("nan")
    seq_lens = torch.tensor(seq_lens)
    scale = head_size ** -0.5
    expected = _decode(query.double(), key_cache.double().nan_to_num(), value_cache.double().nan_to_num(),
                       torch.where(block_tables < num_blocks, block_tables, 0), seq_lens, scale)
    return (query, key_cache, value_cache, block_tables, seq_lens, scale), expected


def run_decode(ops, inputs):
    query, key_cache, value_cache, block_tables, seq_lens, scale = (
        x.to(ops.device) if isinstance(x, torch.Tensor) else x for x in inputs)
    out = torch.empty_like(query)
    ops.paged_attention_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale)
    return out.cpu()


def decode_bound(inputs, expected, dtype):
    """float64 [num_seqs, num_heads, head_size]: how far the kernel's decode output can be
    from the exact one, `expected`, per element. For a row of n = seq_len keys, head size
    d, weights w_j = softmax(l)_j, in fp32:
    - l_j = scale q . k_j: d products and their sum, and the scale: within
      (d + 2) u scale sum_i |q_i k_ji| (at most (d + 2) u c, c its largest over j);
    - x_j = l_j - max rounds once (u |x_j| <= u R, R the row's logit range; the max itself
      cancels in the normalised weights), and __expf is within (2 + 1.173 |x|) ulp
      (CUDA's table; an ulp is at most 2 u of the value): p_j within
      rho = (d + 2) u c + (4 + 3.35 R) u, relative;
    - out = (sum_j p_j v_j) / sum_j p_j: the weights p / sum p move by 2 rho relative, the
      numerator's n terms pass n + 1 roundings, the denominator's n - 1 and the division
      one: |out - exact| <= (2 rho + 2 (n + 1) u) sum_j w_j |v_j|;
    - a fp16 or bf16 output rounds once more: OUTPUT_U (|exact| + that)."""
    query, key_cache, value_cache, block_tables, seq_lens, scale = inputs
    num_heads, d = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    bound = torch.empty(expected.shape, dtype=torch.float64)
    for s, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[s, :-(-n // block_size)]
        keys, values = (c[blocks].double().reshape(-1, num_kv_heads, d)[:n]
                        .repeat_interleave(num_heads // num_kv_heads, 1)        # [n, heads, d]
                        for c in (key_cache, value_cache))
        q = query[s].double()                                                   # [heads, d]
        logits = scale * torch.einsum("hd,nhd->hn", q, keys)
        c = scale * torch.einsum("hd,nhd->hn", q.abs(), keys.abs()).amax(-1, keepdim=True)
        spread = logits.amax(-1, keepdim=True) - logits.amin(-1, keepdim=True)
        rho = (d + 2) * FP32_U * c + (4 + 3.35 * spread) * FP32_U
        weighted = torch.einsum("hn,nhd->hd", logits.softmax(-1), values.abs())
        bound[s] = (2 * rho + 2 * (n + 1) * FP32_U) * weighted
    return bound + OUTPUT_U[dtype] * (expected.abs() + bound)


def assert_close(out, expected, dtype, inputs):
    err, bound = (out.double() - expected).abs(), decode_bound(inputs, expected, dtype)
    assert (err <= bound).all(), (f"off by up to {err.max().item():.3g}, "
                                  f"{(err / bound).max().item():.3g} times the bound")


def ragged(block_size):
    """Context lengths around block boundaries: 1, one block, several, one past, one short,
    and two unaligned ones long enough that every warp takes several steps."""
    return sorted({1, block_size, 2 * block_size, 3 * block_size + 1, max(block_size - 1, 1), 37, 130})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_decode_matches_reference(ops, dtype, head_size, block_size, num_heads, num_kv_heads):
    inputs, expected = make_decode_case(ragged(block_size), block_size, num_heads, num_kv_heads, head_size, dtype)
    assert_close(run_decode(ops, inputs), expected, dtype, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [16, 32, 256])
def test_decode_other_head_sizes(ops, dtype, head_size):
    inputs, expected = make_decode_case(ragged(16), 16, 4, 2, head_size, dtype)
    assert_close(run_decode(ops, inputs), expected, dtype, inputs)


def test_decode_block_size_need_not_be_a_power_of_two(ops):
    inputs, expected = make_decode_case(ragged(3), 3, 6, 2, 64, torch.float32)
    assert_close(run_decode(ops, inputs), expected, torch.float32, inputs)


def test_decode_default_model_shape(ops):
    """SmolLM2-135M: 9 query heads over 3 kv heads, head_size 64, block_size 16, bf16."""
    inputs, expected = make_decode_case([1, 15, 16, 17, 200], 16, 9, 3, 64, torch.bfloat16)
    assert_close(run_decode(ops, inputs), expected, torch.bfloat16, inputs)


def test_decode_reads_query_through_its_strides(ops):
    """q may be a view of a fused qkv projection: [num_seqs, num_heads, head_size] with a
    token stride larger than num_heads * head_size."""
    (query, *caches, scale), expected = make_decode_case([5, 40], 16, 4, 2, 64, torch.float32)
    fused = torch.cat([query.reshape(2, -1), torch.full((2, 96), float("nan"))], dim=1).to(ops.device)
    view = fused[:, :4 * 64].view(2, 4, 64)
    assert not view.is_contiguous()
    out = torch.empty(view.shape, device=ops.device)
    ops.paged_attention_decode(out, view, *(c.to(ops.device) for c in caches), scale)
    assert_close(out.cpu(), expected, torch.float32, (query, *caches, scale))


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
@pytest.mark.parametrize("context", [2048, 5000, 20000], ids=lambda n: f"ctx{n}")
def test_decode_long_contexts(cuda_ops, context):
    """20000 tokens need 80 KB of logits: past the default 48 KB of shared memory."""
    inputs, expected = make_decode_case([context, context // 3, 1], 16, 8, 2, 128, torch.bfloat16)
    assert_close(run_decode(cuda_ops, inputs), expected, torch.bfloat16, inputs)


def _trim_head_size(a):
    return {**a, **{k: a[k][..., :48].contiguous() for k in ("out", "query", "key_cache", "value_cache")}}


BAD_DECODE_INPUTS = {
    "head_size": (_trim_head_size, "head_size 48 is not supported"),
    "gqa": (lambda a: {**a, "query": a["query"][:, :3].contiguous(), "out": a["out"][:, :3].contiguous()},
            "num_heads 3 is not a multiple of num_kv_heads 2"),
    "dtype_mismatch": (lambda a: {**a, "key_cache": a["key_cache"].half()}, "key_cache is Half but query is Float"),
    "int32_table": (lambda a: {**a, "block_tables": a["block_tables"].int()}, "block_tables must be int64"),
    "device": (lambda a: {**a, "seq_lens": a["seq_lens"].cpu()}, "seq_lens must be on cuda"),
    "float64": (lambda a: {k: v.double() if v.is_floating_point() else v for k, v in a.items()},
                "dtype Double is not supported"),
    "too_long": (lambda a: {**a, "block_tables": a["block_tables"].new_zeros(1, 20000)},
                 "block_tables of 20000 blocks x block_size 4 need 321024 bytes of shared memory per head"),
}


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
@pytest.mark.parametrize("case", BAD_DECODE_INPUTS)
def test_decode_rejects_bad_inputs_by_name(cuda_ops, case):
    change, message = BAD_DECODE_INPUTS[case]
    (query, key_cache, value_cache, block_tables, seq_lens, scale), _ = make_decode_case(
        [5], 4, 4, 2, 64, torch.float32)
    args = {"out": torch.empty_like(query), "query": query, "key_cache": key_cache, "value_cache": value_cache,
            "block_tables": block_tables, "seq_lens": seq_lens}
    args = change({k: v.cuda() for k, v in args.items()})
    with pytest.raises(RuntimeError, match=message):
        cuda_ops.paged_attention_decode(**args, scale=scale)


# ---------------------------------------------------------------- cache ops

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reshape_and_cache_writes_slots_and_skips_padding(ops, dtype):
    """K/V arrive as strided views of a fused qkv tensor; slot -1 is padding."""
    g = torch.Generator().manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_size, num_blocks, block_size = 7, 4, 2, 64, 5, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g).to(dtype)
    slots = torch.tensor([3, 17, -1, 0, 19, -1, 8])
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype) for _ in "kv"]

    def split(qkv):        # -> key, value: [num_tokens, num_kv_heads, head_size] views
        _, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=1)
        return k.view(num_tokens, num_kv_heads, head_size), v.view(num_tokens, num_kv_heads, head_size)

    expected = [c.clone() for c in caches]
    keep = slots >= 0
    key, value = split(qkv)
    write_kv(key[keep], value[keep], *expected, slots[keep])

    key, value = split(qkv.to(ops.device))
    assert not key.is_contiguous()
    key_cache, value_cache = (c.to(ops.device) for c in caches)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots.to(ops.device))
    assert torch.equal(key_cache.cpu(), expected[0]) and torch.equal(value_cache.cpu(), expected[1])


def test_copy_blocks_copies_every_layer_k_and_v(ops):
    """KernelOps.copy_blocks: kv_cache[:, :, dst] = kv_cache[:, :, src]."""
    g = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(3, 2, 10, 4, 2, 64, generator=g).to(torch.bfloat16)
    src, dst = torch.tensor([0, 3, 5, 5]), torch.tensor([7, 8, 9, 1])
    expected = kv_cache.clone()
    expected[:, :, dst] = expected[:, :, src]
    cache = kv_cache.to(ops.device)
    ops.copy_blocks(cache, src.to(ops.device), dst.to(ops.device))
    assert torch.equal(cache.cpu(), expected)


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
@pytest.mark.parametrize("direction", ["gpu_to_cpu", "cpu_to_gpu", "gpu_to_gpu"])
def test_swap_blocks_between_pools(cuda_ops, direction):
    """KernelOps.swap_blocks: dst_cache[:, :, dst] = src_cache[:, :, src]; the pools
    differ in num_blocks, the CPU one is pinned."""
    g = torch.Generator().manual_seed(3)
    gpu = torch.randn(2, 2, 10, 16, 3, 64, generator=g).to(torch.float16).cuda()
    other = torch.randn(2, 2, 6, 16, 3, 64, generator=g).to(torch.float16)
    other = other.cuda() if direction == "gpu_to_gpu" else other.pin_memory()
    src_cache, dst_cache = (other, gpu) if direction == "cpu_to_gpu" else (gpu, other)
    src, dst = torch.tensor([1, 4, 5]), torch.tensor([2, 0, 5])
    expected = dst_cache.cpu().clone()
    expected[:, :, dst] = src_cache.cpu()[:, :, src]
    cuda_ops.swap_blocks(src_cache, dst_cache, src, dst)
    torch.cuda.synchronize()
    assert torch.equal(dst_cache.cpu(), expected)


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_swap_blocks_rejects_out_of_range_ids(cuda_ops):
    gpu, cpu = torch.zeros(1, 2, 4, 2, 1, 16).cuda(), torch.zeros(1, 2, 3, 2, 1, 16)
    with pytest.raises(RuntimeError, match=r"pair 0 \(1 -> 3\) is out of range for 4 -> 3 blocks"):
        cuda_ops.swap_blocks(gpu, cpu, torch.tensor([1]), torch.tensor([3]))
