"""The C++ CPU kernels (kernels/cpu/) against the PyTorch reference,
and how the engine picks an attention backend.

Kernel against reference is a "close" claim: both compute in fp32 from the same inputs,
adding in other orders, and the kernel rounds its result once to the cache's dtype. Each
tolerance is derived from the reductions' lengths and u (tests/error_bounds.py:
paged_attention_bound, rms_norm_bound, silu_and_mul_bound, rope_bound); the reference,
computed in fp32, is held to the fp32 part of the same bound. The instruction-set bodies
against each other: test_kernel_isa.py. The CUDA kernel's tests are in test_kernels_cuda.py.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from error_bounds import assert_within, paged_attention_bound, rms_norm_bound, rope_bound, silu_and_mul_bound

from nanopaged import LLM, SamplingParams
from nanopaged.layers import attention, backends, build
from nanopaged.layers.backends import KernelOps, TorchOps, get_ops
from nanopaged.layers.build import KernelBuildError


@pytest.fixture(scope="module")
def ops():
    return build.load_kernels("cpu")


@pytest.fixture(autouse=True)
def fresh_kernel_state():
    """No loaded kernel, remembered build failure or fallback warning leaks between tests."""
    backends.forget_kernel_builds()
    yield
    backends.forget_kernel_builds()


def random_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype, seed=0):
    """Caches with every sequence's blocks at random places in a pool with spare blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1                      # padding the kernel must not read
    tables, used = [], 0
    for nb in blocks_per_seq:
        row = perm[used:used + nb]
        used += nb
        tables.append(row + [perm[-1]] * (max_blocks - nb))
    return key_cache, value_cache, torch.tensor(tables)


GRID = [  # (block_size, head_size, num_heads, num_kv_heads)
    (1, 64, 4, 4), (4, 64, 9, 3), (8, 128, 8, 2), (16, 64, 9, 3), (16, 128, 32, 8),
    (32, 64, 4, 1), (32, 128, 12, 4), (16, 40, 6, 6),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size,head_size,num_heads,num_kv_heads", GRID)
def test_cpu_decode_matches_reference(ops, dtype, block_size, head_size, num_heads, num_kv_heads):
    seq_lens = [1, block_size, 2 * block_size, 3 * block_size + 1, 37, max(block_size - 1, 1)]
    kc, vc, tables = random_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size).to(dtype)
    lens, scale = torch.tensor(seq_lens), head_size ** -0.5
    out = torch.full_like(query, float("nan"))
    ops.paged_attention_decode(out, query, kc, vc, tables, lens, scale)
    ref = attention._decode(query.float(), kc.float(), vc.float(), tables, lens, scale)
    assert out.dtype == dtype
    exact, bound = paged_attention_bound(query, kc, vc, tables, lens, torch.arange(len(seq_lens) + 1), scale, dtype)
    assert_within(out, exact, bound)
    assert_within(ref, exact, paged_attention_bound(query, kc, vc, tables, lens, torch.arange(len(seq_lens) + 1),
                                                    scale, torch.float32)[1])


