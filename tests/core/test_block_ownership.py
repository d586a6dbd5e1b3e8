"""Who owns which fact about a sequence's blocks (issue 23), with no model.

A block table stores only its block ids: how many of its slots are written is the
sequence's num_computed_tokens (the scheduler's to write), and whether the ids are CPU
swap-pool blocks is the sequence's status (SWAPPED). BlockManager.append_slots is one
question with one answer: the copy-on-write pairs, or None with nothing changed, for
all the sequences of a request together (vLLM v1's KVCacheManager.allocate_slots).

The block-manager tests make their sequences with the block manager itself
(`forked_pair`) and play the scheduler's part (num_computed_tokens, status); the scheduler tests drive it with sched_harness.Harness. Blocks hold 4
tokens and a fresh pool hands out 0, 1, 2, ...
"""
from __future__ import annotations

from sched_harness import Harness

from nanopaged.core.block_manager import BlockManager
from nanopaged.core.sequence import Sequence, SequenceStatus


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def forked_pair(bm: BlockManager, num_tokens: int) -> tuple[Sequence, Sequence]:
    """Two running samples of one num_tokens-token prompt, all computed, sharing every
    block, as the scheduler leaves them after the fork (it sets num_computed_tokens)."""
    a, b = (Sequence(i, i, tokens(1, num_tokens), 4) for i in (0, 1))
    assert bm.append_slots([a]) == []
    bm.fork(a, b)
    for seq in (a, b):
        seq.num_computed_tokens, seq.status = num_tokens, SequenceStatus.RUNNING
    return a, b


def test_append_slots_says_none_and_changes_nothing_when_a_group_does_not_fit():
    """Two samples share blocks 0 and 1 (6 tokens: block 1 half full) in a pool of 4.
    Each now writes positions 6..11: the first needs a copy of block 1 and a new block,
    the second (block 1's last holder then) a new block: 3 blocks, and 2 are free.
    The first alone would fit, so a per-sequence answer would take its 2 blocks and
    strand the second; append_slots says None for the pair and nothing moves: tables,
    ref counts, the free queue, the copy count."""
    bm = BlockManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = forked_pair(bm, 6)
    for seq in (a, b):
        seq.output_token_ids = [7] * 6                  # 12 tokens: positions 6..11 to write
    free, refs = list(bm.free_block_ids), list(bm.ref_count)
    assert bm.append_slots([a, b]) is None
    assert (a.block_table.block_ids, b.block_table.block_ids) == ([0, 1], [0, 1])
    assert list(bm.free_block_ids) == free == [2, 3] and bm.ref_count == refs == [2, 2, 0, 0]
    assert bm.num_copy_on_write == 0 and (a.num_computed_tokens, b.num_computed_tokens) == (6, 6)
    assert bm.append_slots([a]) == [(1, 2)]                # alone it fits: the answer was for the pair


def test_a_group_sharing_a_partly_filled_block_gets_one_copy_on_write_pair():
    """n=2 after the fork: both hold [0, 1], block 1 holds 2 of 4 tokens. Asked together
    for position 6, the first gets a copy of block 1 (block 2, the one pair returned),
    the second, then block 1's only holder, writes it in place. The full block 0 stays
    shared. num_computed_tokens is not append_slots' to move: it stays 6."""
    bm = BlockManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = forked_pair(bm, 6)
    assert bm.append_slots([a, b], [7, 7]) == [(1, 2)]
    assert (a.block_table.block_ids, b.block_table.block_ids) == ([0, 2], [0, 1])
    assert bm.ref_count == [2, 1, 1, 0] and bm.num_copy_on_write == 1
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 6)


def test_preempts_latest_arrival_when_blocks_run_out():
    """A four-block pool and two requests of 8-token prompts: the first step fills it
    (A: blocks 0, 1; B: 2, 3). A's first decode writes position 8 and needs a block;
    append_slots says None, so the running phase preempts B, the latest arrival (by
    recompute: its blocks freed tail first, 3 then 2), and asks again: A gets block 3.
    B waits at the head of the queue with nothing computed, and nobody is admitted in
    a step that had to preempt."""
    h = Harness(num_gpu_blocks=4, max_model_len=64)
    h.add("A", tokens(10, 8), max_tokens=4)
    h.add("B", tokens(50, 8), max_tokens=4)
    so, _ = h.step()
    assert h.scheduled(so) == {"A": 8, "B": 8} and h.free_blocks() == 0

    so = h.schedule()
    assert h.preempted == [("B", "recompute")]
    assert h.scheduled(so) == {"A": 1}
    assert h.seq("A").block_table.block_ids == [0, 1, 3]
    b = h.seq("B")
    assert (b.status, b.block_table.block_ids, b.num_computed_tokens) == (SequenceStatus.WAITING, [], 0)
    assert [g.request_id for g in h.scheduler.waiting] == ["B"] and h.free_blocks() == 1
    h.finish(so, {"A": 7})


