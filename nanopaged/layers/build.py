"""Building the kernels of `kernels/`: compiled on first use by ninja through
`torch.utils.cpp_extension.load`, cached under nanopaged's cache folder (a cached build
loads without ninja or a compiler), one build per extension's sources (and the headers
they include), flags, python and torch. Each extension is one group of sources: the
base's are KERNEL_SOURCES; a feature package names its own and loads them with
load_extension (nanopaged/quantization/kernels.py). CPU
builds target the instruction set torch itself dispatches to (AVX512 with bf16 and AMX
where present, or AVX2). An installed package carries the sources in nanopaged/_kernels/
(pyproject.toml), a checkout in kernels/. A process tries each build once. While ninja
runs, a line every PROGRESS_EVERY_S says how long it has been (a build on a busy CPU
takes minutes, and a silent one looks hung), and a last line how long it took.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from ..utils.paths import cache_dir

logger = logging.getLogger(__name__)
PACKAGE_DIR = Path(__file__).parents[1]     # nanopaged/
KEEP_BUILDS = 3          # builds kept per kernel, python and torch: the most recently used
PROGRESS_EVERY_S = 20.0  # seconds between "building ...: N s elapsed" lines while ninja runs


def _kernels_dir() -> Path:
    """The kernel sources: nanopaged/_kernels/ in an installed package (pyproject.toml
    copies kernels/ there), else the checkout's kernels/ beside the package."""
    installed = PACKAGE_DIR / "_kernels"
    return installed if installed.is_dir() else PACKAGE_DIR.parent / "kernels"


KERNELS_DIR = _kernels_dir()
# The base's extensions, by kind: their sources under kernels/
KERNEL_SOURCES = {
    "cpu": ("cpu/attention.cpp", "cpu/cache.cpp", "cpu/layer_ops.cpp", "cpu/gemm.cpp", "cpu/gemm_amx.cpp",
            "cpu/bindings.cpp"),
    "cuda": ("cuda/attention.cu",),
}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)     # a local header: #include "vec.h"


class KernelBuildError(RuntimeError):
    """The compiled kernels could not be built or loaded (no compiler, no ninja, ...)."""


# A process tries each kernel build once. load_extension's cache keeps a built module, but
# functools.cache keeps no exceptions, so the failures are kept here (name -> error) and
# every later LLM() gets the same error at once instead of another build.
_build_errors: dict[str, KernelBuildError] = {}


def forget_builds() -> None:
    """Forget loaded kernels and failed builds: the next load tries again (tests)."""
    load_extension.cache_clear()
    _build_errors.clear()


# torch's CPU capabilities the kernel has a body for, lowest first ("DEFAULT": the portable
# body, one lane, no vector extension)
CPU_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
# Every CPU kernel module this process loaded, by name, with its vector flags and whether
# it is built for torch's own capability: kernel_paths reports them.
_loaded: dict[str, tuple[object, list[str], bool]] = {}


def cpu_build_flags(capability: str | None = None) -> list[str]:
    """Vector flags for the CPU kernel: the instruction set torch itself dispatches to, or
    `capability` ("AVX512", "AVX2", "DEFAULT") when given (empty: the portable body)."""
    cap = capability or torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        bf16 = ["-mavx512bf16"] if torch.cpu._is_avx512_bf16_supported() else []   # vdpbf16ps
        amx = ["-mamx-tile", "-mamx-bf16"] if torch.cpu._is_amx_tile_supported() else []
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", *bf16, *amx]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


def load_kernels(kind: str):
    """Build (first call: ~1 min, ninja) or load (cached) the base's kernel extension for
    `kind`.

    kind: "cpu" (kernels/cpu/: attention, the cache ops, the layer ops, the matmuls) or
    "cuda" (kernels/cuda/attention.cu). Returns the extension module: paged_attention_decode,
    reshape_and_cache, copy_blocks, swap_blocks (and on the CPU the rest). A failed build is
    not retried in this process (forget_kernel_builds).

    Raises:
        ValueError: kind is not "cpu" or "cuda".
        KernelBuildError: as load_extension.
    """
    if kind not in KERNEL_SOURCES:
        raise ValueError(f"kind={kind!r}: expected 'cpu' or 'cuda'")
    return load_extension(f"nanopaged_{kind}", KERNEL_SOURCES[kind], kind)


