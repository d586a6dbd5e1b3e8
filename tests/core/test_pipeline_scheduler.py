"""PipelineScheduler on its own, with no model (pipeline parallelism, issue 36): the test
plays the runner and keeps up to pp batches in flight by hand, as PipelineEngineCore's
batch queue does, taking their outputs in order. The rule under test: a request is
never in two in-flight batches (vLLM v1's scheduler with PP sends the sampled tokens to
the workers: the base RunnerView). sched_harness.Harness checks the invariants
(tests/invariants.py) after every output taken in.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from sched_harness import Harness

from nanopaged.core.pipeline_scheduler import PipelineScheduler
from nanopaged.core.runner_view import RunnerView
from nanopaged.core.scheduler import Scheduler
from nanopaged.core.sequence import SequenceStatus
from nanopaged.extensions import build_class


class PipelineHarness(Harness):
    """Harness whose scheduler is the one the engine builds for pipeline_parallel_size=pp."""

    def __init__(self, *args, pp: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = replace(self.scheduler.config, pipeline_parallel_size=pp)
        self.scheduler = build_class(Scheduler, "scheduler", config)(config, self.block_manager)
        self.replay.engine = self

    def requests_in(self, so) -> set[str]:
        return {name.split("/")[0] for name in self.scheduled(so)}


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def test_the_engine_builds_it_on_async_scheduling_with_the_base_runner_view():
    h = PipelineHarness(num_gpu_blocks=8)
    assert isinstance(h.scheduler, PipelineScheduler)
    assert type(h.scheduler.runner_view) is RunnerView      # the scheduler sends the sampled tokens
    # the plain async entries are off at pp > 1 even when asked for: the pipeline subclasses them
    config = replace(h.scheduler.config, async_scheduling=True)
    assert build_class(Scheduler, "scheduler", config).__mro__[1] is PipelineScheduler


def test_a_request_in_flight_is_left_out_until_its_output_is_in():
    """A and B decode. Batch 1 takes both (one batch holds every request that can run);
    batch 2, scheduled while 1 is in flight, has nothing (a schedule with no tokens is
    no batch). Once batch 1's output is in, A and B run again with its tokens sent."""
    h = PipelineHarness(num_gpu_blocks=16)
    h.add("A", tokens(10, 4), max_tokens=3)
    h.add("B", tokens(20, 4), max_tokens=3)
    b1 = h.schedule()
    assert h.scheduled(b1) == {"A": 4, "B": 4}
    assert h.scheduler.in_flight_batches == [list(b1.num_scheduled_tokens)]
    b2 = h.schedule()
    assert b2.total_num_scheduled_tokens == 0 and len(h.scheduler.in_flight_batches) == 1
    h.finish(b1, {"A": 1, "B": 2})
    assert h.scheduler.in_flight_batches == []
    b3 = h.schedule()
    assert h.scheduled(b3) == {"A": 1, "B": 1}
    # the base RunnerView: the token batch 1 sampled goes to the runner in the message
    assert sorted(b3.scheduled_cached_reqs.new_token_ids) == [[1], [2]]


def test_batches_stagger_by_the_token_budget_and_stay_staggered():
    """A 6-token budget: batch 1 prefills A (and a chunk of B), batch 2 must leave A and
    B (in flight) and prefills C; from then on the two groups alternate, each batch
    taken in order, and every request gets its tokens."""
    h = PipelineHarness(num_gpu_blocks=32, budget=6)
    for i, rid in enumerate("ABC"):
        h.add(rid, tokens(10 * (i + 1), 4), max_tokens=4)
    b1 = h.schedule()
    assert h.scheduled(b1) == {"A": 4, "B": 2}
    b2 = h.schedule()
    assert h.scheduled(b2) == {"C": 4}
    assert h.scheduler.in_flight_batches == [list(b1.num_scheduled_tokens), list(b2.num_scheduled_tokens)]
    seqs, done, queue = {r: h.seq(r) for r in "ABC"}, {}, [b1, b2]
    for _ in range(40):
        if not queue:
            break
        so = queue.pop(0)
        out = h.finish(so, dict.fromkeys(h.samplers(so), 7))
        done.update({o.request_id: o for o in out.outputs if o.finished})
        nxt = h.schedule()
        seen = {rid for b in queue for rid in h.requests_in(b)}
        assert not h.requests_in(nxt) & seen, "a request is in two in-flight batches"
        if nxt.total_num_scheduled_tokens:
            queue.append(nxt)
    assert sorted(done) == ["A", "B", "C"]
    assert [len(seqs[r].output_token_ids) for r in "ABC"] == [4, 4, 4]
    assert h.free_blocks() == 32