def test_cpu_decode_reads_only_the_first_seq_len_tokens(ops):
    """Slots past seq_len (the rest of the last block, padded table entries) hold garbage."""
    kc, vc, tables = random_paged_kv([5, 9], 2, 64, 4, torch.float32)
    query, lens = torch.randn(2, 4, 64), torch.tensor([5, 9])
    clean = torch.empty_like(query)
    ops.paged_attention_decode(clean, query, kc, vc, tables, lens, 0.125)
    poisoned_k, poisoned_v = kc.clone(), vc.clone()
    for s, n in enumerate([5, 9]):
        last = tables[s, (n - 1) // 4]
        poisoned_k[last, (n - 1) % 4 + 1:] = float("nan")
        poisoned_v[last, (n - 1) % 4 + 1:] = float("nan")
    out = torch.empty_like(query)
    ops.paged_attention_decode(out, query, poisoned_k, poisoned_v, tables, lens, 0.125)
    torch.testing.assert_close(out, clean, atol=0, rtol=0)


def mixed_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """A step's batch: sequence s brings q_lens[s] queries, its last of seq_lens[s]
    positions (1 = decode, = seq_len: a whole prompt, in between: a chunk or a prefix hit)."""
    from nanopaged.layers.attention import AttentionMetadata
    kc, vc, tables = random_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype, seed)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    query = torch.randn(qsl[-1], num_heads, head_size, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=tables,
                             seq_lens=torch.tensor(seq_lens), query_start_loc=torch.tensor(qsl),
                             num_decodes=0, seq_lens_list=list(seq_lens), query_start_loc_list=qsl)
    return query, kc, vc, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size,head_size,num_heads,num_kv_heads", GRID)
def test_cpu_prefill_and_decode_rows_match_reference(ops, dtype, block_size, head_size, num_heads, num_kv_heads):
    """One call for a whole step: decodes, whole prompts, chunks and prefix-hit tails,
    against the reference's per-sequence causal SDPA."""
    b = block_size
    seq_lens = [1, 7, 37, 3 * b + 1, 2 * b, 40, 20]
    q_lens = [1, 1, 37, 3 * b + 1, b, 17, 1]
    query, kc, vc, meta = mixed_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_size, b, dtype)
    out = torch.full_like(query, float("nan"))
    ops.paged_attention(out, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                        head_size ** -0.5)
    ref = attention.paged_attention(query.float(), kc.float(), vc.float(), meta, head_size ** -0.5)
    exact, bound = paged_attention_bound(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                         head_size ** -0.5, dtype)
    assert_within(out, exact, bound)
    assert_within(ref, exact, paged_attention_bound(query, kc, vc, meta.block_tables, meta.seq_lens,
                                                    meta.query_start_loc, head_size ** -0.5, torch.float32)[1])


