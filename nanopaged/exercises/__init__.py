"""The course's exercises: one per chapter, each a real piece of the engine to write.

An exercise is a module `exNN_name.py` in this package with:

    NUMBER, CHAPTER, TITLE: which exercise, the chapter file it belongs to, a title.
    TARGETS: ["module:qualname", ...] of the engine functions the student writes (their
        bodies are removed in the stub; the engine then calls the student's versions
        instead), all from one module; [] for a prediction question, whose answer goes
        in a text file.
    TASK: what to do, in words (it becomes the stub's header).
    HINT: what `python -m nanopaged.exercise hint N` prints.
    CHECKS: check functions, each with a one-line docstring naming the property it
        checks in words a student understands; a check raises AssertionError (with a
        message saying what it saw) when the property does not hold.
    (prediction questions also have QUESTION, the answer file's template, and
    `answer(text)`, which parses the student's answer; their checks take it.)

The checks run the real engine (the tiny random Llama of `tiny_model_folder()`, or unit-sized
inputs) around the student's function; nanopaged/exercises/runner.py does the
swapping, the running and the reporting.
"""
from __future__ import annotations

import atexit
import functools
import importlib
import pkgutil
import shutil
import tempfile
from contextlib import contextmanager
from types import ModuleType

# (holder, name, engine's function, student's function) of every swap in force
# (nanopaged/exercises/runner.py's swapped_in fills it)
SWAPS: list[tuple[object, str, object, object]] = []


def holding_sequence(bm, seq_id: int, num_tokens: int, block_ids: list[int], num_computed: int | None = None):
    """A Sequence of num_tokens tokens whose table holds block_ids of the BlockManager bm
    (block_pool.touch: ref_count + 1 each, off the free queue) and whose first num_computed (default
    all) positions are computed: the hand-made states the block checks start from."""
    from nanopaged.core.sequence import Sequence

    seq = Sequence(seq_id, seq_id, list(range(1, num_tokens + 1)), bm.block_size)
    for b in block_ids:
        bm.block_pool.touch(b)
        seq.block_table.append_block(b)
    seq.num_computed_tokens = num_tokens if num_computed is None else num_computed
    return seq


@functools.cache
def all_exercises() -> dict[int, ModuleType]:
    """NUMBER -> exercise module, for every exNN_*.py of this package."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("ex"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            found[module.NUMBER] = module
    return dict(sorted(found.items()))


@functools.cache
def tiny_model_folder() -> str:
    """The folder of the tiny random Llama of tiny_model.py (the one the tests and the
    chapters use), made once per process."""
    from transformers.utils import logging as hf_logging

    from .tiny_model import make_tiny_llama

    hf_logging.disable_progress_bar()          # no "Writing model shards" bar above the checks
    folder = tempfile.mkdtemp(prefix="nanopaged-exercise-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)     # gone when the process ends
    make_tiny_llama(folder)
    return folder


@contextmanager
def engines_own():
    """Inside the block the engine runs its own functions again, not the student's: how
    a check computes the reference it compares the student's run with."""
    for holder, name, original, _ in SWAPS:
        setattr(holder, name, original)
    try:
        yield
    finally:
        for holder, name, _, replacement in SWAPS:
            setattr(holder, name, replacement)


def run_tiny(prompts, params, **engine_args) -> list[list[tuple[list[int], str]]]:
    """Run LLM.generate on the tiny model (block_size 4, 64 blocks, the PyTorch reference
    attention backend, unless given) and return each request's (token_ids,
    finish_reason) per completion. The reference backend: the exercises replace Python
    functions, which the compiled kernels would bypass (and a check never waits for a
    kernel build). Raises AssertionError if a KV block is still held when everything
    has finished."""
    from nanopaged import LLM

    engine_args = {"block_size": 4, "num_gpu_blocks": 64, "attention_backend": "torch", **engine_args}
    llm = LLM(tiny_model_folder(), **engine_args)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"], (
        f"after every request finished, {stats['num_total_gpu_blocks'] - stats['num_free_gpu_blocks']} "
        "KV blocks are still held (a leak)")
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outs]


def same_as_engines_own(prompts, params, **engine_args) -> None:
    """Assert that the tiny model gives the same tokens with the student's functions as
    with the engine's own (and leaks no block either way)."""
    got = run_tiny(prompts, params, **engine_args)
    with engines_own():
        want = run_tiny(prompts, params, **engine_args)
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:       # name the first completion that differs (n > 1 has several)
            j = next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)
            which = f"request {i}" + (f", completion {j}" if len(w) > 1 else "")
            raise AssertionError(f"{which}: with your code the engine produced {g[j][0][:12]}... "
                                 f"({g[j][1]}), with its own {w[j][0][:12]}... ({w[j][1]})")