@functools.cache
def load_extension(name: str, sources: tuple[str, ...], kind: str = "cpu"):
    """Build or load the extension `name` from `sources` (paths under kernels/), for this
    run's instruction set, once per process: a failed build is not retried
    (forget_kernel_builds).

    Raises:
        KernelBuildError: sources missing, no ninja, no C++ compiler / nvcc, or the build
            failed (now, or earlier in this process).
    """
    if name in _build_errors:
        raise _build_errors[name].with_traceback(None)
    try:
        return build_extension(name, [KERNELS_DIR / s for s in sources], kind)
    except KernelBuildError as e:
        _build_errors[name] = e
        raise


def cpu_build_name(capability: str | None = None) -> str:
    """The CPU kernel module's name for torch's capability (or `capability`): the
    instruction set and the special units it is built with, e.g.
    nanopaged_cpu_avx512_avx512bf16_amx_tile, nanopaged_cpu_avx2, nanopaged_cpu_default."""
    cap = capability or torch.backends.cpu.get_cpu_capability()
    flags = cpu_build_flags(cap)
    return (f"nanopaged_cpu_{cap.lower()}"
            + "".join(f"_{f[2:].replace('-', '_')}" for f in flags if f in ("-mavx512bf16", "-mamx-tile")))


@functools.cache
def load_cpu_build(capability: str, name: str = "nanopaged_cpu",
                   sources: tuple[str, ...] = KERNEL_SOURCES["cpu"]):
    """The CPU extension `name` (default the base's) built for `capability` ("AVX2", or
    "DEFAULT": the portable body), as a module of its own name beside load_kernels("cpu")'s,
    in this process: the kernel tests compare each body this CPU runs with the portable one
    (tests/layers/test_kernel_isa.py). It shares its build with a run under
    ATEN_CPU_CAPABILITY set to it.

    Raises:
        ValueError: a capability the kernel has no body for, or one above torch's own
            here (its instructions would fault on this CPU).
        KernelBuildError: as build_extension.
    """
    if capability not in CPU_CAPABILITIES:
        raise ValueError(f"capability={capability!r}: expected one of {CPU_CAPABILITIES}")
    own = torch.backends.cpu.get_cpu_capability()
    ceiling = next((c for c in reversed(CPU_CAPABILITIES) if own.startswith(c)), "DEFAULT")
    if CPU_CAPABILITIES.index(capability) > CPU_CAPABILITIES.index(ceiling):
        raise ValueError(f"capability={capability!r} is above this CPU's as torch runs it ({own})")
    return build_extension(name, [KERNELS_DIR / s for s in sources], "cpu", capability=capability)


def kernel_paths() -> dict[str, dict]:
    """Each CPU kernel module loaded in this process, by name: its build_info() (the vector
    body it compiled in, "avx512", "avx2" or "portable", and whether the AVX512-BF16, AMX
    and VNNI paths are in it), its compiler flags, `own`: whether it is built for torch's
    own capability (this run's build, not one loaded to compare), and `ran`: its
    path_counts() (calls of any kernel, of bf16 `linear` on vdpbf16ps, of `linear_amx`)."""
    return {name: dict(module.build_info(), flags=" ".join(flags) or "none", own=own,
                       ran=dict(module.path_counts()))
            for name, (module, flags, own) in _loaded.items()}


