"""Async scheduling (EngineConfig.async_scheduling; chapters/16-async-scheduling.md):
step t+1 is scheduled while step t's forward runs, and every way a sequence can stop
while a step is in flight gives the same outputs as with it off. Tiny random model;
the randomized workload (test_randomized.py) covers the mixtures."""
import threading

import pytest

from nanopaged import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams

from invariants import check_block_invariants, run_checked
from conftest import interrupt_next_forward

pytestmark = pytest.mark.exactness

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(100, 117)), [5, 6, 7, 8, 9], list(range(200, 230))]


def engine(folder, async_scheduling, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(folder), async_scheduling=async_scheduling, **kw))


def generate(folder, async_scheduling, prompts, params, **kw):
    """(token_ids, finish_reason, stop_reason, text) of each completion, and the engine."""
    kw = dict(num_gpu_blocks=64, dtype="float32") | kw
    llm = LLM(str(folder), block_size=4, async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == llm.engine.block_manager.num_gpu_blocks
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outs], llm.engine


def on_and_off(folder, prompts, params, **kw):
    off, _ = generate(folder, False, prompts, params, **kw)
    on, eng = generate(folder, True, prompts, params, **kw)
    assert on == off
    return on, eng


def test_config_checks_async_scheduling_is_a_bool():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


def test_stop_at_max_tokens_is_the_same_and_computes_no_extra_token(tiny_model_dir):
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (1, 4, 9)]
    outs, eng = on_and_off(tiny_model_dir, PROMPTS, params)
    assert [len(o[0][0]) for o in outs] == [1, 4, 9] and all(o[0][1] == "length" for o in outs)
    # max_tokens is known in advance: no decode was scheduled past it
    assert eng.get_stats()["num_generated_tokens"] == 14


def test_eos_stop_is_the_same(tiny_model_dir):
    (base,), _ = generate(tiny_model_dir, False, PROMPTS[:1], GREEDY)
    eos = base[0][0][4]                     # the 5th greedy token becomes the eos id
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, async_scheduling=async_scheduling,
                  dtype="float32")
        llm.engine.processor.eos_token_ids = frozenset({eos})
        c = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
        assert (c.token_ids, c.finish_reason) == (base[0][0][:5], "stop")
        assert llm.engine.get_stats()["num_free_gpu_blocks"] == 64


def test_stop_token_ids_and_n_seeded_are_the_same(tiny_model_dir):
    (base,), _ = generate(tiny_model_dir, False, PROMPTS[:1], GREEDY)
    params = [SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[base[0][0][3]]),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
              SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=1, max_tokens=6, stop_token_ids=[3, 50])]
    on_and_off(tiny_model_dir, PROMPTS, params)


def test_stop_string_is_the_same(tiny_model_dir):
    (base,), _ = generate(tiny_model_dir, False, ["Hello"], GREEDY)
    stop = base[0][3][3:6]
    outs, _ = on_and_off(tiny_model_dir, ["Hello", "The capital"],
                         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))
    assert outs[0][0][1:] == ("stop", stop, base[0][3][:3])


def test_beam_search_is_the_same(tiny_model_dir):
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, async_scheduling=async_scheduling,
                  dtype="float32")
        outs.append([[(s.tokens, s.cum_logprob) for s in o.sequences]
                     for o in llm.beam_search([PROMPTS[0], PROMPTS[1]], params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_is_the_same(tiny_model_dir, mode):
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True), GREEDY]
    _, eng = on_and_off(tiny_model_dir, PROMPTS, params, num_gpu_blocks=14, num_cpu_blocks=64,
                        preemption_mode=mode, max_num_batched_tokens=16, max_num_seqs=4)
    assert eng.get_stats()["num_preemptions"] > 0


def test_an_abort_mid_run_frees_everything_and_leaves_the_others_alone(tiny_model_dir):
    finals = []
    for async_scheduling in (False, True):
        eng = engine(tiny_model_dir, async_scheduling)
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, GREEDY)
        final = {}
        for step in range(6):
            for out in eng.step():
                final[out.request_id] = out
            check_block_invariants(eng)
        eng.abort_request("r1")                   # mid-decode, a step in flight with it
        check_block_invariants(eng)
        final.update(run_checked(eng))
        assert "r1" not in eng.requests and not final["r1"].finished
        finals.append({r: o.outputs[0].token_ids for r, o in final.items() if r != "r1"})
    assert finals[0] == finals[1]


