"""Shared fixtures.

- tiny_model_dir: a random 2-layer Llama saved the way Hugging Face saves one
  (config.json, model.safetensors, a small byte-level BPE tokenizer). Fast tests use it.
- tiny_family: the same for each model family (Llama, Mistral, Qwen2, Qwen3).
  (make_tiny_llama lives in nanopaged/exercises/tiny_model.py: the exercises use it too.)
- paged_logits: a model's logits through the real paged path (tests/model, tests/worker).
- default_model_dir: SmolLM2-135M-Instruct converted from its PyPI GGUF (about a
  minute on the first run, cached afterwards). Tests that need it are marked `slow`;
  they run in the full suite (deselect with -m "not slow" while iterating).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from nanopaged.exercises.tiny_model import TINY_VOCAB, make_tiny_llama, make_tiny_model, make_tiny_tokenizer  # noqa: F401


def pytest_configure(config):
    from nanopaged.utils.cpu import auto_cpu_dtype
    try:
        auto_cpu_dtype()                 # a bad NANOPAGED_AUTO_DTYPE: one line, not a traceback per test
    except ValueError as e:
        pytest.exit(str(e), returncode=4)
    config.addinivalue_line("markers", "slow: needs the real default model (download/convert once, "
                                       "then tens of seconds) or a long compile (nvcc)")
    config.addinivalue_line("markers", "exactness: compares two engines or paths for equal or close numbers; "
                                       ".ci/run runs these again with dtype auto flipped (NANOPAGED_AUTO_DTYPE)")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # `-n N` (pytest-xdist): N workers share the cores, so each gets its share of
        # threads, and so do the processes its tests start (servers, TP/PP workers).
        # Two OpenMP teams of 2 on 2 cores spin against each other (a real-model test
        # once took 222 s that way instead of ~60).
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_report_header(config):
    """The kernel build this run loads, before anything is built: torch's capability, the
    CPU class, the build's name and vector flags, and what dtype="auto" is here (not shown
    under -q)."""
    from nanopaged.layers.build import cpu_build_flags, cpu_build_name
    from nanopaged.utils.cpu import AUTO_DTYPE_ENV, auto_cpu_dtype, cpu_class
    forced = os.environ.get(AUTO_DTYPE_ENV)
    return (f"nanopaged: CPU class {cpu_class()} (torch capability {torch.backends.cpu.get_cpu_capability()}); "
            f"kernel build {cpu_build_name()} ({' '.join(cpu_build_flags()) or 'no vector flags: the portable body'}); "
            f"dtype auto = {str(auto_cpu_dtype()).removeprefix('torch.')}"
            + (f" ({AUTO_DTYPE_ENV}={forced})" if forced else "") + " (the default model: float32)")


def _kernel_paths() -> dict:
    from nanopaged.layers.build import kernel_paths
    return kernel_paths()


def pytest_sessionfinish(session):
    """An xdist worker hands its kernel path counts to the controller (workeroutput)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["nanopaged_kernel_paths"] = _kernel_paths()


def pytest_testnodedown(node, error):
    """The controller sums each worker's counts (pytest-xdist's hook)."""
    _merge_paths(node.config, getattr(node, "workeroutput", {}).get("nanopaged_kernel_paths", {}))


def _merge_paths(config, report: dict) -> None:
    total = config.__dict__.setdefault("_nanopaged_kernel_paths", {})
    for name, info in report.items():
        mine = total.setdefault(name, dict(info, ran={path: 0 for path in info["ran"]}))
        for path, calls in info["ran"].items():
            mine["ran"][path] += calls