def test_cpu_prompt_rows_do_not_depend_on_how_the_prompt_is_split(ops):
    """A row's result depends on its query and keys only: a 45-token prompt computed in one
    call, in chunks of 16, or as the tail after a prefix-cache hit gives the same bits row
    for row (field case C36 asks this of the prefill path), at every block size."""
    query, kc, vc, meta = mixed_batch([45], [45], 9, 3, 64, 16, torch.bfloat16)
    whole = torch.empty_like(query)
    ops.paged_attention(whole, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
    for start, end in ((0, 16), (16, 32), (32, 45), (13, 45), (44, 45)):
        part = torch.empty_like(query[start:end])
        ops.paged_attention(part, query[start:end].contiguous(), kc, vc, meta.block_tables,
                            torch.tensor([end]), torch.tensor([0, end - start]), 0.125)
        assert torch.equal(part, whole[start:end]), (start, end)
    # ... and whatever the block size: the same 45 tokens' K/V laid out in blocks of 1, 4, 32
    keys = kc[meta.block_tables[0]].flatten(0, 1)[:45]               # [45, kv_heads, head_size]
    values = vc[meta.block_tables[0]].flatten(0, 1)[:45]
    for block_size in (1, 4, 32):
        num_blocks = -(-45 // block_size)
        caches = [torch.zeros(num_blocks * block_size, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
        caches[0][:45], caches[1][:45] = keys, values
        out = torch.empty_like(query)
        ops.paged_attention(out, query, caches[0].view(num_blocks, block_size, 3, 64),
                            caches[1].view(num_blocks, block_size, 3, 64), torch.arange(num_blocks)[None],
                            meta.seq_lens, meta.query_start_loc, 0.125)
        assert torch.equal(out, whole), block_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_layer_ops_match_the_reference(ops, dtype):
    """RMSNorm (alone and with the residual add), SiLU-and-mul and RoPE against the PyTorch
    reference (the same math, other orders and another exp): within the bounds of
    tests/error_bounds.py for two computations; the residual add is one add a side, equal."""
    g = torch.Generator().manual_seed(0)
    kernel, ref = KernelOps(ops, "cpu"), TorchOps()
    x, res = (torch.randn(37, 576, generator=g).mul(3).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=g).to(dtype)
    assert_within(kernel.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), rms_norm_bound(x, weight, 1e-5)[1])
    out, new_res = kernel.rms_norm(x.clone(), weight, 1e-5, res.clone())
    ref_out, ref_res = ref.rms_norm(x, weight, 1e-5, res)
    assert_within(out, ref_out, rms_norm_bound(ref_res, weight, 1e-5)[1])
    assert torch.equal(new_res, ref_res)                         # one add, same rounding
    gate_up = torch.randn(37, 2 * 1536, generator=g).mul(4).to(dtype)
    assert_within(kernel.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), silu_and_mul_bound(gate_up)[1])
    qkv = torch.randn(37, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)
    cos, sin = (torch.randn(100, 64, generator=g).to(dtype) for _ in range(2))
    positions = torch.randint(0, 100, (37,), generator=g)
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    ref_q, ref_k = ref.rotary_embedding(positions, q, k, cos, sin, 64)
    kq, kk, _ = qkv.clone().split([576, 192, 192], dim=-1)            # strided views, rotated in place
    kernel.rotary_embedding(positions, kq, kk, cos, sin, 64)
    assert_within(kq, ref_q, rope_bound(q.reshape(37, 9, 64), cos[positions], sin[positions]).view(37, 576))
    assert_within(kk, ref_k, rope_bound(k.reshape(37, 3, 64), cos[positions], sin[positions]).view(37, 192))


def test_fused_layer_ops_name_bad_arguments(ops):
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"weight must be \[hidden = 8\]"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 100 is outside the RoPE table \[0, 100\)"):
        ops.rotary_embedding(torch.tensor([0, 100, 3]), torch.randn(3, 8), torch.randn(3, 8),
                             torch.ones(100, 8), torch.ones(100, 8), 8)
    with pytest.raises(RuntimeError, match="x must be \\[n, 2d\\] and out \\[n, d\\]"):
        ops.silu_and_mul(torch.empty(3, 5), x)


def test_cpu_reshape_and_cache_matches_write_kv_with_strided_rows(ops):
    qkv = torch.randn(7, 3, 2, 16)                   # a fused projection: k, v are strided views
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, 0, 17, 8, 9, 31, 12])
    caches = [torch.zeros(8, 4, 2, 16) for _ in range(4)]
    ops.reshape_and_cache(k, v, caches[0], caches[1], slots)
    attention.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    ops.reshape_and_cache(k, v, caches[0], caches[1], torch.tensor([-1] * 7))   # padding: skipped
    assert torch.equal(caches[0], caches[2])


def test_cpu_copy_and_swap_blocks_match_the_reference(ops):
    kv = torch.randn(3, 2, 10, 4, 2, 8)
    cpu_pool = torch.zeros(3, 2, 6, 4, 2, 8)
    backend, ref = KernelOps(ops, "cpu"), TorchOps()
    kv_ref, pool_ref = kv.clone(), cpu_pool.clone()
    for b, c, p in ((backend, kv, cpu_pool), (ref, kv_ref, pool_ref)):
        b.copy_blocks(c, [(1, 7), (2, 8)])
        b.swap_blocks(c, p, [(7, 0), (3, 5)])
        b.swap_blocks(p, c, [(5, 9)])
    assert torch.equal(kv, kv_ref) and torch.equal(cpu_pool, pool_ref)
    assert torch.equal(kv[:, :, 9], kv[:, :, 3]) and torch.equal(cpu_pool[:, :, 0], kv[:, :, 1])


