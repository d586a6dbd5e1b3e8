"""Engine events (events.py): what the engine, the scheduler and the block manager
publish, checked against the block manager itself; tiny random Llama, fast."""
import pytest
from hypothesis import HealthCheck, given, settings

from nanopaged import EngineConfig, LLMEngine, SamplingParams
from nanopaged import events as ev
from nanopaged.events import Observers

from invariants import EventReplay, check_block_invariants
from test_randomized import get_engine, run_workload, workloads


def of(kind, events):
    return [e for e in events if isinstance(e, kind)]


# -- events -----------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_event_stream_agrees_with_block_manager_after_every_step(tiny_model_dir, workload):
    """Replaying the events alone rebuilds every ref_count, the free set, the prefix
    cache's blocks, each block table and the CPU pool: with n > 1, beams, aborts,
    chunked prefill, swap and recompute."""
    block_size, num_blocks, limits, caching, reqs = workload
    eng = get_engine(tiny_model_dir, block_size, num_blocks, limits, caching)
    replay = EventReplay(eng)
    try:
        run_workload(eng, reqs, check=lambda e: (check_block_invariants(e), replay.check()))
    finally:
        eng.remove_observer(replay.apply)


def test_without_observers_no_event_is_published(tiny_model_dir, monkeypatch):
    def refuse(self, *events):
        raise AssertionError(f"published with nobody listening: {events}")
    monkeypatch.setattr(Observers, "publish", refuse)
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_gpu_blocks=8, num_cpu_blocks=8,
                                 preemption_mode="swap"))
    prefix = list(range(1, 9))
    eng.add_request("a", prefix + [9, 10], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=12, ignore_eos=True))
    eng.step()                           # a's prefix blocks are cached once this forward is done
    eng.add_request("b", prefix + [11], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    stats = eng.get_stats()
    assert stats["num_copy_on_write"] and stats["prefix_cache_hits"] and stats["num_preemptions"]


def test_observers_hear_requests_come_and_go(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_gpu_blocks=8))
    heard = []
    with pytest.raises(TypeError, match="observer must be callable"):
        eng.add_observer("print")
    eng.add_observer(heard.append)
    eng.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    eng.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    eng.abort_request("b")
    while eng.has_unfinished_requests():
        eng.step()
    assert [str(e) for e in of((ev.RequestAdded, ev.RequestFinished), heard)] == [
        "request a added: 3 prompt tokens, seqs [0, 1]", "request b added: 3 prompt tokens, seqs [2]",
        "request b finished (abort)", "request a finished (length, length)"]
    first = of(ev.SequenceScheduled, heard)[:2]
    assert [(e.request_id, e.kind, e.start, e.num_tokens, e.forks) for e in first] == [
        ("a", "prefill", 0, 3, (1,)), ("b", "prefill", 0, 3, ())]
    eng.remove_observer(heard.append)
    with pytest.raises(ValueError):
        eng.remove_observer(heard.append)