def test_a_swapped_sequence_holds_cpu_ids_and_frees_them_to_the_cpu_pool():
    """Swap mode, the same full pool: B is preempted by swap. Its status says SWAPPED,
    and that alone says its table's ids are CPU blocks (0 and 1, one each, as
    blocks_to_swap_out pairs them with its device blocks 2 and 3). Aborted while swapped out, B is freed *before* its
    status becomes FINISHED_ABORTED, so its ids go back to the CPU pool's free list and
    the device pool is untouched (read as device ids they would corrupt the device
    pool's ref counts)."""
    h = Harness(num_gpu_blocks=4, preemption_mode="swap", num_cpu_blocks=4, max_model_len=64)
    h.add("A", tokens(10, 8), max_tokens=4)
    h.add("B", tokens(50, 8), max_tokens=4)
    h.step()
    so = h.schedule()
    assert h.preempted == [("B", "swap")] and so.blocks_to_swap_out == [(2, 0), (3, 1)]
    b, bm = h.seq("B"), h.block_manager
    assert b.is_swapped and b.status == SequenceStatus.SWAPPED
    assert b.block_table.block_ids == [0, 1] and b.num_computed_tokens == 8
    assert bm.cpu_ref_count == [1, 1, 0, 0] and bm.get_num_free_cpu_blocks() == 2
    assert bm.ref_count == [1, 1, 0, 1]                    # A: 0, 1 and 3 (B's old block)
    h.finish(so, {"A": 7})

    h.scheduler.abort_requests(["B"])
    assert b.status == SequenceStatus.FINISHED_ABORTED and not b.is_swapped and b.block_table.block_ids == []
    assert bm.cpu_ref_count == [0, 0, 0, 0] and sorted(bm.free_cpu_block_ids) == [0, 1, 2, 3]
    assert bm.ref_count == [1, 1, 0, 1] and h.free_blocks() == 1
    h.check()


def test_the_samples_fork_before_the_first_one_can_finish():
    """n=2 on a 6-token prompt; the first sample's first token is a stop token, so it
    finishes in the very step that completes the prompt, and its blocks are freed. The
    second forks the prompt's blocks before any token is appended (a fork after the
    free would copy an empty table while counting 6 tokens computed, and its next
    step would attend to K/V nobody wrote): it keeps blocks 0 and 1, and its next
    step writes position 6 in place."""
    h = Harness(num_gpu_blocks=4, max_model_len=64)
    h.add("A", tokens(1, 6), max_tokens=4, n=2, stop_token_ids=[99])
    a0, a1 = h.seq("A", 0), h.seq("A", 1)
    h.step({"A": 99, "A/1": 201})
    assert a0.status == SequenceStatus.FINISHED_STOPPED and a0.block_table.block_ids == []
    assert (a1.block_table.block_ids, a1.num_computed_tokens) == ([0, 1], 6)
    assert h.block_manager.ref_count == [1, 1, 0, 0]
    so, _ = h.step({"A/1": 202})
    assert h.scheduled(so) == {"A/1": 1} and so.blocks_to_copy == []
    assert a1.block_table.block_ids == [0, 1] and a1.num_computed_tokens == 7


def test_a_swapped_out_n2_request_shares_cpu_blocks_counted_by_the_same_block_pool():
    """Swap mode: A (n=2, 8-token prompt) forks after its prefill, so its samples share
    device blocks 0 and 1 (ref_count 2). When A is preempted by swap, the two blocks
    move once and stay shared: both samples' tables hold CPU blocks [0, 1], whose
    ref_count 2 lives in the CPU pool's own BlockPool records, the same class that
    counts the device pool. Aborting A frees them to 0 and the CPU pool is whole again."""
    from nanopaged.core.block_pool import BlockPool

    h = Harness(num_gpu_blocks=4, preemption_mode="swap", num_cpu_blocks=4, max_model_len=64)
    bm = h.block_manager
    assert type(bm.cpu_block_pool) is type(bm.block_pool) is BlockPool
    h.add("B", tokens(50, 4), max_tokens=4)
    h.add("A", tokens(10, 8), max_tokens=4, n=2)
    h.step({"B": 60, "A": 20, "A/1": 21})
    a0, a1 = h.seq("A", 0), h.seq("A", 1)
    assert a0.block_table.block_ids == a1.block_table.block_ids == [1, 2]
    assert [bm.block_pool.blocks[b].ref_count for b in (1, 2)] == [2, 2]
    so = h.schedule()                                   # B and both samples each need a block: 1 is free
    assert h.preempted == [("A", "swap")] and so.blocks_to_swap_out == [(1, 0), (2, 1)]
    assert a0.block_table.block_ids == a1.block_table.block_ids == [0, 1]
    assert [bm.cpu_block_pool.blocks[b].ref_count for b in (0, 1)] == [2, 2]
    assert bm.cpu_ref_count == [2, 2, 0, 0] and bm.get_num_free_cpu_blocks() == 2
    h.finish(so, {"B": 61})

    h.scheduler.abort_requests(["A"])
    assert a0.block_table.block_ids == a1.block_table.block_ids == []
    assert [bm.cpu_block_pool.ref_count(b) for b in range(4)] == [0, 0, 0, 0]
    assert bm.get_num_free_cpu_blocks() == 4 and sorted(bm.free_cpu_block_ids) == [0, 1, 2, 3]
    h.check()
