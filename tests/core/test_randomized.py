"""A randomized workload (hypothesis) with the block-accounting invariants of
tests/invariants.py checked after every step: random prompts (some sharing a prefix),
output lengths, arrival steps, aborts, parallel sampling (n > 1, seeded), beam search,
block sizes 1-16, tiny pools, small token budgets (chunked prefill), preemption by swap
or recompute (or auto), and prefix caching on or off. Every request that was not aborted
must produce exactly what it produces alone, in a roomy engine with caching off; and so
with async scheduling on (the same drawn workloads, fewer of them), and with up to pp=2 or 3
batches in flight (pipeline parallelism's batch queue over one in-process worker)."""
from functools import lru_cache

import pytest

from hypothesis import HealthCheck, given, settings, strategies as st

from nanopaged import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams

from invariants import check_block_invariants

SHARED_PREFIX = tuple(range(40, 60))


@st.composite
def workloads(draw, tight=False):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        prompt = tuple(draw(st.lists(st.integers(1, 319), min_size=1, max_size=20)))
        if draw(st.booleans()):
            prompt = SHARED_PREFIX[:draw(st.integers(4, 20))] + prompt
        kind = draw(st.sampled_from(["greedy", "sample", "beam"]))
        n = 1 if kind == "greedy" else draw(st.integers(1, 3))
        reqs.append(dict(prompt=prompt, kind=kind, n=n, max_tokens=draw(st.integers(1, 10)),
                         seed=draw(st.integers(0, 3)), arrival=draw(st.integers(0, 6)),
                         abort_at=draw(st.one_of(st.none(), st.integers(0, 10)))))
    # from a pool that only just fits the biggest request alone to a roomy one; a tight
    # pool only fits its biggest single sequence (requests may end early with "length")
    need = max((1 if tight else width(r)) * -(-(len(r["prompt"]) + r["max_tokens"]) // block_size)
               for r in reqs)
    num_blocks = draw(st.integers(need, 3 * need))
    # a request's n (or beam width) may not pass max_num_seqs (the Processor's rule, issue 34)
    max_num_seqs = draw(st.integers(max(width(r) for r in reqs), 4))
    # a small token budget makes chunked prefill cut prompts into several steps
    budget = draw(st.one_of(st.integers(max_num_seqs, 24), st.just(None)))
    # preemption by swap (into a CPU pool that may be too small) or by recompute
    preemption = (draw(st.sampled_from(["swap", "recompute", "auto"])), draw(st.integers(0, 2 * need)))
    return block_size, num_blocks, (max_num_seqs, budget, preemption), draw(st.booleans()), reqs


def width(r):
    """Sequences a request runs at once (beams: n + 1, so that beams really branch)."""
    return r["n"] + 1 if r["kind"] == "beam" else r["n"]


def params_of(r):
    if r["kind"] == "beam":
        return BeamSearchParams(beam_width=width(r), max_tokens=r["max_tokens"], ignore_eos=True)
    return SamplingParams(n=r["n"], temperature=0 if r["kind"] == "greedy" else 1.0, seed=r["seed"],
                          max_tokens=r["max_tokens"], ignore_eos=True)


_engines = {}


def get_engine(folder, block_size, num_blocks, limits, caching, async_scheduling=False, spec=None):
    key = (str(folder), block_size, num_blocks, limits, caching, async_scheduling, spec)
    max_num_seqs, budget, (mode, num_cpu_blocks) = limits
    if key not in _engines:
        _engines[key] = LLMEngine(EngineConfig(model=str(folder), block_size=block_size,
                                               num_gpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=budget, enable_prefix_caching=caching,
                                               preemption_mode=mode, num_cpu_blocks=num_cpu_blocks,
                                               async_scheduling=async_scheduling, dtype="float32",
                                               speculative_config=dict(spec) if spec else None))
    return _engines[key]


def completions(out):
    return tuple(tuple(c.token_ids) for c in out.outputs)


@lru_cache(maxsize=None)
def solo_output(folder, prompt, kind, n, max_tokens, seed):
    eng = get_engine(folder, 16, 256, (4, None, ("recompute", 0)), False)
    r = dict(prompt=prompt, kind=kind, n=n, max_tokens=max_tokens, seed=seed)
    eng.add_request("solo", list(prompt), params_of(r))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                return completions(out)


def run_workload(eng, reqs, max_steps=1000, check=check_block_invariants):
    """Feed the requests at their arrival steps, abort on cue, check(eng) after every
    step (default: the invariants); returns (finished outputs by id, aborted ids)."""
    finished, aborted = {}, set()
    for step in range(max_steps):
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                eng.add_request(f"r{i}", list(r["prompt"]), params_of(r))
            if r["abort_at"] == step and r["arrival"] <= step and f"r{i}" not in finished:
                eng.abort_request(f"r{i}")
                aborted.add(f"r{i}")
        check(eng)
        if step > max(r["arrival"] for r in reqs) and not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        check(eng)
    else:
        raise AssertionError(f"workload did not finish in {max_steps} steps")
    assert eng.block_manager.get_num_free_gpu_blocks() == eng.block_manager.num_gpu_blocks
    return finished, aborted


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_random_workload_keeps_invariants_and_outputs(tiny_model_dir, workload):
    block_size, num_blocks, limits, caching, reqs = workload
    eng = get_engine(tiny_model_dir, block_size, num_blocks, limits, caching)
    finished, aborted = run_workload(eng, reqs)
    for i, r in enumerate(reqs):
        if f"r{i}" not in aborted:
            assert completions(finished[f"r{i}"]) == solo_output(
                str(tiny_model_dir), r["prompt"], r["kind"], r["n"], r["max_tokens"], r["seed"]), (i, r)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_async_scheduling_gives_the_same_outputs(tiny_model_dir, workload):
    """Async scheduling (a step scheduled while the one before runs): each request
    produces what it produces alone, as with it off, and the invariants hold after
    every step (aborts land one step later in a request's life: outputs lag a step)."""
    block_size, num_blocks, limits, caching, reqs = workload
    eng = get_engine(tiny_model_dir, block_size, num_blocks, limits, caching, async_scheduling=True)
    finished, aborted = run_workload(eng, reqs)
    assert set(finished) | aborted == {f"r{i}" for i in range(len(reqs))}
    for i, r in enumerate(reqs):
        if f"r{i}" not in aborted:
            assert completions(finished[f"r{i}"]) == solo_output(
                str(tiny_model_dir), r["prompt"], r["kind"], r["n"], r["max_tokens"], r["seed"]), (i, r)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads(tight=True))