def test_first_step_returns_nothing_and_a_step_in_flight_is_unfinished(tiny_model_dir):
    eng = engine(tiny_model_dir, True)
    eng.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert eng.step() == [] and eng.engine_core._in_flight is not None    # its forward runs now
    assert eng.has_unfinished_requests()
    outs = eng.step()
    assert [o.finished for o in outs] == [True] and not eng.requests
    assert not eng.has_unfinished_requests()      # no empty step was left in flight


def test_plain_decode_steps_are_scheduled_ahead(tiny_model_dir):
    """Every schedule() but the first of a plain decode batch runs while the step
    before is still in flight; an n > 1 request's fork step waits (the fallback)."""
    def lags(params):
        eng = engine(tiny_model_dir, True)
        sched, counts, seen = eng.scheduler, {"schedule": 0, "update": 0}, []
        schedule, update = sched.schedule, sched.update_from_output

        def counted_schedule():
            seen.append(counts["schedule"] - counts["update"])   # steps scheduled, not taken in
            counts["schedule"] += 1
            return schedule()

        def counted_update(*a):
            counts["update"] += 1
            return update(*a)

        sched.schedule, sched.update_from_output = counted_schedule, counted_update
        eng.add_request("a", PROMPTS[0], params)
        run_checked(eng)
        return seen

    greedy = lags(GREEDY)
    forked = lags(SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    assert greedy == [0] + [1] * 10        # 10 tokens; the last schedule finds nothing to do
    assert forked == [0, 0, 1, 1, 1]       # the fork step waited for its output


def test_an_exception_in_the_forward_leaves_requests_that_go_on_unchanged(tiny_model_dir):
    """Without aborting (LLM.generate aborts; a server might not): the interrupted
    requests are recomputed and give what they give undisturbed."""
    (want,), _ = generate(tiny_model_dir, False, [PROMPTS[0]], GREEDY)
    # eager: the interrupt is raised by a layer's Python forward, which a CPU graph's
    # replay of a decode step does not call (cpu_graph/model_runner.py)
    eng = engine(tiny_model_dir, True, enforce_eager=True)
    eng.add_request("a", PROMPTS[0], GREEDY)
    for _ in range(4):
        eng.step()
    interrupt_next_forward(eng.model_runner.model.layers[1])
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    check_block_invariants(eng)
    final = run_checked(eng)
    assert final["a"].outputs[0].token_ids == want[0][0]


def test_shutdown_waits_for_the_forward_in_flight(tiny_model_dir):
    """A step may still be in flight when the engine is shut down (LLM.generate returns
    once its own requests are done); the workers' sockets are not thread-safe, and
    closing them under the forward thread's send aborted the process (CI, tp=2).
    shutdown lets the forward finish first."""
    eng = engine(tiny_model_dir, True)
    executor, order, release = eng.engine_core.executor, [], threading.Event()
    forward, stop = executor.execute_model, executor.shutdown

    def held_forward(*args, **kwargs):
        assert release.wait(10)
        order.append("forward")
        return forward(*args, **kwargs)

    def recorded_shutdown():
        order.append("shutdown")
        stop()

    executor.execute_model, executor.shutdown = held_forward, recorded_shutdown
    eng.add_request("a", PROMPTS[1], GREEDY)
    assert eng.step() == [] and eng.engine_core._in_flight is not None     # held in the thread
    timer = threading.Timer(0.3, release.set)
    timer.start()
    eng.shutdown()
    timer.join()
    assert order == ["forward", "shutdown"]
