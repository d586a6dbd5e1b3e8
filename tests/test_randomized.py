"""A randomized workload (hypothesis) with the DESIGN.md invariants checked after every
step: random prompt and output lengths, arrival steps, aborts, block sizes 1-16 and
tiny pools. Greedy outputs of requests that were not aborted must equal solo runs."""
from functools import lru_cache

from hypothesis import HealthCheck, given, settings, strategies as st

from nanopaged import EngineConfig, LLMEngine, SamplingParams

from invariants import check_block_invariants


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = draw(st.integers(1, 6))
    reqs = []
    for i in range(n):
        prompt = tuple(draw(st.lists(st.integers(1, 319), min_size=1, max_size=24)))
        reqs.append(dict(prompt=prompt, max_tokens=draw(st.integers(1, 12)),
                         arrival=draw(st.integers(0, 6)),
                         abort_at=draw(st.one_of(st.none(), st.integers(0, 10)))))
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in reqs)
    # from a pool that only just fits the longest request to a roomy one
    min_blocks = -(-longest // block_size)
    num_blocks = draw(st.integers(min_blocks, 3 * min_blocks))
    max_num_seqs = draw(st.integers(1, 4))
    return block_size, num_blocks, max_num_seqs, reqs


_engines = {}


def get_engine(folder, block_size, num_blocks, max_num_seqs):
    key = (block_size, num_blocks, max_num_seqs)
    if key not in _engines:
        _engines[key] = LLMEngine(EngineConfig(model=str(folder), block_size=block_size,
                                               num_gpu_blocks=num_blocks, max_num_seqs=max_num_seqs))
    return _engines[key]


@lru_cache(maxsize=None)
def solo_output(folder, prompt, max_tokens):
    eng = get_engine(folder, 16, 64, 1)
    eng.add_request("solo", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                return tuple(out.outputs[0].token_ids)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_random_workload_keeps_invariants_and_outputs(tiny_model_dir, workload):
    block_size, num_blocks, max_num_seqs, reqs = workload
    eng = get_engine(tiny_model_dir, block_size, num_blocks, max_num_seqs)
    finished, aborted = {}, set()
    for step in range(500):
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                eng.add_request(f"r{i}", list(r["prompt"]),
                                SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True))
            if r["abort_at"] == step and r["arrival"] <= step and f"r{i}" not in finished:
                eng.abort_request(f"r{i}")
                aborted.add(f"r{i}")
        check_block_invariants(eng)
        if step > max(r["arrival"] for r in reqs) and not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        check_block_invariants(eng)
    else:
        raise AssertionError("workload did not finish in 500 steps")
    assert eng.block_manager.get_num_free_gpu_blocks() == num_blocks
    for i, r in enumerate(reqs):
        rid = f"r{i}"
        if rid in aborted:
            continue
        assert tuple(finished[rid].outputs[0].token_ids) == solo_output(
            str(tiny_model_dir), r["prompt"], r["max_tokens"]), rid