def test_cpu_kernel_errors_name_the_argument(ops):
    kc, vc, tables = random_paged_kv([4], 2, 64, 4, torch.float32)
    query = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 9"):
        ops.paged_attention_decode(torch.empty_like(query), query, kc, vc, tables, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        q3 = torch.randn(1, 3, 64)
        ops.paged_attention_decode(torch.empty_like(q3), q3, kc, vc, tables, torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError, match="block_tables must be contiguous int64"):
        ops.paged_attention_decode(torch.empty_like(query), query, kc, vc, tables.int(), torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 99"):
        ops.reshape_and_cache(torch.randn(1, 2, 64), torch.randn(1, 2, 64), kc, vc, torch.tensor([99]))


# -- choosing a backend -------------------------------------------------------------------

def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        get_ops("triton", "cpu")
    with pytest.raises(ValueError, match="attention_backend='cuda' cannot run a model on device 'cpu'"):
        get_ops("cuda", "cpu")
    assert isinstance(get_ops("torch", "cpu"), TorchOps)
    assert get_ops("cpu", "cpu").name == "cpu"


def test_auto_falls_back_to_the_reference_with_a_warning(monkeypatch):
    def broken(kind):
        raise KernelBuildError("no C++ compiler ('nope' is not on PATH)")
    monkeypatch.setattr(backends, "load_kernels", broken)
    with pytest.warns(UserWarning, match="not available .*no C\\+\\+ compiler.*PyTorch reference"):
        backend = get_ops("auto", "cpu")
    assert backend.name == "torch"
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler"):
        get_ops("cpu", "cpu")


def test_a_missing_compiler_is_a_clear_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))          # no cached build to load
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(KernelBuildError, match="'no-such-compiler' is not on PATH"):
        build.load_kernels("cpu")


def test_a_cached_build_loads_without_compiler_or_ninja(ops, monkeypatch):
    """The `ops` fixture left a build in the cache; a new process (here: forgotten caches)
    on a machine with neither c++ nor ninja imports it without calling either."""
    backends.forget_kernel_builds()
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("cpp_extension.load was called"))
    loaded = build.load_kernels("cpu")
    assert get_ops("auto", "cpu").name == "cpu"
    kc, vc, tables = random_paged_kv([5], 2, 64, 4, torch.float32)
    query, out = torch.randn(1, 4, 64), torch.empty(1, 4, 64)
    loaded.paged_attention_decode(out, query, kc, vc, tables, torch.tensor([5]), 0.125)
    want = torch.empty(1, 4, 64)
    ops.paged_attention_decode(want, query, kc, vc, tables, torch.tensor([5]), 0.125)
    assert torch.equal(out, want)                                # the same build's code: the same bits


def test_a_broken_cached_library_is_not_loaded(tmp_path):
    """A .so cut short (a build killed while linking) means "build again", not a crash."""
    (tmp_path / "nanopaged_cpu_x.so").write_bytes(b"\x7fELF cut short")
    assert build._load_cached_build("nanopaged_cpu_x", tmp_path / "nanopaged_cpu_x.so") is None


def test_checkouts_with_the_same_kernel_source_share_one_build(tmp_path, monkeypatch):
    """The build folder is named by the sources' (and their headers') contents and flags,
    not their path: a second clone, or the test suite's scratch wheel install, loads the
    build the first one made (and does not push it out of the cache); an edited header
    gets its own."""
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "cache"))
    asked = []

    def cached(name, library):                 # as if every build were there already
        library.parent.mkdir(parents=True, exist_ok=True)
        asked.append(library)
        return object()
    monkeypatch.setattr(build, "_load_cached_build", cached)
    clone = tmp_path / "another-clone"
    shutil.copytree(build.KERNELS_DIR / "cpu", clone / "cpu")
    sources = [build.KERNELS_DIR / s for s in build.KERNEL_SOURCES["cpu"]]
    copies = [clone / s for s in build.KERNEL_SOURCES["cpu"]]
    build.build_extension("nanopaged_cpu", sources, "cpu")
    build.build_extension("nanopaged_cpu", copies, "cpu")
    header = clone / "cpu" / "vec.h"
    header.write_bytes(header.read_bytes() + b"\n// edited\n")
    build.build_extension("nanopaged_cpu", copies, "cpu")
    assert asked[0] == asked[1] != asked[2]


