"""Feature state lives with the feature (core/sequence.py's docstring): Sequence,
SequenceGroup and the messages hold the base's fields only, and each later feature keeps
its per-request state in tables of its own, by seq_id or request_id (or by step), filled
when a request arrives and emptied when it leaves (the hook Scheduler._request_removed).

Driven through every way a request lives and ends (finished, stopped by a string,
aborted with a step in flight, n > 1 forks, beam forks, preemption by swap and by
recompute, async scheduling's placeholders, speculative decoding's drafts, a grammar
meeting drafts): after each step no table holds a sequence or request that has left, and
once every request has ended every table is empty. The state survives preemption: the
outputs are the ones of a pool that never preempts."""
import re

import pytest

from nanopaged import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from nanopaged.sampling_params import BeamSearchParams

pytestmark = pytest.mark.timeout(600)

# the scheduler's feature tables: attribute -> what it is keyed by
TABLES = {
    "num_output_placeholders": "seq",                 # async scheduling
    "spec_token_ids": "seq", "_taken_back": "seq",    # speculative decoding
    "grammars": "seq", "_rows": "step",               # structured outputs
    "beam_states": "request", "_beam_groups": "request",   # beam search
}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
REPEAT = [5, 6, 7, 8, 9, 10] * 3                      # the n-gram proposer finds drafts in it


def tables(scheduler) -> dict[str, dict]:
    return {name: getattr(scheduler, name) for name in TABLES if hasattr(scheduler, name)}


def check_tables(scheduler) -> None:
    """No table holds a sequence or a request that has left (a step's record lives until
    its masks are made, so at most the steps in flight)."""
    seqs = {s.seq_id for g in scheduler.requests.values() for s in g.seqs}
    for name, table in tables(scheduler).items():
        kind = TABLES[name]
        if kind == "seq":
            assert set(table) <= seqs, (name, set(table) - seqs)
        elif kind == "request":
            assert set(table) <= set(scheduler.requests), (name, set(table) - set(scheduler.requests))
        else:
            assert len(table) <= 2, (name, table)


def workload(spec: bool):
    """(request_id, prompt, params) of every request, and the one aborted at step 3."""
    grammar = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex=DATE))
    requests = [
        ("date", [1, 2, 3, 4, 5, 6, 7], grammar),
        ("fork", list(range(20, 37)), SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=14, ignore_eos=True)),
        ("stop", list(range(40, 50)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["e"])),
        ("abort", list(range(60, 75)), SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=30,
                                                      ignore_eos=True)),
        ("repeat", REPEAT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
    ]
    if not spec:                                      # beams are refused with speculative decoding
        requests.append(("beams", list(range(80, 89)), BeamSearchParams(beam_width=3, max_tokens=10)))
    return requests


def run(tiny_model_dir, spec: bool, **kw) -> tuple[dict[str, list], dict]:
    """Every request through one LLMEngine, checking the tables after each step; returns
    (request_id -> its completions' token ids and texts, the engine's stats)."""
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, dtype="float32", seed=0,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3} if spec else None,
                          **kw)
    engine = LLMEngine(config)
    scheduler = engine.engine_core.scheduler
    for request_id, prompt, params in workload(spec):
        engine.add_request(request_id, prompt, params)
    assert tables(scheduler)["grammars"] and (spec or tables(scheduler)["beam_states"])
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [(list(c.token_ids), c.text) for c in out.outputs]
        steps += 1
        if steps == 3:
            engine.abort_request("abort")             # with async scheduling: a step of it in flight
        check_tables(scheduler)
        assert steps < 2000
    assert {name: dict(t) for name, t in tables(scheduler).items()} == {name: {} for name in tables(scheduler)}
    assert scheduler.requests == {} and "abort" not in final
    return final, engine.get_stats()


CASES = {
    "swap": {"num_gpu_blocks": 28, "num_cpu_blocks": 256, "preemption_mode": "swap"},
    "recompute": {"num_gpu_blocks": 28, "preemption_mode": "recompute"},
    "async-recompute": {"num_gpu_blocks": 28, "preemption_mode": "recompute", "async_scheduling": True},
    "spec-recompute": {"num_gpu_blocks": 28, "preemption_mode": "recompute", "spec": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_feature_tables_hold_only_live_requests_and_are_empty_at_the_end(tiny_model_dir, case):
    kw = dict(CASES[case])
    spec = kw.pop("spec", False)
    got, stats = run(tiny_model_dir, spec, **kw)
    assert stats[f"num_preemptions_{kw['preemption_mode']}"] > 0, "the pool never ran short: nothing was preempted"
    want, roomy = run(tiny_model_dir, spec, num_gpu_blocks=512,
                      **{k: v for k, v in kw.items() if k not in ("num_gpu_blocks", "num_cpu_blocks")})
    assert roomy["num_preemptions"] == 0
    assert got == want                                # the features' state survived the preemptions
    assert all(re.fullmatch(DATE, text) for _, text in got["date"])
    if spec:
        assert stats["spec_decode_num_draft_tokens"] > 0
