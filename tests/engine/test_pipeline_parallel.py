"""Pipeline parallelism (EngineConfig.pipeline_parallel_size, issue 36): the setting and
its refusals; the batch queue (PipelineEngineCore + PipelineScheduler) over an
in-process executor, so that its rule (a request is never in two in-flight batches)
and its outputs are checked on every workload with no process started; then the real
grid of worker processes (stages over gloo), which must give pp=1's ids token for token.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from nanopaged import LLM, EngineConfig, LLMEngine, SamplingParams
from nanopaged.engine.arg_utils import add_cli_args, engine_kwargs
from nanopaged.exercises.tiny_model import make_tiny_llama
from nanopaged.worker import executor as executor_module

from invariants import check_block_invariants

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A tiny Llama with 4 layers (pp=3 splits them 1, 2, 1), untied head."""
    folder = tmp_path_factory.mktemp("pp-llama")
    make_tiny_llama(folder, tie=False, num_hidden_layers=4)
    return folder


# ---- the setting ----------------------------------------------------------------------

def test_pipeline_parallel_size_is_a_positive_integer_and_makes_a_grid():
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="pipeline_parallel_size"):
            EngineConfig(pipeline_parallel_size=bad)
    config = EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2)
    assert config.world_size == 4 and config.executor_backend == "mp"
    assert EngineConfig().world_size == 1 and EngineConfig().executor_backend == "uni"