def test_old_builds_are_pruned_keeping_the_most_recently_used(tmp_path):
    """After a new build, the cache keeps KEEP_BUILDS builds of that kernel (name, python
    and torch alike): the most recently used; other kernels and a build under way (its
    lock file) stay. One machine had 47 build folders (37 MB) before."""
    def folder(name, age_s, lock=False):
        d = tmp_path / name
        d.mkdir()
        (d / "last-used").touch()
        os.utime(d / "last-used", (time.time() - age_s,) * 2)
        if lock:
            (d / "lock").touch()
        return d

    prefix = "nanopaged_cpu_avx2-py311-torch2.13.0+cpu"
    new = folder(f"{prefix}-000000000000", 0)
    recent = [folder(f"{prefix}-00000000000{i}", 10 * i) for i in (1, 2)]
    old = [folder(f"{prefix}-00000000000{i}", 1000 * i) for i in (3, 4, 5)]
    building = folder(f"{prefix}-00000000000f", 5000, lock=True)
    other = [folder("nanopaged_cpu_avx2_x-py311-torch2.13.0+cpu-000000000009", 9000),
             folder("nanopaged_cpu_avx2-py312-torch2.13.0+cpu-000000000009", 9000)]
    removed = build.prune_builds(new, keep=3)
    assert sorted(removed) == sorted(old)
    assert sorted(p for p in tmp_path.iterdir()) == sorted([new, *recent, building, *other])


def test_a_failed_build_is_tried_once_and_auto_warns_once_at_the_callers_line(monkeypatch):
    builds = []

    def failing_build(name, source, kind):
        builds.append(name)
        raise KernelBuildError("no C++ compiler ('nope' is not on PATH)")
    monkeypatch.setattr(build, "build_extension", failing_build)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backends = [get_ops("auto", "cpu"), get_ops("auto", "cpu")]
    assert [b.name for b in backends] == ["torch", "torch"]
    assert builds == ["nanopaged_cpu"]
    assert len(caught) == 1 and "PyTorch reference" in str(caught[0].message)
    assert caught[0].filename == __file__                      # this file, not nanopaged's
    with pytest.raises(KernelBuildError, match="'nope' is not on PATH"):
        get_ops("cpu", "cpu")                          # the same error, no new build
    assert builds == ["nanopaged_cpu"]