def build_extension(name: str, source: Path | Sequence[Path], kind: str, capability: str | None = None):
    """Compile one kernel source, or the sources of one extension, with ninja
    (torch.utils.cpp_extension.load) and import it, or import the build cached for exactly
    these sources and flags (no ninja, no compiler).

    The build folder is <nanopaged cache>/kernels/<name>-<python>-<torch>-<hash of the
    sources' and their local headers' names (relative to the sources' folder), contents and
    the flags>, so a build is reused only for exactly these sources (from any checkout or
    install that has them: a test suite's scratch install, or a second clone, does not push
    the first one's build out of the cache; see prune_builds). CPU builds are named after
    the instruction set they target (e.g. nanopaged_cpu_avx2) and use OpenMP, torch's own
    thread pool.

    Raises:
        KernelBuildError: a source missing, or no cached build and no ninja, no compiler, or
            the build failed.
    """
    from torch.utils import cpp_extension

    sources = [source] if isinstance(source, Path) else list(source)
    for path in sources:
        if not path.is_file():
            raise KernelBuildError(f"kernel source {path} not found (nanopaged installed without its "
                                   "kernels/ folder?)")
    label = _label(sources)
    if kind == "cpu":
        name = cpu_build_name(capability).replace("nanopaged_cpu", name, 1)
        # -fno-trapping-math: GCC keeps a loop with a float select (fast_exp's clamp) scalar
        # unless it may compute both sides; no result changes (no reassociation, no fast-math).
        # -fno-gnu-unique: GCC would bind the kernel's static objects (scratch buffers, their
        # mutex, the path counters) as STB_GNU_UNIQUE, which the dynamic linker shares between
        # every library that defines them, so two builds loaded in one process (the kernel
        # tests compare them) would share one scratch and one set of counters
        flags = dict(extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", "-fno-gnu-unique",
                                   *cpu_build_flags(capability)],
                     extra_ldflags=["-fopenmp"])
    else:
        flags = dict(extra_cflags=["-O3"], extra_cuda_cflags=["-O3"])   # __expf is explicit: no fast-math
        if torch.version.cuda is None:
            raise KernelBuildError(f"torch {torch.__version__} is a CPU build: no CUDA kernels")
    # One folder per python and torch version (an extension only loads into the torch it
    # was built for) and per source contents and flags: an edited kernel never loads an
    # old build, checkouts with the same source share one (a build under way holds the
    # folder's lock, so a second process waits for it), and a missing .so means a build
    # is coming.
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = hashlib.sha256(f"{sorted(flags.items())}\n".encode())
    for relative, path in _source_files(sources):
        key.update(f"{relative}\n".encode() + path.read_bytes())
    build_dir = cache_dir() / "kernels" / f"{name}-{py}-torch{torch.__version__}-{key.hexdigest()[:12]}"
    cached = _load_cached_build(name, build_dir / f"{name}{cpp_extension.LIB_EXT}")
    if cached is not None:
        (build_dir / "last-used").touch()
        _remember(name, cached, flags, capability)
        return cached
    if kind == "cuda" and cpp_extension.CUDA_HOME is None:
        raise KernelBuildError("nvcc not found (set CUDA_HOME)")
    if not cpp_extension.is_ninja_available():
        raise KernelBuildError("ninja not found (pip install ninja)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelBuildError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH)")
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))     # else ninja only checks the cached build
    if fresh:
        logger.info("building the %s kernel %s (once, about a minute, longer on a busy CPU; cached in %s)",
                    kind.upper(), label, build_dir)
    what = f"building the {kind.upper()} kernel {label}"
    start = time.monotonic()
    try:
        with _elapsed_lines(what):
            module = cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                        build_directory=str(build_dir), verbose=False, **flags)
    except Exception as e:       # compiler errors arrive as RuntimeError, CalledProcessError, ...
        raise KernelBuildError(f"building {label} failed: {str(e)[-2000:]}") from e
    if fresh:
        logger.info("built the %s kernel %s in %.0f s", kind.upper(), label, time.monotonic() - start)
    (build_dir / "last-used").touch()
    prune_builds(build_dir)
    _remember(name, module, flags, capability)
    return module