@pytest.mark.parametrize("kwargs, words", [
    (dict(distributed_executor_backend="external_launcher"), ["pipeline_parallel_size=2", "external_launcher",
                                                               "--nnodes"]),
    (dict(distributed_executor_backend="uni"), ["pipeline_parallel_size=2", "'uni'"]),
    (dict(speculative_config={"method": "ngram"}), ["speculative_config='ngram'", "pipeline_parallel_size=2",
                                                     "first stage"]),
])
def test_settings_that_do_not_work_with_stages_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError) as e:
        EngineConfig(pipeline_parallel_size=2, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_more_stages_than_layers_fails_before_any_process_starts(tiny_model_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's num_hidden_layers=2"):
        LLM(str(tiny_model_dir), pipeline_parallel_size=3)


def test_the_flag_and_its_short_spelling():
    import argparse

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert engine_kwargs(parser.parse_args(["--pipeline-parallel-size", "2", "-tp", "2"])) == dict(
        model=None, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert engine_kwargs(parser.parse_args(["-pp", "3"]))["pipeline_parallel_size"] == 3


# ---- the batch queue, over one in-process worker --------------------------------------

@pytest.fixture
def in_process(monkeypatch):
    """Engines built with pipeline_parallel_size > 1 get PipelineEngineCore and
    PipelineScheduler, but one whole-model Worker in this process: each batch runs when
    it is sent (a future already done), before the batches ahead of it are taken in,
    as in a pipeline. After every step the rule and the block invariants are checked."""
    create = executor_module.Executor.create

    def one_worker(config, model_path, model_config, ops):
        if config.pipeline_parallel_size == 1:
            return create(config, model_path, model_config, ops)
        whole = replace(config, pipeline_parallel_size=1, distributed_executor_backend="uni")
        return executor_module.UniProcExecutor(whole, model_path, model_config, ops)

    monkeypatch.setattr(executor_module.Executor, "create", staticmethod(one_worker))


def checked(llm) -> LLM:
    """llm whose engine core checks, after each step, that no request (nor sequence) is
    in two batches in flight, and the block and runner-record invariants."""
    eng, core = llm.engine, llm.engine.engine_core
    step = core.step

    def checked_step():
        out = step()
        seqs = core.scheduler.queues.seqs
        batches = [b.scheduler_output for b in core.batch_queue if b.is_batch]
        seq_ids = [i for so in batches for i in so.num_scheduled_tokens]
        assert len(seq_ids) == len(set(seq_ids)), "a sequence is in two in-flight batches"
        requests = [{seqs[i][1].request_id for i in so.num_scheduled_tokens if i in seqs} for so in batches]
        assert sum(map(len, requests)) == len(set().union(*requests)), "a request is in two in-flight batches"
        assert core.scheduler.in_flight_batches == [list(so.num_scheduled_tokens) for so in batches]
        if not any(b.future.done() and b.future.exception() for b in core.batch_queue):
            check_block_invariants(eng)        # (a batch that raised is taken in, and undone, next step)
        return out

    core.step = checked_step
    return llm


PREFIX = list(range(40, 60))
PROMPTS = [PREFIX + [i, i + 1] for i in range(3, 7)] + [list(range(100, 131)), [5, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=14, ignore_eos=True)
FORKS = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
MIXED = [GREEDY, SEEDED, FORKS, GREEDY, SEEDED, FORKS]


def completions(outs):
    """Every completion's ids and logprobs, and the prompt logprobs, as comparable values."""
    def lp(rows):
        return [sorted((t, round(v.logprob, 5)) for t, v in row.items()) if row else row for row in rows or []]
    return [([(c.token_ids, lp(c.logprobs)) for c in o.outputs], lp(o.prompt_logprobs)) for o in outs]


def reference(folder, prompts=PROMPTS, params=MIXED):
    """pp=1, a pool with room for everything (no preemption)."""
    llm = LLM(str(folder), num_gpu_blocks=256, block_size=4, dtype="float32", preemption_mode="recompute")
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    return first, llm.generate(prompts, params, use_tqdm=False)


def run_pp(folder, pp, prompts=PROMPTS, params=MIXED, **kw):
    """The first prompt alone, then all of them (their shared prefix is then cached)."""
    kw = dict(num_gpu_blocks=32, num_cpu_blocks=6, preemption_mode="swap", max_num_batched_tokens=16,
              max_num_seqs=6) | kw
    llm = checked(LLM(str(folder), block_size=4, dtype="float32", pipeline_parallel_size=pp, **kw))
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    return llm, first, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("pp", [2, 3])
def test_batch_queue_gives_pp1_outputs_with_hits_chunks_and_both_preemptions(in_process, four_layers, pp):
    """Greedy ids (with their logprobs and prompt logprobs), seeded samples and n=3
    forks equal pp=1's, while a 16-token budget chunks the 31-token prompt and staggers
    the requests over pp batches in flight, the second round hits the cached prefix,
    and a 32-block pool preempts by swap and, once the 6-block swap pool is full, by
    recompute."""
    ref_first, ref = reference(four_layers)
    llm, first, outs = run_pp(four_layers, pp)
    assert completions(first) == completions(ref_first) and completions(outs) == completions(ref)
    stats = llm.engine.get_stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0, stats
    assert stats["prefix_cache_hits"] > 0 and stats["num_copy_on_write"] > 0, stats
    assert stats["max_batches_in_flight"] == pp and stats["num_batches_in_flight"] == 0
    assert stats["num_free_gpu_blocks"] == 32 and stats["num_free_cpu_blocks"] == 6


def test_batch_queue_beams_and_structured_outputs(in_process, four_layers):
    from nanopaged import BeamSearchParams, StructuredOutputsParams

    date = SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    params = [date, SEEDED, date, GREEDY, date, SEEDED]

    def run(llm):
        return ([[(s.tokens, round(s.cum_logprob, 5)) for s in o.sequences] for o in llm.beam_search(PROMPTS[:3], beams)],
                completions(llm.generate(PROMPTS, params, use_tqdm=False)))

    ref = run(LLM(str(four_layers), num_gpu_blocks=256, block_size=4, dtype="float32"))
    llm = checked(LLM(str(four_layers), num_gpu_blocks=256, block_size=4, dtype="float32", pipeline_parallel_size=2,
                      max_num_batched_tokens=16, max_num_seqs=8))
    assert run(llm) == ref
    assert llm.engine.get_stats()["max_batches_in_flight"] == 2


def test_a_batch_that_raises_sends_every_request_in_flight_back_and_the_engine_goes_on(in_process, four_layers):
    """The forward of the second batch raises: step() raises it once; the requests of
    every batch in flight go back to waiting, and the engine then serves them all with
    pp=1's ids."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, ref = reference(four_layers, PROMPTS, [params] * len(PROMPTS))
    llm = checked(LLM(str(four_layers), num_gpu_blocks=64, block_size=4, dtype="float32", pipeline_parallel_size=2,
                      max_num_batched_tokens=16, max_num_seqs=8))
    eng, core = llm.engine, llm.engine.engine_core
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, params)
    runner = core.executor.driver_worker.model_runner
    forward, calls = runner.execute_model, []

    def fails_second(so):
        calls.append(so)
        if len(calls) == 2:
            raise RuntimeError("boom in batch 2")
        return forward(so)

    runner.execute_model = fails_second
    with pytest.raises(RuntimeError, match="boom in batch 2"):
        while eng.has_unfinished_requests():
            eng.step()
    assert core.batch_queue == deque() and core.scheduler.in_flight_batches == []
    assert {g.request_id for g in eng.scheduler.waiting} >= {rid for so in calls for rid in
                                                             (eng.scheduler.queues.seqs[i][1].request_id
                                                              for i in so.num_scheduled_tokens)}
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert [final[str(i)] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in ref]
    assert eng.get_stats()["num_free_gpu_blocks"] == 64
