"""Pipeline parallelism (EngineConfig.pipeline_parallel_size, issue 36): the setting and
its refusals; the batch queue (PipelineEngineCore + PipelineScheduler) over an
in-process executor, so that its rule (a request is never in two in-flight batches)
and its outputs are checked on every workload with no process started; then the real
grid of worker processes (stages over gloo), which must give pp=1's ids token for token.
"""
from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest

from nanopaged import LLM, BeamSearchParams, EngineConfig, SamplingParams, StructuredOutputsParams
from nanopaged.engine.arg_utils import add_cli_args, engine_kwargs
from nanopaged.exercises.tiny_model import make_tiny_llama
from nanopaged.messages import PreemptionCosts
from nanopaged.utils.proc import EngineDeadError
from nanopaged.worker.executor import combine_stage_costs
from nanopaged.worker import executor as executor_module

from conftest import InterruptOnce
from invariants import check_block_invariants

pytestmark = [pytest.mark.timeout(600), pytest.mark.exactness]


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
    assert config.parallel_config.world_size == 4 and config.parallel_config.executor_backend == "mp"
    assert EngineConfig().parallel_config.world_size == 1 and EngineConfig().parallel_config.executor_backend == "uni"


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

    def one_worker(config, model_path, model_config, ops, composition):
        if config.parallel_config.pipeline_parallel_size == 1:
            return create(config, model_path, model_config, ops, composition)
        whole = replace(config, pipeline_parallel_size=1, distributed_executor_backend="uni")
        return executor_module.UniProcExecutor(whole, model_path, model_config, ops)

    monkeypatch.setattr(executor_module.Executor, "create", staticmethod(one_worker))


def checked(llm) -> LLM:
    """llm whose engine core checks, after each step, that no request (nor sequence) is
    in two batches in flight, and the block invariants (and the runner's record, when
    the runner is in this process)."""
    eng, core = llm.engine, llm.engine.engine_core
    step = core.step
    local = hasattr(core.executor, "driver_worker")

    def checked_step():
        out = step()
        seqs = core.scheduler.queues.seqs
        batches = [b.scheduler_output for b in core.batch_queue if b.is_batch]
        seq_ids = [i for so in batches for i in so.num_scheduled_tokens]
        assert len(seq_ids) == len(set(seq_ids)), "a sequence is in two in-flight batches"
        requests = [{seqs[i][1].request_id for i in so.num_scheduled_tokens if i in seqs} for so in batches]
        assert sum(map(len, requests)) == len(set().union(*requests)), "a request is in two in-flight batches"
        assert core.scheduler.in_flight_batches == [list(so.num_scheduled_tokens) for so in batches]
        if not any(getattr(b.future, "done", bool)() and b.future.exception() for b in core.batch_queue):
            # (a batch that raised is taken in, and undone, next step)
            check_block_invariants(eng if local else blocks_only(eng))
        return out

    core.step = checked_step
    return llm


def blocks_only(eng) -> SimpleNamespace:
    """What check_block_invariants reads of an engine whose runners are in worker
    processes: the pools and queues, and no runner record to compare."""
    s = eng.scheduler
    view = SimpleNamespace(known={}, finished_seq_ids=set())
    scheduler = SimpleNamespace(waiting=s.waiting, running=s.running, swapped=s.swapped, requests=s.requests,
                                config=s.config, runner_view=view)
    return SimpleNamespace(block_manager=eng.block_manager, scheduler=scheduler,
                           model_runner=SimpleNamespace(input_batch=SimpleNamespace(seqs={})))