def test_n_samples_wait_for_the_fork_and_chunks_for_the_chunk_before():
    """n=2: the prefill batch samples for both; the forks decode only once it is in (and
    the engine schedules nothing behind it meanwhile: can_schedule_ahead). A prompt
    chunked over two batches: its second chunk waits for the first."""
    h = PipelineHarness(num_gpu_blocks=32, budget=8)
    h.add("A", tokens(10, 4), n=2, max_tokens=2)
    h.add("B", tokens(30, 12), max_tokens=1)
    a, a1, b = h.seq("A"), h.seq("A", 1), h.seq("B")
    b1 = h.schedule()
    assert h.scheduled(b1) == {"A": 4, "A/1": 0, "B": 4} and not h.scheduler.can_schedule_ahead()
    assert h.schedule().total_num_scheduled_tokens == 0        # A, its fork and B's next chunk wait
    h.finish(b1, {"A": 3, "A/1": 4})
    b3 = h.schedule()
    assert h.scheduled(b3) == {"A": 1, "A/1": 1, "B": 6}
    assert h.schedule().total_num_scheduled_tokens == 0
    h.finish(b3, {"A": 5, "A/1": 6})
    b5 = h.schedule()
    assert h.scheduled(b5) == {"B": 2}
    h.finish(b5, {"B": 9})
    assert a.output_token_ids == [3, 5] and a1.output_token_ids == [4, 6]
    assert b.output_token_ids == [9] and h.free_blocks() == 32


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_preempted_while_in_flight_keeps_its_token_and_waits(mode):
    """pp=3, a pool of 5 blocks. A and B prefill in batch 1, C in batch 2 (taking the
    pool but one block). Batch 3: A's decode takes the last block, B's finds none, and
    the latest arrival, C, is preempted although batch 2 still computes it (its blocks
    are freed or swapped behind batch 2, in each rank's message order). C stays in
    flight until batch 2 is in, and the token batch 2 sampled for it is kept."""
    h = PipelineHarness(num_gpu_blocks=5, budget=8, pp=3, chunked=False, preemption_mode=mode,
                        num_cpu_blocks=8 if mode == "swap" else 0)
    h.add("A", tokens(10, 4), max_tokens=3)
    h.add("B", tokens(20, 4), max_tokens=3)
    h.add("C", tokens(30, 8), max_tokens=3)
    seqs = {r: h.seq(r) for r in "ABC"}
    b1 = h.schedule()
    assert h.scheduled(b1) == {"A": 4, "B": 4}
    b2 = h.schedule()
    assert h.scheduled(b2) == {"C": 8} and h.free_blocks() == 1
    h.finish(b1, {"A": 1, "B": 2})
    b3 = h.schedule()
    assert h.scheduled(b3) == {"A": 1, "B": 1} and h.preempted == [("C", mode)]
    queue = h.scheduler.swapped if mode == "swap" else h.scheduler.waiting
    assert [g.request_id for g in queue] == ["C"] and h.scheduler.is_in_flight("C")
    assert h.schedule().total_num_scheduled_tokens == 0          # A, B and C are all in flight
    h.finish(b2, {"C": 5})
    assert not h.scheduler.is_in_flight("C") and seqs["C"].output_token_ids == [5]
    h.finish(b3, {"A": 3, "B": 4})
    for _ in range(20):
        if not h.scheduler.has_unfinished_requests():
            break
        h.step()
    assert [seqs[r].output_token_ids for r in "ABC"] == [[1, 3, 7], [2, 4, 7], [5, 7, 7]]
    assert [seqs[r].status for r in "ABC"] == [SequenceStatus.FINISHED_LENGTH] * 3
    assert h.free_blocks() == 5


def test_reset_after_failure_clears_the_batches_in_flight():
    h = PipelineHarness(num_gpu_blocks=16, budget=4)
    h.add("A", tokens(10, 4), max_tokens=3)
    h.add("B", tokens(20, 4), max_tokens=3)
    b1, b2 = h.schedule(), h.schedule()
    assert h.scheduled(b1) == {"A": 4} and h.scheduled(b2) == {"B": 4}
    h.scheduler.reset_after_failure([b1, b2])
    assert h.scheduler.in_flight_batches == [] and not h.scheduler.is_in_flight("A")
    assert [g.request_id for g in h.scheduler.waiting] == ["A", "B"] and h.free_blocks() == 16
    assert h.scheduled(h.schedule()) == {"A": 4}
