"""PipelineScheduler on its own, with no model (pipeline parallelism, issue 36): the test
plays the runner and keeps up to pp batches in flight by hand, as PipelineEngineCore's
batch queue does, taking their outputs in order. The rules under test: a request is
never in two in-flight batches (vLLM v1's scheduler with PP sends the sampled tokens to
the workers: the base RunnerView), and a step schedules at most ceil(demand / pp)
sequences, so that requests arriving together fill pp batches. sched_harness.Harness checks the invariants
(tests/invariants.py) after every output taken in.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from sched_harness import Harness

from nanopaged.pipeline.scheduler import PipelineScheduler
from nanopaged.core.runner_view import RunnerView
from nanopaged.core.scheduler import Scheduler
from nanopaged.core.sequence import SequenceStatus
from nanopaged.features import Composition


class PipelineHarness(Harness):
    """Harness whose scheduler is the one the engine builds for pipeline_parallel_size=pp."""

    def __init__(self, *args, pp: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = replace(self.scheduler.config, pipeline_parallel_size=pp)
        self.scheduler = Composition.of(config).build(Scheduler, "scheduler")(config, self.block_manager)
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
    assert Composition.of(config).build(Scheduler, "scheduler").__mro__[1] is PipelineScheduler


def test_a_request_in_flight_is_left_out_until_its_output_is_in():
    """A and B decode at pp=2: a batch takes ceil(2 / 2) = 1 of them, so batch 1 is A and
    batch 2 is B; batch 3, scheduled while both are in flight, has nothing (a schedule
    with no tokens is no batch). Once batch 1's output is in, A runs again with its
    token sent."""
    h = PipelineHarness(num_gpu_blocks=16)
    h.add("A", tokens(10, 4), max_tokens=3)
    h.add("B", tokens(20, 4), max_tokens=3)
    b1, b2 = h.schedule(), h.schedule()
    assert (h.scheduled(b1), h.scheduled(b2)) == ({"A": 4}, {"B": 4})
    assert h.scheduler.in_flight_batches == [list(b1.num_scheduled_tokens), list(b2.num_scheduled_tokens)]
    b3 = h.schedule()
    assert b3.total_num_scheduled_tokens == 0 and len(h.scheduler.in_flight_batches) == 2
    h.finish(b1, {"A": 1})
    assert h.scheduler.in_flight_batches == [list(b2.num_scheduled_tokens)]
    b4 = h.schedule()
    assert h.scheduled(b4) == {"A": 1}
    # the base RunnerView: the token batch 1 sampled goes to the runner in the message
    assert b4.scheduled_cached_reqs.new_token_ids == [[1]]


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
    """n=2: the prefill batch samples for both (A counts 2 sequences: the cap of
    ceil(3 / 2) = 2 leaves B out); the forks decode only once it is in, and nothing is
    scheduled behind it meanwhile (can_schedule_ahead). A prompt chunked over two
    batches: its second chunk waits for the first."""
    h = PipelineHarness(num_gpu_blocks=32, budget=8)
    h.add("A", tokens(10, 4), n=2, max_tokens=2)
    h.add("B", tokens(30, 12), max_tokens=1)
    a, a1, b = h.seq("A"), h.seq("A", 1), h.seq("B")
    b1 = h.schedule()
    assert h.scheduled(b1) == {"A": 4, "A/1": 0} and not h.scheduler.can_schedule_ahead()
    h.finish(b1, {"A": 3, "A/1": 4})
    b2 = h.schedule()
    assert h.scheduled(b2) == {"A": 1, "A/1": 1} and h.scheduler.can_schedule_ahead()
    b3 = h.schedule()                       # A's last tokens are in flight: B alone is the demand
    assert h.scheduled(b3) == {"B": 8}
    assert h.schedule().total_num_scheduled_tokens == 0        # A and B's next chunk wait
    h.finish(b2, {"A": 5, "A/1": 6})
    assert h.schedule().total_num_scheduled_tokens == 0
    h.finish(b3, {})
    b5 = h.schedule()
    assert h.scheduled(b5) == {"B": 4}
    h.finish(b5, {"B": 9})
    assert a.output_token_ids == [3, 5] and a1.output_token_ids == [4, 6]
    assert b.output_token_ids == [9] and h.free_blocks() == 32


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_preempted_while_in_flight_keeps_its_token_and_waits(mode):
    """pp=3, a pool of 4 blocks: A, B and C prefill in batches 1, 2 and 3 (one each:
    the cap is ceil(3 / 3)), taking the pool. Batch 1 is in: A's decode needs a block
    and the latest arrival, C, is preempted although batch 3 still computes it (its
    blocks are freed or swapped behind batch 3, in each rank's message order). C stays
    in flight until batch 3 is in, and the token batch 3 sampled for it is kept."""
    h = PipelineHarness(num_gpu_blocks=4, budget=8, pp=3, chunked=False, preemption_mode=mode,
                        num_cpu_blocks=8 if mode == "swap" else 0)
    h.add("A", tokens(10, 4), max_tokens=3)
    h.add("B", tokens(20, 4), max_tokens=3)
    h.add("C", tokens(30, 8), max_tokens=3)
    seqs = {r: h.seq(r) for r in "ABC"}
    b1, b2, b3 = h.schedule(), h.schedule(), h.schedule()
    assert [h.scheduled(b) for b in (b1, b2, b3)] == [{"A": 4}, {"B": 4}, {"C": 8}] and h.free_blocks() == 0
    h.finish(b1, {"A": 1})
    b4 = h.schedule()
    assert h.scheduled(b4) == {"A": 1} and h.preempted == [("C", mode)]
    queue = h.scheduler.swapped if mode == "swap" else h.scheduler.waiting
    assert [g.request_id for g in queue] == ["C"] and h.scheduler.is_in_flight("C")
    assert h.schedule().total_num_scheduled_tokens == 0          # A, B and C are all in flight
    h.finish(b2, {"B": 2})
    h.finish(b3, {"C": 5})
    assert not h.scheduler.is_in_flight("C") and seqs["C"].output_token_ids == [5]
    h.finish(b4, {"A": 3})
    for _ in range(20):
        if not h.scheduler.has_unfinished_requests():
            break
        h.step()
    assert [seqs[r].output_token_ids for r in "ABC"] == [[1, 3, 7], [2, 7, 7], [5, 7, 7]]
    assert [seqs[r].status for r in "ABC"] == [SequenceStatus.FINISHED_LENGTH] * 3
    assert h.free_blocks() == 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_preempted_in_flight_is_not_taken_back_before_its_batch_is_in(mode):
    """pp=3, 4 blocks, a 4-token budget. A's prefill (batch 0), X's (batch X, 8 tokens)
    and C's (batch C) are in flight together. A's output comes in: its decode needs a
    block, and C, the latest arrival, is preempted in flight. X's output comes in next:
    X is done and frees its two blocks, so C fits again while batch C still computes
    it: prefilled anew it is not (recompute), swapped back in it may be (its blocks
    move behind batch C on every rank), but it computes nothing before batch C's output
    (its token) is in; then it runs on."""
    h = PipelineHarness(num_gpu_blocks=4, budget=4, pp=3, chunked=False, preemption_mode=mode,
                        num_cpu_blocks=4 if mode == "swap" else 0)
    h.add("A", tokens(10, 4), max_tokens=3)
    b0 = h.schedule()
    h.add("X", tokens(20, 8), max_tokens=1)
    h.add("C", tokens(30, 4), max_tokens=3)
    c = h.seq("C")
    bx, bc = h.schedule(), h.schedule()
    assert (h.scheduled(b0), h.scheduled(bx), h.scheduled(bc)) == ({"A": 4}, {"X": 8}, {"C": 4})
    h.finish(b0, {"A": 1})
    bp = h.schedule()
    assert h.scheduled(bp) == {"A": 1} and h.preempted == [("C", mode)]
    h.finish(bx, {"X": 2})                                       # X is done: 2 blocks are free
    assert h.free_blocks() == 2
    assert h.schedule().total_num_scheduled_tokens == 0          # C is still in batch C
    h.finish(bc, {"C": 5})
    assert c.output_token_ids == [5]
    h.finish(bp, {"A": 3})
    for _ in range(20):
        if not h.scheduler.has_unfinished_requests():
            break
        h.step()
    assert c.output_token_ids == [5, 7, 7] and h.free_blocks() == 4


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


def drive(h, pp: int, rounds: int) -> list[list[set[str]]]:
    """Play PipelineEngineCore's batch queue for `rounds` outputs: fill up to pp batches
    in flight (behind a fork only once it is in), take the oldest in (token 7 for each
    sampler), then take in what is left. Returns the sequences (by name) of each batch
    in flight after each fill."""
    queue, seen = [], []
    for _ in range(rounds):
        while len(queue) < pp and (not queue or h.scheduler.can_schedule_ahead()):
            so = h.schedule()
            if not so.total_num_scheduled_tokens:
                break
            queue.append(so)
        if not queue:
            break
        seen.append([set(h.scheduled(so)) for so in queue])
        so = queue.pop(0)
        h.finish(so, dict.fromkeys(h.samplers(so), 7))
    for so in queue:
        h.finish(so, dict.fromkeys(h.samplers(so), 7))
    return seen


@pytest.mark.parametrize("pp, sizes, num_tokens", [(2, [4, 4], [4] * 4 + [3] * 4), (3, [3, 3, 2], [4] * 6 + [3] * 2)])
def test_requests_arriving_together_spread_over_pp_batches(pp, sizes, num_tokens):
    """8 requests arrive together: a step takes at most ceil(8 / pp) of them, so their
    prefills fill pp batches and, once decoding, they stay pp batches in flight (not one
    batch of 8 with the other stages idle). Batches rotate: always the same groups."""
    h = PipelineHarness(num_gpu_blocks=64, pp=pp)
    names = [f"R{i}" for i in range(8)]
    for i, name in enumerate(names):
        h.add(name, tokens(10 * i + 10, 4), max_tokens=8)
    seen = drive(h, pp, rounds=3 * pp)
    assert all(sorted(map(len, batches), reverse=True) == sizes for batches in seen), seen
    assert all(set().union(*batches) == set(names) for batches in seen)
    assert seen[-1] == seen[-1 - pp] == seen[-1 - 2 * pp]
    assert [len(h.seq(r).output_token_ids) for r in names] == num_tokens       # 3 * pp + pp - 1 batches


def test_a_request_with_several_sequences_counts_them_all_and_is_never_split():
    """pp=2. A (n=3) and B, C, D: demand 6, cap 3. A's prefill (3 samples) fills a batch;
    B, C, D make the other, and A's three sequences always decode together. Then E (n=4)
    over a cap of ceil(4 / 2) = 2 runs in a batch of its own, never split."""
    h = PipelineHarness(num_gpu_blocks=64, pp=2)
    h.add("A", tokens(10, 4), n=3, max_tokens=4)
    for i, rid in enumerate("BCD"):
        h.add(rid, tokens(20 + 10 * i, 4), max_tokens=4)
    seen = drive(h, 2, rounds=5)         # (then A's last tokens are in flight: B, C, D spread)
    a, bcd = {"A", "A/1", "A/2"}, {"B", "C", "D"}
    assert seen[0] == [a] and all(batches in ([a, bcd], [bcd, a]) for batches in seen[1:]), seen
    while h.scheduler.has_unfinished_requests():
        h.step()
    h.add("E", tokens(60, 4), n=4, max_tokens=3)
    e = h.schedule()
    assert h.scheduled(e) == {"E": 4, "E/1": 0, "E/2": 0, "E/3": 0}
    h.finish(e, dict.fromkeys(h.samplers(e), 7))
    assert h.scheduled(h.schedule()) == {"E": 1, "E/1": 1, "E/2": 1, "E/3": 1}
