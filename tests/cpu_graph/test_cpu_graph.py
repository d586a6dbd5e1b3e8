"""CPU graphs (cpu_graph/model_runner.py): small all-decode steps replay their recorded kernel
calls. A replay must give the eager step's numbers bit for bit (top logprobs equal as
floats) through batch sizes that change, block tables that outgrow the graph's width,
preemption, n > 1, async scheduling and every family; the graphs must really be used;
a step that computes outside the kernels must run eagerly, with a warning;
enforce_eager=True and the PyTorch backend turn the extension off.
"""
from __future__ import annotations

import logging

import pytest
import torch

from nanopaged import LLM, SamplingParams
from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.cpu_graph.model_runner import MAX_CAPTURE_SIZE, MIN_WIDTH, CPUGraphModelRunner

pytestmark = pytest.mark.exactness

BLOCK = 4
PROMPTS = [list(range(3, 3 + n)) for n in (5, 9, 2, 17, 7, 11, 4, 13, 6, 3)]   # 10: past MAX_CAPTURE_SIZE
# long enough that block tables pass MIN_WIDTH columns (recaptured wider)
PARAMS = SamplingParams(temperature=0, max_tokens=MIN_WIDTH * BLOCK + 8, ignore_eos=True, logprobs=3)
# requests that end one after another: the batch shrinks through every size
STAGGERED = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=3) for i in range(10)]


def outputs(llm, prompts, params=PARAMS):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def engine(folder, **kw):
    """Every comparison here is replay against eager in one dtype, named (float32 unless a
    test says bfloat16): "auto" would differ by CPU, and between the two sides if one named it."""
    kw = dict(block_size=BLOCK, num_gpu_blocks=512, enable_prefix_caching=False, attention_backend="cpu",
              max_num_seqs=16, dtype="float32") | kw
    return LLM(str(folder), **kw)


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_tiny_model(folder, request.param, tie=request.param != "Qwen3ForCausalLM")
    return folder


@pytest.fixture(scope="module")
def eager(model_dir):
    llm = engine(model_dir, enforce_eager=True, dtype="float32")
    assert not isinstance(llm.engine.model_runner, CPUGraphModelRunner)
    return {n: outputs(llm, PROMPTS[:n], PARAMS if n < 10 else STAGGERED) for n in (1, 3, len(PROMPTS))}


def test_replays_equal_the_eager_steps(model_dir, eager):
    """float32 on both sides (the eager fixture's dtype): the same numbers bit for bit."""
    llm = engine(model_dir, dtype="float32")
    runner = llm.engine.model_runner
    assert isinstance(runner, CPUGraphModelRunner)
    calls = []
    forward_embeds = runner.model.forward_embeds
    runner.model.forward_embeds = lambda *a: calls.append(1) or forward_embeds(*a)
    assert outputs(llm, PROMPTS[:1]) == eager[1]
    # one prefill, a capture at width MIN_WIDTH and one at twice it: the other decode steps replay
    assert len(calls) == 3 and runner.graphs[1].width == 2 * MIN_WIDTH
    assert outputs(llm, PROMPTS[:3]) == eager[3]
    assert outputs(llm, PROMPTS, STAGGERED) == eager[len(PROMPTS)]        # sizes 10 .. 1 as requests end
    captured = {n for n, g in runner.graphs.items() if g is not None}
    assert captured == set(range(1, MAX_CAPTURE_SIZE + 1)) | {3}, runner.graphs


def test_bfloat16_replays_equal_the_eager_steps(model_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    want = outputs(engine(model_dir, dtype="bfloat16", enforce_eager=True), PROMPTS[:4], params)
    llm = engine(model_dir, dtype="bfloat16")
    assert outputs(llm, PROMPTS[:4], params) == want
    assert any(g is not None for g in llm.engine.model_runner.graphs.values())


def test_preemption_forks_and_async_scheduling_keep_the_numbers(model_dir):
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=2)
    kw = dict(num_gpu_blocks=24, async_scheduling=True)          # too few blocks: preemptions
    want = outputs(engine(model_dir, enforce_eager=True, **kw), PROMPTS[:4], params)
    llm = engine(model_dir, **kw)
    assert outputs(llm, PROMPTS[:4], params) == want
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert any(g is not None for g in llm.engine.model_runner.graphs.values())


