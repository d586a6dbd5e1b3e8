"""The Scheduler on its own, with no model (issue 23; vLLM's tests/v1/core/test_scheduler.py).

Each test drives nanopaged.core.scheduler.Scheduler and its BlockManager by hand:
add_request, schedule() -> SchedulerOutput, and update_from_output with a ModelRunnerOutput
whose sampled tokens the test makes up. sched_harness.Harness plays the runner: it keeps
the runner's record of each sequence from the messages alone, refuses a made-up output
that samples for other sequences than a runner would (a sequence samples only once its
last token is computed), and checks tests/invariants.py (ref counts, free list, prefix
cache, runner record, event replay) after every step.

Blocks hold 4 tokens and pools are tiny, so every block id below can be worked out by
hand: a fresh pool hands out 0, 1, 2, ...; the free queue hands out the least recently
freed block first; a sequence's blocks are freed tail first.
"""
from __future__ import annotations

import pytest
from sched_harness import Harness

from nanopaged.core.sequence import SequenceStatus
from nanopaged.messages import FinishReason


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_evicts_the_latest_arrivals(mode):
    """A, B, C, D (4-token prompts, 4 output tokens each) fill all 4 blocks. Their first
    decode writes position 4, so each needs a second block and none is free. A, the
    oldest, goes first and preempts D, the latest arrival, taking its block; B then
    preempts C. C and D lose their device blocks (freed by recompute, copied to the CPU
    pool by swap), keep their output tokens, wait in arrival order while A and B hold
    the pool, and come back once A and B finish, to complete."""
    h = Harness(num_gpu_blocks=4, preemption_mode=mode, num_cpu_blocks=4 if mode == "swap" else 0)
    for i, rid in enumerate("ABCD"):
        h.add(rid, tokens(10 * (i + 1), 4), max_tokens=4)
    c, d = h.seq("C"), h.seq("D")

    so, _ = h.step({"A": 101, "B": 201, "C": 301, "D": 401})
    assert h.scheduled(so) == {"A": 4, "B": 4, "C": 4, "D": 4}
    assert [h.seq(r).block_table.block_ids for r in "ABCD"] == [[0], [1], [2], [3]]
    assert h.free_blocks() == 0

    so = h.schedule()
    assert h.preempted == [("D", mode), ("C", mode)]
    assert h.scheduled(so) == {"A": 1, "B": 1}
    assert h.seq("A").block_table.block_ids == [0, 3]           # D's block, handed over
    assert h.seq("B").block_table.block_ids == [1, 2]           # C's
    if mode == "recompute":
        assert so.blocks_to_swap_out == []
        for seq in (c, d):
            assert seq.status == SequenceStatus.WAITING
            assert (seq.block_table.block_ids, seq.num_computed_tokens) == ([], 0)
        assert [g.request_id for g in h.scheduler.waiting] == ["C", "D"]
    else:                                   # copied to CPU blocks 0 and 1 before the forward
        assert so.blocks_to_swap_out == [(3, 0), (2, 1)]
        assert (c.block_table.block_ids, d.block_table.block_ids) == ([1], [0])
        for seq in (c, d):
            assert seq.status == SequenceStatus.SWAPPED
            assert (seq.is_swapped, seq.num_computed_tokens) == (True, 4)
        assert [g.request_id for g in h.scheduler.swapped] == ["C", "D"]
    assert (c.output_token_ids, d.output_token_ids) == ([301], [401])
    h.finish(so, {"A": 102, "B": 202})
    assert (h.seq("A").num_computed_tokens, h.seq("B").num_computed_tokens) == (5, 5)

    so, _ = h.step({"A": 103, "B": 203})
    assert h.scheduled(so) == {"A": 1, "B": 1} and h.preempted == []
    so, out = h.step({"A": 104, "B": 204})
    assert h.scheduled(so) == {"A": 1, "B": 1}
    assert out.finished_requests == {"A", "B"} and h.free_blocks() == 4     # A freed 3, 0; B 2, 1

    if mode == "recompute":                 # prompt + its one output token, in one prefill
        so = h.schedule()
        assert h.scheduled(so) == {"C": 5, "D": 5}
        assert [(r.output_token_ids, r.num_computed_tokens, r.block_ids) for r in so.scheduled_new_reqs] == \
            [([301], 0, [3, 0]), ([401], 0, [2, 1])]
        h.finish(so, {"C": 302, "D": 402})
    else:                                   # the swap-in step computes nothing; they decode after it
        so, _ = h.step({})
        assert h.scheduled(so) == {} and so.blocks_to_swap_in == [(1, 3), (0, 0)]
        assert (c.block_table.block_ids, d.block_table.block_ids) == ([3], [0])
        assert not (c.is_swapped or d.is_swapped)
        so, _ = h.step({"C": 302, "D": 402})
        assert h.scheduled(so) == {"C": 1, "D": 1}
        assert (c.block_table.block_ids, d.block_table.block_ids) == ([3, 2], [0, 1])
    h.step({"C": 303, "D": 403})
    _, out = h.step({"C": 304, "D": 404})
    assert out.finished_requests == {"C", "D"}
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out.outputs] == \
        [("C", [304], FinishReason.LENGTH), ("D", [404], FinishReason.LENGTH)]
    assert (c.output_token_ids, d.output_token_ids) == ([301, 302, 303, 304], [401, 402, 403, 404])
    assert h.scheduler.num_preemptions == 2 and h.free_blocks() == 4