def test_tight_pools_never_hang_or_leak(tiny_model_dir, workload):
    """Pools too small for a whole n > 1 request: it may end with "length", but the
    engine always drains, never leaks a block, and answers every request."""
    block_size, num_blocks, limits, caching, reqs = workload
    eng = get_engine(tiny_model_dir, block_size, num_blocks, limits, caching)
    finished, aborted = run_workload(eng, reqs)
    assert set(finished) | aborted == {f"r{i}" for i in range(len(reqs))}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads(), st.sampled_from(["ngram", "self"]), st.integers(1, 4))
def test_speculative_decoding_keeps_invariants_and_greedy_outputs(tiny_model_dir, workload, method, k):
    """Speculative decoding on the same random workloads (beams aside: refused with it):
    the invariants hold after every step (rolled-back slots freed, no named block holding
    a rejected token), nothing leaks, and every greedy request produces what it produces
    alone without speculation (a sampled one draws other random numbers: its length is checked)."""
    block_size, num_blocks, limits, caching, reqs = workload
    reqs = [r for r in reqs if r["kind"] != "beam"]
    if not reqs:
        return
    spec = (("method", "ngram"), ("num_speculative_tokens", k), ("prompt_lookup_min", 1), ("prompt_lookup_max", 2)) \
        if method == "ngram" else (("method", "draft_model"), ("model", str(tiny_model_dir)), ("num_speculative_tokens", k))
    eng = get_engine(tiny_model_dir, block_size, num_blocks, limits, caching, spec=spec)
    finished, aborted = run_workload(eng, reqs)
    assert set(finished) | aborted == {f"r{i}" for i in range(len(reqs))}
    for i, r in enumerate(reqs):
        if f"r{i}" in aborted:
            continue
        out = completions(finished[f"r{i}"])
        if r["kind"] == "greedy":
            assert out == solo_output(str(tiny_model_dir), r["prompt"], r["kind"], r["n"], r["max_tokens"],
                                      r["seed"]), (i, r)
        else:
            assert all(len(c) == r["max_tokens"] for c in out) or \
                finished[f"r{i}"].outputs[0].finish_reason == "length", (i, r)


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    """A tiny Llama with 4 layers: pp=3 splits them (get_pp_indices refuses pp > layers)."""
    from nanopaged.exercises.tiny_model import make_tiny_llama

    folder = tmp_path_factory.mktemp("pp-llama")
    make_tiny_llama(folder, num_hidden_layers=4)
    return folder