def pytest_terminal_summary(terminalreporter, config):
    """Which kernel builds ran in the test processes, and which of their instruction-set
    paths: the vector body (AVX512, AVX2 or the portable one lane), AVX512-BF16's
    vdpbf16ps, AMX tiles."""
    if not hasattr(config, "workerinput") and not config.pluginmanager.hasplugin("dsession"):
        _merge_paths(config, _kernel_paths())                 # one process (-n 0): its own counts
    report = config.__dict__.get("_nanopaged_kernel_paths", {})
    terminalreporter.section("nanopaged kernel paths")
    terminalreporter.write_line("calls made in the test processes (servers, EngineCore and rank processes are not "
                                "counted); VNNI is in no body: int8 x int8 runs on AVX2's vpmaddubsw")
    if not report:
        terminalreporter.write_line("no CPU kernel build was loaded in the test processes")
    for name, info in sorted(report.items()):
        ran = info["ran"]
        special = [f"{ran[path]} on {label}" if ran[path] else f"{label} compiled in, never ran"
                   for path, label in (("avx512_bf16", "vdpbf16ps"), ("amx", "AMX tiles")) if info[path]]
        role = "this run's build" if info["own"] else "loaded to compare"
        terminalreporter.write_line(
            f"{name} ({role}; flags: {info['flags']}): {info['vector']} body, {ran['vector']} kernel calls"
            + (f"; of them {', '.join(special)}" if special else ""))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's command): a worker a core, at most 4. Each worker loads
    torch and, for the slow tests, the real model (~1.5 GB)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first, then the rest, the longer files first (their size
    stands in for their cost), so that under `-n auto --dist loadfile` no long file
    starts last. A stable sort: a file's tests stay together and in their order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    size = {path: path.stat().st_size for path in {item.path for item in items}}
    items.sort(key=lambda item: (item.path not in slow_files, -size[item.path]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """tiny_family(architecture, tie=True) -> (folder, transformers model): a random tiny
    checkpoint of that family (make_tiny_model), built once per session."""
    made = {}

    def get(architecture, tie=True):
        if (architecture, tie) not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{architecture}-{'tied' if tie else 'untied'}")
            made[architecture, tie] = folder, make_tiny_model(folder, architecture, tie=tie)
        return made[architecture, tie]
    return get


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_model_dir():
    from nanopaged.model.model_loader import ensure_default_model
    return ensure_default_model(progress=False)


def paged_logits(model, tokens: list[int], block_size: int, prefill: int, dtype=torch.float32) -> torch.Tensor:
    """Logits for every position: prefill the first `prefill` tokens in one pass, then
    feed the rest one token at a time (decode), reading K/V (in `dtype`, the model's)
    through a block table whose physical blocks are deliberately scattered (reversed)."""
    from nanopaged.core.block_table import BlockTable
    from nanopaged.layers.attention import AttentionMetadata

    c = model.config
    num_blocks = -(-len(tokens) // block_size) + 2
    kv = torch.zeros(c.num_hidden_layers, 2, num_blocks, block_size, model.num_local_kv_heads, c.head_dim,
                     dtype=dtype)
    table = BlockTable(block_size)
    for b in reversed(range(num_blocks)):
        table.append_block(b)
    logits = []

    def run(start, end):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(table.slots(start, end)),
            block_tables=torch.tensor([table.block_ids]), seq_lens=torch.tensor([end]),
            query_start_loc=torch.tensor([0, end - start]), num_decodes=int(end - start == 1),
            seq_lens_list=[end], query_start_loc_list=[0, end - start])
        h = model(torch.tensor(tokens[start:end]), torch.arange(start, end), kv, meta)
        logits.append(model.compute_logits(h))

    run(0, prefill)
    for p in range(prefill, len(tokens)):
        run(p, p + 1)
    return torch.cat(logits)


def interrupt_next_forward(layer) -> None:
    """Make the next call of `layer.forward` raise KeyboardInterrupt (Ctrl-C inside a
    forward pass); the call after that runs the layer as before."""
    forward = layer.forward

    def interrupted(*args, **kwargs):
        layer.forward = forward
        raise KeyboardInterrupt

    layer.forward = interrupted


class InterruptOnce:
    """A socket whose first poll raises KeyboardInterrupt (a Ctrl-C mid-step)."""

    def __init__(self, sock):
        self.sock, self.fired = sock, False

    def poll(self, timeout):
        if not self.fired:
            self.fired = True
            time.sleep(0.2)               # the ranks' answers are on their way
            raise KeyboardInterrupt
        return self.sock.poll(timeout)

    def recv(self):
        return self.sock.recv()