def test_chunked_prefill_cuts_a_prompt_at_the_budget():
    """With a budget of 8 tokens a lone 19-token prompt is computed as 8 + 8 + 3 tokens:
    num_computed_tokens goes 8, 16, 19, its table grows by the blocks each chunk fills,
    and it samples only in the step that computes its last token. Later, while it
    decodes, a 12-token prompt gets what its decode leaves of the budget: 7, then 5."""
    h = Harness(num_gpu_blocks=16, budget=8)
    h.add("L", tokens(100, 19))

    so, out = h.step({})
    assert h.scheduled(so) == {"L": 8} and h.samplers(so) == set()
    assert h.seq("L").num_computed_tokens == 8 and h.seq("L").block_table.block_ids == [0, 1]
    assert out.outputs == [] and h.seq("L").output_token_ids == []

    so, out = h.step({})
    assert h.scheduled(so) == {"L": 8} and h.samplers(so) == set()
    c = so.scheduled_cached_reqs           # the runner knows L: a delta, two more blocks
    assert (c.num_computed_tokens, c.new_block_ids, c.new_token_ids) == ([8], [[2, 3]], [[]])
    assert h.seq("L").num_computed_tokens == 16 and out.outputs == []

    so, out = h.step({"L": 1})
    assert h.scheduled(so) == {"L": 3} and so.total_num_scheduled_tokens == 3
    assert so.scheduled_cached_reqs.new_block_ids == [[4]]
    assert h.seq("L").num_computed_tokens == 19 and h.seq("L").output_token_ids == [1]
    assert [(o.request_id, o.new_token_ids) for o in out.outputs] == [("L", [1])]

    h.add("M", tokens(200, 12))
    so, _ = h.step({"L": 2})               # running first: L's decode, then M's first chunk
    assert h.scheduled(so) == {"L": 1, "M": 7} and so.total_num_scheduled_tokens == 8
    assert h.seq("M").num_computed_tokens == 7 and h.seq("M").output_token_ids == []
    so, _ = h.step({"L": 3, "M": 1})
    assert h.scheduled(so) == {"L": 1, "M": 5}
    assert h.seq("M").num_computed_tokens == 12 and h.seq("M").output_token_ids == [1]
    so, _ = h.step({"L": 4, "M": 2})
    assert h.scheduled(so) == {"L": 1, "M": 1}


