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
    config.addinivalue_line("markers", "slow: needs the real default model (download/convert once, "
                                       "then tens of seconds) or a long compile (nvcc)")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # `-n N` (pytest-xdist): N workers share the cores, so each gets its share of
        # threads, and so do the processes its tests start (servers, TP/PP workers).
        # Two OpenMP teams of 2 on 2 cores spin against each other (a real-model test
        # once took 222 s that way instead of ~60).
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


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
