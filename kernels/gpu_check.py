"""Everything the CUDA kernels need checked on a GPU, in one run (~3-5 minutes on an H200).

    python3 kernels/gpu_check.py [--out DIR]

run from the repository root, with a CUDA build of torch, nvcc, ninja and pytest:

1. build the extension (kernels/cuda/attention.cu) as the loader does;
2. pytest tests/layers/test_kernels_cuda.py on the GPU (the CPU-side layers of that file, the
   nvcc compile check and the SIMT emulator, run in CI already and are skipped here);
3. build and run kernels/dev/paged_attention_dev.cu (versions 1-5, each checked against
   its CPU reference and timed) on two problems, and write the timings into the
   "measured vN:" lines of its header comment (in place, and a copy in DIR);
4. time the extension at 256 sequences x 2048 tokens, bf16, block_size 16: KV bytes read
   per second against the H200's 4.8 TB/s (target >= 60%), and against torch's
   scaled_dot_product_attention on the same K/V laid out contiguously (target <= 1.5x);
5. pytest tests/lora/test_lora_kernels.py's GPU cases: the batched LoRA kernels
   (kernels/cuda/lora.cu, built as the tests build it) against the PyTorch reference.

Every check prints a PASS or FAIL line; the exit status is 1 if any failed. With --out,
the whole output is also written to DIR/gpu_check.log.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "kernels" / "dev" / "paged_attention_dev.cu"
HBM_BYTES_PER_S = 4.8e12          # H200 datasheet
# The dev program's problems: (label, its arguments after the version number).
DEV_PROBLEMS = [("256 seqs x 2048, 32/8 heads x 128, block 16", "256 2048 32 8 128 16"),
                ("256 seqs x 2048, 9/3 heads x 64 (default model), block 16", "256 2048 9 3 64 16")]
# Perf problems for the extension: (label, num_heads, num_kv_heads, head_size). The MHA
# row reads as many K/V bytes as the first; comparing them shows what GQA's repeated
# reads of one kv head (from L2) cost.
PERF_PROBLEMS = [("Llama-3-8B layer, 32/8 heads x 128", 32, 8, 128),
                 ("default model, 9/3 heads x 64", 9, 3, 64),
                 ("MHA, 8/8 heads x 128", 8, 8, 128)]

results: list[tuple[str, bool]] = []
log_lines: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    log_lines.append(line)


def check(name: str, ok: bool, detail: str = "") -> bool:
    results.append((name, ok))
    say(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}")
    return ok


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    say("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    for line in (proc.stdout + proc.stderr).splitlines():
        say("  " + line)
    return proc


def load_extension():
    """The tests' own loader (same name and flags, so pytest reuses this build)."""
    spec = importlib.util.spec_from_file_location("test_kernels_cuda", ROOT / "tests" / "layers" / "test_kernels_cuda.py")
    module = importlib.util.module_from_spec(spec)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    spec.loader.exec_module(module)
    return module.load_cuda_extension()


def dev_versions(out: str) -> dict[int, str]:
    """'version N: PASS (...)  0.812 ms  2650 GB/s  55% of 4.8 TB/s' -> {N: 'PASS, 0.812 ms, ...'}."""
    found = {}
    for m in re.finditer(r"^version (\d): (PASS|FAIL) \(.*?\)\s+([\d.]+) ms\s+(\d+) GB/s\s+(\d+)%", out, re.M):
        found[int(m[1])] = f"{m[3]} ms, {m[4]} GB/s ({m[5]}% of 4.8 TB/s){'' if m[2] == 'PASS' else ' WRONG RESULT'}"
    return found


def fill_dev_measurements(measured: dict[int, list[str]], gpu: str, out_dir: Path | None) -> None:
    text = DEV.read_text()
    for version, entries in measured.items():   # the line, and the indented lines of an earlier fill
        block = "\n".join([f"measured v{version}: {gpu}", *(f"  {e}" for e in entries)])
        text = re.sub(rf"^measured v{version}: .*(\n  .*)*", lambda _, block=block: block, text, flags=re.M)
    DEV.write_text(text)
    if out_dir:
        shutil.copy(DEV, out_dir / DEV.name)
    say(f"wrote the measured lines into {DEV.relative_to(ROOT)}" + (f" (copy in {out_dir})" if out_dir else ""))


def time_cuda(fn, reps: int = 20) -> float:
    """Mean seconds per call over `reps` calls, after two warm-ups."""
    for _ in range(2):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / reps