def test_a_prefix_cache_hit_skips_the_cached_blocks():
    """B's prompt starts with A's first two full blocks (8 tokens). Once the step that
    computed A's prompt has been taken in (its full blocks named), B's first schedule
    computes only its 3 other tokens: its table starts with A's blocks 0 and 1 (ref
    count 2), the runner is told 8 tokens are already computed, and the output reports
    num_cached_tokens 8. A's partial third block is never shared."""
    h = Harness(num_gpu_blocks=8)
    h.add("A", tokens(1, 10))
    so, _ = h.step({"A": 50})
    assert h.scheduled(so) == {"A": 10} and h.seq("A").block_table.block_ids == [0, 1, 2]
    assert [h.block_manager.block_hash[b] is not None for b in (0, 1, 2)] == [True, True, False]

    h.add("B", tokens(1, 8) + [90, 91, 92])
    so = h.schedule()
    assert h.scheduled(so) == {"A": 1, "B": 3}
    [new] = so.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([0, 1, 3], 8)
    assert [h.block_manager.ref_count[b] for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    out = h.finish(so, {"A": 51, "B": 60})
    assert h.seq("B").num_computed_tokens == 11
    assert [o.num_cached_tokens for o in out.outputs if o.request_id == "B"] == [8]
    assert h.block_manager.prefix_cache_hits == 8


def test_no_prefix_hit_in_the_step_that_computes_the_blocks():
    """Two requests with the same prompt admitted in one step cannot share: A's blocks
    are named in the cache only after the step that writes them is taken in (a failed
    forward must leave no named garbage), so B computes all 8 tokens in blocks of its
    own, and only A's copy is named."""
    h = Harness(num_gpu_blocks=8)
    h.add("A", tokens(1, 8))
    h.add("B", tokens(1, 8))
    so, _ = h.step({"A": 50, "B": 60})
    assert h.scheduled(so) == {"A": 8, "B": 8}
    assert (h.seq("A").block_table.block_ids, h.seq("B").block_table.block_ids) == ([0, 1], [2, 3])
    assert sorted(h.block_manager.cached_blocks.values()) == [0, 1]


def test_parallel_sampling_prefills_once_then_forks_and_copies_on_write():
    """n=2 on a 6-token prompt (one full block and a half-full one). The first step
    computes the prompt once, for A; A/1 computes nothing but samples from A's last
    row, and forks A's table when the output is taken in (both blocks ref count 2). In
    the next step both write position 6 into the shared half-full block 1: A, first,
    gets a copy (block 2, copied from 1 before the forward), A/1, now its only holder,
    writes block 1 in place. The full block 0 stays shared until both finish."""
    h = Harness(num_gpu_blocks=6)
    h.add("A", tokens(1, 6), max_tokens=4, n=2)
    a0, a1 = h.seq("A", 0), h.seq("A", 1)

    so = h.schedule()
    assert h.scheduled(so) == {"A": 6, "A/1": 0} and so.sample_from == {a1.seq_id: a0.seq_id}
    assert h.samplers(so) == {"A", "A/1"} and so.blocks_to_copy == []
    h.finish(so, {"A": 101, "A/1": 201})
    assert a0.block_table.block_ids == a1.block_table.block_ids == [0, 1]
    assert h.block_manager.ref_count[:3] == [2, 2, 0]
    assert (a0.num_computed_tokens, a1.num_computed_tokens) == (6, 6)

    so = h.schedule()
    assert h.scheduled(so) == {"A": 1, "A/1": 1} and so.blocks_to_copy == [(1, 2)]
    assert (a0.block_table.block_ids, a1.block_table.block_ids) == ([0, 2], [0, 1])
    c = so.scheduled_cached_reqs           # A's table changed in the middle: sent whole
    assert (c.seq_ids, c.new_block_ids, c.block_ids_replaced) == ([a0.seq_id], [[0, 2]], [True])
    [new] = so.scheduled_new_reqs          # A/1 was never sent a table: sent in full
    assert (new.seq_id, new.block_ids, new.num_computed_tokens) == (a1.seq_id, [0, 1], 6)
    h.finish(so, {"A": 102, "A/1": 202})
    assert h.block_manager.ref_count[:3] == [2, 1, 1] and h.block_manager.num_copy_on_write == 1

    h.step({"A": 103, "A/1": 203})
    so, out = h.step({"A": 104, "A/1": 204})   # position 8 opens a block of its own each
    assert so.scheduled_cached_reqs.new_block_ids == [[3], [4]] and so.blocks_to_copy == []
    assert out.finished_requests == {"A"}
    assert (a0.output_token_ids, a1.output_token_ids) == ([101, 102, 103, 104], [201, 202, 203, 204])
    assert h.free_blocks() == 6


def test_every_block_is_free_once_all_requests_finished_or_were_aborted():
    """Requests end every way a request can: N (n=2) forks and finishes; P is aborted
    mid-prefill, W while it waits, X between schedule() and its output (the token
    sampled for it is dropped), T while swapped out; Y hits N's cached first block
    and finishes; S finishes. Aborted sequences are named in the next step's
    finished_seq_ids. At the end every device and CPU block is free with ref count 0,
    the scheduler holds no request, and the runner has been told to forget them all."""
    h = Harness(num_gpu_blocks=8, budget=16, preemption_mode="swap", num_cpu_blocks=8)
    bm, sched = h.block_manager, h.scheduler
    h.add("N", tokens(1, 6), max_tokens=3, n=2)
    h.add("P", tokens(40, 20))
    so, _ = h.step()
    assert h.scheduled(so) == {"N": 6, "N/1": 0, "P": 10} and h.free_blocks() == 3
    p = h.sid("P")
    sched.abort_requests(["P"])
    assert h.free_blocks() == 6
    h.add("W", tokens(60, 4))
    w = h.sid("W")
    sched.abort_requests(["W"])
    h.add("X", tokens(70, 4))

    so = h.schedule()
    assert h.scheduled(so) == {"N": 1, "N/1": 1, "X": 4} and so.finished_seq_ids == {p, w}
    x = h.sid("X")
    sched.abort_requests(["X"])
    out = h.finish(so, {"N": 7, "N/1": 8, "X": 9})
    assert [(o.request_id, o.new_token_ids) for o in out.outputs] == [("N", [7]), ("N", [8])]
    assert "X" not in sched.requests and h.free_blocks() == 5

    h.add("Y", tokens(1, 4) + [99], max_tokens=5)
    h.add("S", tokens(100, 12), max_tokens=4)
    h.add("T", tokens(200, 12), max_tokens=4)
    y = h.sid("Y")
    so, out = h.step()
    assert h.scheduled(so) == {"N": 1, "N/1": 1, "Y": 1, "S": 12, "T": 1} and so.finished_seq_ids == {x}
    assert h.seq("Y").block_table.block_ids[0] == 0 and out.finished_requests == {"N"}
    # T's next chunk (11 tokens) needs 2 more blocks and 1 is left after S's decode:
    # T, the latest arrival, preempts itself, and goes to the CPU pool
    so, _ = h.step()
    assert h.scheduled(so) == {"Y": 1, "S": 1} and h.preempted == [("T", "swap")]
    assert so.blocks_to_swap_out == [(6, 0)]
    sched.abort_requests(["T"])
    assert bm.get_num_free_cpu_blocks() == 8

    while sched.has_unfinished_requests():
        h.step()
    assert h.free_blocks() == 8 and bm.ref_count == [0] * 8
    assert bm.get_num_free_cpu_blocks() == 8 and bm.cpu_ref_count == [0] * 8
    assert sched.requests == {} and not (sched.waiting or sched.running or sched.swapped)
    so, _ = h.step({})                        # an empty step still carries the last goodbyes
    assert h.scheduled(so) == {} and so.finished_seq_ids == {y} and h.model_runner.seqs == {}