def _label(sources: list[Path]) -> str:
    """What the build's log lines call its sources: a file's name, or the folder of many
    (relative to kernels/ when it is there), e.g. "cpu/quant/ (4 files)"."""
    if len(sources) == 1:
        return sources[0].name
    folder = Path(os.path.commonpath([os.path.normpath(s.parent) for s in sources]))
    shown = folder.relative_to(KERNELS_DIR) if folder.is_relative_to(KERNELS_DIR) else folder.name
    return f"{shown}/ ({len(sources)} files)"


def _source_files(sources: list[Path]) -> list[tuple[str, Path]]:
    """The sources and every local header they include (#include "...", followed through
    headers), each with its path relative to the sources' common folder, sorted: what a
    build is made of, so what its cache key covers."""
    root = os.path.commonpath([os.path.normpath(s.parent) for s in sources])
    found: dict[Path, str] = {}
    todo = [Path(os.path.normpath(s)) for s in sources]
    while todo:
        path = todo.pop()
        if path in found or not path.is_file():       # a missing header: the compiler says so
            continue
        found[path] = os.path.relpath(path, root)
        todo += [Path(os.path.normpath(path.parent / header)) for header in _INCLUDE.findall(path.read_text())]
    return sorted((relative, path) for path, relative in found.items())


def _remember(name: str, module, flags: dict, capability: str | None = None) -> None:
    """Keep a loaded CPU kernel module, its vector flags and whether it is built for torch's
    own capability, for kernel_paths (a module that counts its paths: the CUDA one, and
    tests' stand-ins, do not)."""
    if hasattr(module, "path_counts"):
        own = capability is None or cpu_build_name(capability) == cpu_build_name()
        _loaded[name] = (module, [f for f in flags["extra_cflags"] if f.startswith("-m")], own)


@contextmanager
def _elapsed_lines(what: str, every_s: float | None = None):
    """Inside the block, a thread logs "<what>: N s elapsed" every `every_s` seconds
    (default PROGRESS_EVERY_S); the thread is stopped and joined when the block ends,
    by an error too."""
    every_s = PROGRESS_EVERY_S if every_s is None else every_s
    start, done = time.monotonic(), threading.Event()

    def report() -> None:
        while not done.wait(every_s):        # False: every_s passed and the block still runs
            logger.info("%s: %.0f s elapsed", what, time.monotonic() - start)

    thread = threading.Thread(target=report, name="nanopaged-kernel-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def prune_builds(build_dir: Path, keep: int = KEEP_BUILDS) -> list[Path]:
    """Remove the older builds of build_dir's kernel (same name, python and torch; another
    hash: an edited source, another checkout), keeping the `keep` most recently used
    (their `last-used` stamp, touched at every load). A folder with a `lock` (a build
    under way) is left alone. Runs after each new build, so the cache holds a few builds
    per kernel instead of one per edit ever made. Returns the folders removed.

    A process that loaded a removed build keeps running (Linux unlinks, the mapping
    stays); one that starts later from that source builds it again.
    """
    prefix = build_dir.name.rsplit("-", 1)[0] + "-"
    def last_used(folder: Path) -> float:
        stamp = folder / "last-used"
        return (stamp if stamp.exists() else folder).stat().st_mtime

    builds = [d for d in build_dir.parent.iterdir()
              if d.is_dir() and d.name.startswith(prefix) and d.name.count("-") == build_dir.name.count("-")]
    builds.sort(key=last_used, reverse=True)
    removed = [d for d in builds[keep:] if d != build_dir and not (d / "lock").exists()]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def _load_cached_build(name: str, library: Path):
    """Import the extension module `name` from a finished build's `library` (the .so), as
    cpp_extension.load's last step does; None if there is none to load.

    cpp_extension.load itself runs ninja (and the compiler's version check) in every new
    process, even when nothing changed; our build folder's name already pins the source,
    flags, python and torch, so a .so there is the right one. A lock file means a build
    is writing it (cpp_extension.load then waits for that build); a .so that does not
    import (a build killed halfway) is rebuilt.
    """
    if not library.is_file() or (library.parent / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    try:
        module = importlib.util.module_from_spec(spec)      # dlopen and the module's init
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module