def best_sdpa(q, k, v) -> tuple[float, str, torch.Tensor]:
    """Fastest of torch's SDPA backends that accept (q, k, v) with GQA: (seconds, name, out)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    best = (float("inf"), "none", None)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                seconds = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        except RuntimeError:
            continue
        if seconds < best[0]:
            best = (seconds, backend.name.lower(), out)
    return best


def perf(ext, label: str, num_heads: int, num_kv_heads: int, head_size: int) -> None:
    num_seqs, context, block_size = 256, 2048, 16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    dev, dtype = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, device=dev, dtype=dtype, generator=g)
    value_cache = torch.randn(shape, device=dev, dtype=dtype, generator=g)
    query = torch.randn(num_seqs, num_heads, head_size, device=dev, dtype=dtype, generator=g)
    block_tables = torch.randperm(num_blocks, device=dev, generator=g).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, device=dev, dtype=torch.int64)
    out = torch.empty_like(query)
    scale = head_size ** -0.5
    ours = time_cuda(lambda: ext.paged_attention_decode(out, query, key_cache, value_cache, block_tables,
                                                        seq_lens, scale))
    kv_bytes = 2 * num_seqs * context * num_kv_heads * head_size * key_cache.element_size()
    fraction = kv_bytes / ours / HBM_BYTES_PER_S

    # The same K/V, contiguous per sequence: [num_seqs, num_kv_heads, context, head_size].
    def contiguous(cache):
        return cache[block_tables].view(num_seqs, context, num_kv_heads, head_size).transpose(1, 2).contiguous()
    k, v = contiguous(key_cache), contiguous(value_cache)
    sdpa_seconds, backend, sdpa_out = best_sdpa(query.unsqueeze(2), k, v)
    same = sdpa_out is not None and torch.allclose(out.float(), sdpa_out.squeeze(2).float(), atol=2e-2, rtol=2e-2)

    say(f"{label}: {kv_bytes / 1e9:.2f} GB of K/V; ours {ours * 1e3:.3f} ms = {kv_bytes / ours / 1e9:.0f} GB/s "
        f"({fraction:.0%} of 4.8 TB/s); SDPA ({backend}) {sdpa_seconds * 1e3:.3f} ms; "
        f"ours / SDPA = {ours / sdpa_seconds:.2f}")
    check(f"perf {label}: same output as SDPA", same)
    check(f"perf {label}: >= 60% of HBM bandwidth", fraction >= 0.6, f"{fraction:.0%}")
    check(f"perf {label}: within 1.5x of SDPA", ours <= 1.5 * sdpa_seconds, f"{ours / sdpa_seconds:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the log and the filled dev file here")
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        return checks(args.out)
    finally:
        say(f"{sum(ok for _, ok in results)} passed, {sum(not ok for _, ok in results)} failed "
            f"in {time.perf_counter() - started:.0f} s")
        if args.out:
            (args.out / "gpu_check.log").write_text("\n".join(log_lines) + "\n")


def checks(out_dir: Path | None) -> int:
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"nvcc {shutil.which('nvcc')}, ninja {shutil.which('ninja')}")
    if not check("a CUDA GPU is visible to torch", torch.cuda.is_available()):
        return 1
    gpu = torch.cuda.get_device_name()
    say(f"GPU: {gpu}")

    # 1. build
    start = time.perf_counter()
    try:
        ext = load_extension()
    except Exception as e:          # a build error: show it, the rest cannot run
        say(str(e))
        check("extension builds", False)
        return 1
    check("extension builds", True, f"{time.perf_counter() - start:.0f} s")

    # 2. the GPU tests
    proc = run([sys.executable, "-m", "pytest", "tests/layers/test_kernels_cuda.py", "-q", "-m", "not slow",
                "-k", "not simt and not compile"], timeout=600)
    check("pytest tests/layers/test_kernels_cuda.py (GPU cases)", proc.returncode == 0)

    # 3. the dev versions
    binary = Path("/tmp/paged_attention_dev")
    proc = run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", str(DEV), "-o", str(binary)], timeout=300)
    if check("dev file builds", proc.returncode == 0):
        measured: dict[int, list[str]] = {}
        for label, problem in DEV_PROBLEMS:
            proc = run([str(binary), "0", *problem.split()], timeout=300)
            check(f"dev versions agree with the CPU reference ({label})", proc.returncode == 0)
            for version, entry in dev_versions(proc.stdout).items():
                measured.setdefault(version, []).append(f"{label}: {entry}")
        fill_dev_measurements(measured, gpu, out_dir)

    # 4. perf of the shipped kernel
    for label, num_heads, num_kv_heads, head_size in PERF_PROBLEMS:
        perf(ext, label, num_heads, num_kv_heads, head_size)
        torch.cuda.empty_cache()

    # 5. the LoRA kernels
    proc = run([sys.executable, "-m", "pytest", "tests/lora/test_lora_kernels.py", "-q", "-n", "0", "-k", "cuda",
                "-m", "not slow"], timeout=600)
    check("pytest tests/lora/test_lora_kernels.py (GPU cases)", proc.returncode == 0)
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