def test_torch_operations_between_the_kernels_are_replayed_and_a_host_read_runs_eagerly(tiny_model_dir, caplog):
    want = outputs(engine(tiny_model_dir, enforce_eager=True), PROMPTS[:2], STAGGERED[:2])
    llm = engine(tiny_model_dir)
    norm = llm.engine.model_runner.model.norm
    forward = norm.forward
    norm.forward = lambda x, residual=None: forward(x * 1.0, residual)      # aten.mul: recorded
    assert outputs(llm, PROMPTS[:2], STAGGERED[:2]) == want
    assert all(g is not None for g in llm.engine.model_runner.graphs.values())
    llm = engine(tiny_model_dir)
    norm = llm.engine.model_runner.model.norm
    norm.forward = lambda x, residual=None: forward(x * (x.sum() == x.sum()).item(), residual)   # a host read
    with caplog.at_level(logging.WARNING, logger="nanopaged.cpu_graph.model_runner"):
        assert outputs(llm, PROMPTS[:2], STAGGERED[:2]) == want
    assert llm.engine.model_runner.graphs == {2: None, 1: None}
    assert "aten.item.default reads a tensor's value into Python" in caplog.text


def test_enforce_eager_and_the_torch_backend_turn_it_off(tiny_model_dir):
    from nanopaged.engine.arg_utils import add_cli_args
    import argparse
    for kw in (dict(enforce_eager=True), dict(attention_backend="torch")):
        assert not isinstance(engine(tiny_model_dir, **kw).engine.model_runner, CPUGraphModelRunner)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(tiny_model_dir), enforce_eager="yes")


def test_a_replay_leaves_the_step_output_its_own(tiny_model_dir):
    """The hidden states a step returns are a copy: the next replay does not change them."""
    llm = engine(tiny_model_dir)
    runner = llm.engine.model_runner
    seen = []
    after = runner._after_forward
    runner._after_forward = lambda so, inp, hidden: seen.append((hidden, hidden.clone())) or after(so, inp, hidden)
    outputs(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(seen) == 6 and all(torch.equal(h, c) for h, c in seen)


def test_an_interrupted_replay_leaves_the_engine_as_an_interrupted_eager_step_would(tiny_model_dir):
    """Ctrl-C halfway through a replay's calls: the requests are aborted (LLM.generate),
    every block is free again, and the next generate gives the same numbers."""
    from invariants import check_block_invariants
    llm = engine(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    first = outputs(llm, PROMPTS[:1], params)
    graph = llm.engine.model_runner.graphs[1]
    calls = list(graph.calls)

    def interrupt():
        graph.calls[:] = calls
        raise KeyboardInterrupt
    graph.calls.insert(len(calls) // 2, (interrupt, ()))
    with pytest.raises(KeyboardInterrupt):
        outputs(llm, PROMPTS[:1], params)
    assert graph.calls == calls
    check_block_invariants(llm.engine)
    assert outputs(llm, PROMPTS[:1], params) == first


def test_a_read_of_the_host_metadata_runs_eagerly(tiny_model_dir, caplog):
    """Python that reads meta.seq_lens_list would bake this step's lengths into the record:
    the capture refuses it (and a TypeError elsewhere is a bug, not a refusal)."""
    want = outputs(engine(tiny_model_dir, enforce_eager=True), PROMPTS[:1], STAGGERED[:1])
    llm = engine(tiny_model_dir)
    attn = llm.engine.model_runner.model.layers[0].self_attn
    forward = attn.forward
    attn.forward = lambda x, pos, rope, kv, meta: forward(x if meta.num_seqs else None, pos, rope, kv, meta)
    with caplog.at_level(logging.WARNING, logger="nanopaged.cpu_graph.model_runner"):
        assert outputs(llm, PROMPTS[:1], STAGGERED[:1]) == want
    assert llm.engine.model_runner.graphs == {1: None}
    assert "the step read seq_lens_list" in caplog.text
    llm = engine(tiny_model_dir)
    attn = llm.engine.model_runner.model.layers[0].self_attn
    forward = attn.forward

    def broken_while_capturing(x, pos, rope, kv, meta):
        if type(meta.seq_lens_list).__name__ == "_HostList":
            raise TypeError("a bug")
        return forward(x, pos, rope, kv, meta)
    attn.forward = broken_while_capturing
    with pytest.raises(TypeError, match="a bug"):
        outputs(llm, PROMPTS[:1], STAGGERED[:1])