PREFIX = list(range(40, 60))
PROMPTS = [PREFIX + [i, i + 1] for i in range(3, 7)] + [list(range(100, 131)), [5, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=14, ignore_eos=True)
FORKS = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
MIXED = [GREEDY, SEEDED, FORKS, GREEDY, SEEDED, FORKS]


def completions(outs):
    """Every completion's ids, and the ids and logprobs of each top-logprob row (sample
    and prompt rows), as comparable values."""
    def lp(rows):
        return [sorted((t, v.logprob) for t, v in row.items()) if row else row for row in rows or []]
    return [([(c.token_ids, lp(c.logprobs)) for c in o.outputs], lp(o.prompt_logprobs)) for o in outs]


def reference(folder, prompts=PROMPTS, params=MIXED, **kw):
    """pp=1, a pool with room for everything (no preemption)."""
    llm = LLM(str(folder), num_gpu_blocks=256, block_size=4, dtype="float32", preemption_mode="recompute", **kw)
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
    assert completions(first) == completions(ref_first) and completions(outs) == completions(ref)   # one process: bits
    stats = llm.engine.get_stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0, stats
    assert stats["prefix_cache_hits"] > 0 and stats["num_copy_on_write"] > 0, stats
    assert stats["max_batches_in_flight"] == pp and stats["num_batches_in_flight"] == 0
    assert stats["num_free_gpu_blocks"] == 32 and stats["num_free_cpu_blocks"] == 6


def test_batch_queue_beams_and_structured_outputs(in_process, four_layers):
    date = SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    params = [date, SEEDED, date, GREEDY, date, SEEDED]

    def run(llm):
        return ([[(s.tokens, s.cum_logprob) for s in o.sequences] for o in llm.beam_search(PROMPTS[:3], beams)],
                completions(llm.generate(PROMPTS, params, use_tqdm=False)))

    ref = run(LLM(str(four_layers), num_gpu_blocks=256, block_size=4, dtype="float32"))
    llm = checked(LLM(str(four_layers), num_gpu_blocks=256, block_size=4, dtype="float32", pipeline_parallel_size=2,
                      max_num_batched_tokens=16, max_num_seqs=8))
    assert run(llm) == ref
    assert llm.engine.get_stats()["max_batches_in_flight"] == 2


@pytest.mark.parametrize("pp", [2, 3])
def test_requests_arriving_together_decode_in_pp_batches_in_flight(in_process, four_layers, pp):
    """8 requests arrive together with a budget that fits all their prompts: once they
    all decode, pp batches are in flight at once (the cap: ceil(8 / pp) sequences a
    step), not one batch of 8; the ids are pp=1's."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [list(range(10 * i + 3, 10 * i + 9)) for i in range(8)]
    ref = LLM(str(four_layers), num_gpu_blocks=128, block_size=4, dtype="float32").generate(prompts, params,
                                                                                             use_tqdm=False)
    llm = checked(LLM(str(four_layers), num_gpu_blocks=128, block_size=4, dtype="float32", pipeline_parallel_size=pp,
                      max_num_batched_tokens=256, max_num_seqs=8))
    eng, core = llm.engine, llm.engine.engine_core
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    final, decoding = {}, None
    while eng.has_unfinished_requests():
        seqs = [g.seqs[0] for g in core.scheduler.requests.values()]
        if decoding is None and len(seqs) == 8 and all(s.output_token_ids for s in seqs):
            decoding, core.max_batches_in_flight = [], 0    # from here on every batch is decodes
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        if decoding is not None:
            decoding.append([len(b.scheduler_output.num_scheduled_tokens) for b in core.batch_queue])
    assert core.max_batches_in_flight == pp, decoding
    assert [final[str(i)] for i in range(8)] == [o.outputs[0].token_ids for o in ref]


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


# ---- the grid of worker processes (stages over gloo) ---------------------------------

def worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine.engine_core.executor.procs]


def wait_gone(pids, timeout: float = 15.0) -> set[int]:
    """The pids still alive after waiting up to `timeout` seconds."""
    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:            # a zombie is gone too
            return f.read().split(")")[-1].split()[0] != "Z"
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if alive(p)}


def test_preemption_costs_add_up_over_stages():
    """Recomputing runs every stage's layers one after another (seconds add up); a swap
    copies each stage's blocks at once (the slowest stage). One stage: rank 0's own."""
    costs = [PreemptionCosts(1e-3, 2e-4), PreemptionCosts(9e-3, 9e-4),     # stage 0: tp ranks 0, 1
             PreemptionCosts(3e-3, 5e-4), PreemptionCosts(7e-3, 7e-4)]     # stage 1
    assert combine_stage_costs(costs, 2) == PreemptionCosts(3e-3, 2e-4 + 5e-4)
    assert combine_stage_costs(costs, 4) is costs[0]


@pytest.fixture(scope="module")
def pp1_reference(four_layers):
    """pp1_reference(tp) -> reference()'s outputs at pp=1 with tp ranks, made once per tp:
    stages only split the layers, so pp > 1 must give these bits at the same tp (tensor
    parallelism changes the order of the sums, so another tp is another claim)."""
    made = {}

    def get(tp):
        if tp not in made:
            made[tp] = reference(four_layers, tensor_parallel_size=tp)
        return made[tp]
    return get


BEAMS = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
DATE = SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=20,
                      structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}"))


def beams_and_grammars(llm):
    params = [DATE, SEEDED, DATE, GREEDY, DATE, SEEDED]
    return ([[(s.tokens, s.cum_logprob) for s in o.sequences] for o in llm.beam_search(PROMPTS[:3], BEAMS)],
            llm.generate(PROMPTS, params, use_tqdm=False))


@pytest.mark.parametrize("pp, tp", [(2, 1), pytest.param(3, 1, marks=pytest.mark.slow),
                                    pytest.param(2, 2, marks=pytest.mark.slow)])
def test_worker_grid_gives_pp1_ids_logprobs_and_samples(four_layers, pp1_reference, pp, tp):
    """pp stages (x tp ranks each) in worker processes: the workload of the in-process
    test above (prefix hits, chunked prefill, swap and recompute preemption, seeded and
    n=3 sampling), then beam search and structured outputs, give pp=1's ids and logprobs
    bit for bit at the same tp, in float32, with pp batches in flight and every request in
    at most one of them; shutdown leaves no process and no socket folder."""
    ref_first, ref = pp1_reference(tp)
    llm, first, outs = run_pp(four_layers, pp, tensor_parallel_size=tp)
    pids, folder = worker_pids(llm), llm.engine.engine_core.executor._dir
    assert len(pids) == pp * tp
    assert completions(first) == completions(ref_first)
    assert completions(outs) == completions(ref)
    stats = llm.engine.get_stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0, stats
    assert stats["prefix_cache_hits"] > 0 and stats["num_copy_on_write"] > 0, stats
    assert stats["max_batches_in_flight"] == pp and stats["num_free_gpu_blocks"] == 32
    comm = llm.engine.engine_core.executor.get_comm_stats()
    # every stage but the last sends on
    assert [c["pp_num_hops"] > 0 for c in comm] == [r // tp < pp - 1 for r in range(pp * tp)]
    if pp == 2 and tp == 1:
        beams, sampled = beams_and_grammars(llm)
        ref_beams, ref_sampled = beams_and_grammars(LLM(str(four_layers), num_gpu_blocks=256, block_size=4,
                                                        dtype="float32"))
        assert beams == ref_beams
        assert completions(sampled) == completions(ref_sampled)
        # Ctrl-C while waiting for the oldest batch: the batches in flight are waited
        # for, their requests sent back, and the engine goes on with the same ids
        executor = llm.engine.engine_core.executor
        executor.output = InterruptOnce(executor.output)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, MIXED, use_tqdm=False)
        executor.output = executor.output.sock
        assert llm.engine.engine_core.num_batches_in_flight == 0
        assert completions(llm.generate(PROMPTS, MIXED, use_tqdm=False)) == completions(ref)
    llm.shutdown()
    assert not wait_gone(pids) and not os.path.exists(folder)


@pytest.fixture(scope="module")
def pp2_bf16(four_layers):
    """A pp=2 bf16 engine: the batch-invariance test uses it, then the last test kills it."""
    llm = LLM(str(four_layers), num_gpu_blocks=64, block_size=4, pipeline_parallel_size=2, dtype="bfloat16",
              enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=8, preemption_mode="recompute")
    yield llm
    llm.shutdown()


def test_pp2_in_bf16_is_batch_invariant(pp2_bf16):
    """In bfloat16, a prompt's per-step logprobs at pp=2 are the same floats alone, in a
    batch and again (the stages hand on hidden states as they are: no new rounding)."""
    check_bf16_batch_invariance(pp2_bf16)


@pytest.mark.slow           # three worker processes start: ~20 s on a busy 2-core machine
def test_pp3_in_bf16_is_batch_invariant(four_layers):
    """The same at pp=3 (stages of 1, 2 and 1 layers)."""
    llm = LLM(str(four_layers), num_gpu_blocks=64, block_size=4, pipeline_parallel_size=3, dtype="bfloat16",
              enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=8, preemption_mode="recompute")
    try:
        check_bf16_batch_invariance(llm)
    finally:
        llm.shutdown()


def check_bf16_batch_invariance(llm) -> None:
    """PROMPTS[4]'s greedy ids and logprobs alone, in the whole batch, with one other, and
    alone again: the same floats each time."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)

    def target(prompts):
        out = llm.generate(prompts, params, use_tqdm=False)[prompts.index(PROMPTS[4])].outputs[0]
        return out.token_ids, out.logprobs
    alone = target([PROMPTS[4]])
    assert target(PROMPTS) == alone
    assert target([PROMPTS[4], PROMPTS[0]]) == alone
    assert target([PROMPTS[4]]) == alone


def test_a_stage_that_dies_mid_run_ends_the_engine_naming_it(pp2_bf16):
    """The last stage's worker is killed while batches are in flight: a step raises
    EngineDeadError within seconds naming its rank and stage, every worker is gone, and
    the engine stays dead. (Last in this file: it ends the module's bf16 engine.)"""
    eng, pids = pp2_bf16.engine, worker_pids(pp2_bf16)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.engine_core.num_batches_in_flight > 0
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pipeline stage 1, tensor-parallel rank 0\).* died: "
                                              "killed by SIGKILL"):
        for _ in range(1000):
            eng.step()
    assert time.monotonic() - start < 30
    assert not wait_gone(pids)
    with pytest.raises(EngineDeadError):
        eng.step()