def test_greedy_output_is_identical_whichever_backend_runs(tiny_model_dir):
    """Prefill, chunked prefill, prefix hits and decode, with a small block size, in
    float32. (In bf16 the two sum in other orders, the reference's oneDNN matmul and our
    kernel each rounding to bf16 its own way: on an AMX Xeon with the AVX2 build the
    outputs parted at token 20 of 24.)"""
    prompts = ["The capital of France is", "Hello, my name is", "Paged attention splits the KV",
               "The capital of France is Paris. Hello"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for name in ("torch", "cpu"):
        llm = LLM(str(tiny_model_dir), attention_backend=name, num_gpu_blocks=96, block_size=4,
                  max_num_batched_tokens=16, max_num_seqs=4, dtype="float32")
        assert llm.engine.attn_backend.name == name
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["torch"] == outs["cpu"]


def test_auto_engine_serves_with_the_reference_when_the_build_fails(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(backends, "load_kernels", lambda kind: (_ for _ in ()).throw(KernelBuildError("x")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(tiny_model_dir), num_gpu_blocks=32, block_size=4)
    assert llm.engine.attn_backend.name == "torch"
    fallback = [w for w in caught if "PyTorch reference" in str(w.message)]
    assert len(fallback) == 1 and fallback[0].filename == __file__     # the LLM(...) line above
    assert llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished



class _Lines(logging.Handler):
    """Collects build.py's log lines; `seen` is set once `wanted` progress lines came."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines, self.wanted, self.seen = [], 1, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if sum(line.endswith("s elapsed") for line in self.lines) >= self.wanted:
            self.seen.set()


@pytest.fixture
def slow_build(monkeypatch, tmp_path):
    """build_extension up to cpp_extension.load: no cached build, a compiler and ninja
    'found', a tiny source, progress every 10 ms, build.py's lines collected.
    Yields (the source, the _Lines handler)."""
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", sys.executable)                  # any program on PATH passes the check
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.01)
    source = tmp_path / "fake_kernel.cpp"
    source.write_text("// a fake kernel: cpp_extension.load is replaced\n")
    lines, level = _Lines(), build.logger.level
    build.logger.addHandler(lines)
    build.logger.setLevel(logging.INFO)
    try:
        yield source, lines
    finally:
        build.logger.removeHandler(lines)
        build.logger.setLevel(level)


def _progress_threads():
    return [t for t in threading.enumerate() if t.name == "nanopaged-kernel-build-progress"]


def test_a_slow_build_says_how_long_it_has_been_and_how_long_it_took(slow_build, monkeypatch):
    """A first build on a busy CPU takes minutes: while ninja runs, a line says the
    seconds elapsed, again and again; then one says how long it took. No thread is left."""
    source, lines = slow_build
    lines.wanted, module = 2, object()

    def slow_load(**kwargs):         # returns once two progress lines were logged during it
        assert lines.seen.wait(30), lines.lines
        return module
    monkeypatch.setattr(cpp_extension, "load", slow_load)
    assert build.build_extension("nanopaged_cpu", source, "cpu") is module
    progress = [line for line in lines.lines if line.endswith("s elapsed")]
    assert len(progress) >= 2 and all(re.fullmatch(r"building the CPU kernel fake_kernel\.cpp: \d+ s elapsed", line)
                                      for line in progress), lines.lines
    assert lines.lines[0].startswith("building the CPU kernel fake_kernel.cpp (once")
    assert re.fullmatch(r"built the CPU kernel fake_kernel\.cpp in \d+ s", lines.lines[-1]), lines.lines
    assert _progress_threads() == []


def test_a_failed_build_stops_its_progress_lines(slow_build, monkeypatch):
    source, lines = slow_build

    def failing_load(**kwargs):      # fails once a progress line was logged during it
        assert lines.seen.wait(30), lines.lines
        raise RuntimeError("error: expected ';' before '}' token")
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    with pytest.raises(KernelBuildError, match="expected ';'"):
        build.build_extension("nanopaged_cpu", source, "cpu")
    assert _progress_threads() == []
    after = len(lines.lines)
    time.sleep(0.1)                                     # ten periods: a running reporter would log
    assert len(lines.lines) == after and not any(line.startswith("built") for line in lines.lines)


def test_a_cached_build_says_nothing_of_building(slow_build, monkeypatch):
    """With the kernel cached (a .so in its build folder), ninja only checks it: no
    "building" line and no "built in 0 s" line on every start."""
    source, lines = slow_build

    def quick_load(**kwargs):        # a build that leaves its .so behind
        Path(kwargs["build_directory"], "nanopaged_cpu.so").write_bytes(b"")
        return "module"
    monkeypatch.setattr(cpp_extension, "load", quick_load)
    assert build.build_extension("nanopaged_cpu", source, "cpu") == "module"
    assert lines.lines[0].startswith("building") and lines.lines[-1].startswith("built"), lines.lines
    del lines.lines[:]
    assert build.build_extension("nanopaged_cpu", source, "cpu") == "module"
    assert not any(line.startswith(("building", "built")) for line in lines.lines), lines.lines