def _pipeline_engine(folder, block_size, num_blocks, limits, caching, pp):
    """get_engine's engine with pipeline_parallel_size=pp (PipelineEngineCore and
    PipelineScheduler: up to pp batches in flight) over one whole-model worker in this
    process, each batch run when it is sent (tests/pipeline/test_pipeline_parallel.py)."""
    from dataclasses import replace

    from nanopaged.worker import executor as em

    key = (str(folder), block_size, num_blocks, limits, caching, "pp", pp)
    if key not in _engines:
        max_num_seqs, budget, (mode, num_cpu_blocks) = limits

        def one_worker(config, model_path, model_config, ops, composition):
            whole = replace(config, pipeline_parallel_size=1, distributed_executor_backend="uni")
            return em.UniProcExecutor(whole, model_path, model_config, ops)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(em.Executor, "create", staticmethod(one_worker))
            _engines[key] = LLMEngine(EngineConfig(
                model=str(folder), block_size=block_size, num_gpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, enable_prefix_caching=caching, preemption_mode=mode,
                num_cpu_blocks=num_cpu_blocks, pipeline_parallel_size=pp, dtype="float32"))
    return _engines[key]


def _one_batch_per_request(eng):
    """The pipeline's rule, read from the batches in flight; then the invariants."""
    core, seqs = eng.engine_core, eng.scheduler.queues.seqs
    batches = [b.scheduler_output for b in core.batch_queue if b.is_batch]
    requests = [{seqs[i][1].request_id for i in so.num_scheduled_tokens if i in seqs} for so in batches]
    assert sum(map(len, requests)) == len(set().union(*requests)), "a request is in two in-flight batches"
    check_block_invariants(eng)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads(), st.sampled_from([2, 3]))
def test_pipeline_batches_in_flight_give_the_same_outputs(four_layer_dir, workload, pp):
    """Up to pp batches in flight (pipeline parallelism's batch queue, the stages
    replaced by one in-process worker): each request produces what it produces alone,
    no request is ever in two in-flight batches, and the invariants hold after every step."""
    block_size, num_blocks, limits, caching, reqs = workload
    eng = _pipeline_engine(four_layer_dir, block_size, num_blocks, limits, caching, pp)
    finished, aborted = run_workload(eng, reqs, check=_one_batch_per_request)
    assert set(finished) | aborted == {f"r{i}" for i in range(len(reqs))}
    for i, r in enumerate(reqs):
        if f"r{i}" not in aborted:
            assert completions(finished[f"r{i}"]) == solo_output(
                str(four_layer_dir), r["prompt"], r["kind"], r["n"], r["max_tokens"], r["seed"]), (i, r)
