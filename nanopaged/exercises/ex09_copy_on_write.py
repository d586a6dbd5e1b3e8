"""Exercise 9 (chapter 09): fork a sequence's blocks, and copy a shared block on write."""
from __future__ import annotations

NUMBER = 9
CHAPTER = "09-copy-on-write.md"
TITLE = "Copy-on-write: BlockManager.fork and append_slots"
TARGETS = ["nanopaged.core.block_manager:BlockManager.fork",
           "nanopaged.core.block_manager:BlockManager.append_slots"]
TASK = """
Write the two halves of copy-on-write (PagedAttention §4.4), as an operating system's
fork() does for pages. fork(parent, child) makes the child's block table point at the
parent's blocks, adding 1 to each block's ref_count, so n samples (or beams) share one
copy of their past. append_slots(seqs, ends) gives one request's running sequences
slots for their positions < ends[i], all of them or none (None when the free blocks
fall short); if a sequence's next token would land in a partly filled block that
someone else also holds, the block is first copied to a fresh one and the (src, dst)
pair returned, so that the model runner copies its K/V before the forward pass writes.
Every step of the engine gets its slots from append_slots, and every n > 1 request and
beam search forks.
"""
HINT = """
fork: self.free(child) first; then self.block_pool.touch(b) (ref_count + 1) for each of
the parent's block ids;
the child's table gets list(parent's block_ids) (its own list); copy list(block_hashes).
Leave num_computed_tokens alone: the scheduler alone writes it (Scheduler._fork copies
the parent's after calling fork).
append_slots: ends defaults to [s.num_tokens for s in seqs]. Ask first: if
self._blocks_to_append(seqs, ends) > self.get_num_free_gpu_blocks(), return None (and
change nothing). Then for each seq and its end: its next write goes to position
seq.num_computed_tokens; when that % block_size != 0 and its last block's ref_count > 1
(self._writes_shared_block(seq)), take dst = self.block_pool.get_new_block(), lower the
old block's ref_count (self.block_pool.free_block(src)), put dst in the table's last place, count self.num_copy_on_write and
remember (src, dst). Then append table.num_new_blocks_for(end) fresh blocks
(self._append_blocks(seq, end) does it). Return the pairs. Never write
num_computed_tokens: the scheduler advances it once the step has run.
"""


def _pool(num_blocks=8):
    from nanopaged.core.block_manager import BlockManager

    return BlockManager(num_gpu_blocks=num_blocks, block_size=4, enable_prefix_caching=False)


def _holding(bm, seq_id, num_tokens, block_ids):
    """A sequence of num_tokens tokens (all computed) whose table holds block_ids."""
    from . import holding_sequence

    return holding_sequence(bm, seq_id, num_tokens, block_ids)


def check_fork():
    """fork: the child drops the blocks it held and shares the parent's (ref_count + 1 each), and their block_hashes"""
    bm = _pool()
    parent = _holding(bm, 0, 6, [3, 5])
    parent.block_hashes = [b"name of block 3"]
    child = _holding(bm, 1, 2, [6])                     # e.g. a beam that died
    bm.fork(parent, child)
    table = child.block_table
    assert table.block_ids == [3, 5], f"the child's table lists blocks {table.block_ids}, the parent's are [3, 5]"
    assert table.block_ids is not parent.block_table.block_ids, \
        "the child's table must get its own list: a later copy-on-write changes one table, not both"
    got = [bm.ref_count[b] for b in (3, 5, 6)]
    assert got == [2, 2, 0], (f"ref counts of blocks 3, 5 (shared now) and 6 (the child's old block): "
                              f"{got}, expected [2, 2, 0]")
    assert 6 in bm.free_block_ids, "the child's old block 6 is held by nobody but is not back in the free queue"
    assert child.num_computed_tokens == 2, (
        f"fork set the child's num_computed_tokens to {child.num_computed_tokens}: that is the scheduler's "
        "to write (Scheduler._fork), the block manager leaves it alone")
    assert child.block_hashes == [b"name of block 3"] and child.block_hashes is not parent.block_hashes, \
        "the child needs a copy of the parent's block_hashes (the prefix-cache names of its full blocks)"


def check_append_slots_grows():
    """append_slots adds a block only when the last one is full, and leaves num_computed_tokens to the scheduler"""
    from nanopaged.core.sequence import Sequence

    bm = _pool()
    seq = Sequence(0, 0, [1, 2, 3, 4, 5, 6], 4)
    for end, want_blocks in ((None, 2), (7, 2), (8, 2), (9, 3), (13, 4)):
        start = seq.num_computed_tokens
        copies = bm.append_slots([seq]) if end is None else bm.append_slots([seq], [end])
        table, end = seq.block_table, 6 if end is None else end
        assert copies == [], f"nothing is shared, yet append_slots returned the copies {copies}"
        assert len(table.block_ids) == want_blocks, (
            f"slots for positions < {end} in blocks of 4 need {want_blocks} blocks; the table has "
            f"{table.block_ids}")
        assert seq.num_computed_tokens == start, (
            f"append_slots changed num_computed_tokens from {start} to {seq.num_computed_tokens}: that is the "
            "scheduler's to write, once the step has run")
        seq.num_computed_tokens = end                   # the step ran (the scheduler's part)
    ids = seq.block_table.block_ids
    assert len(set(ids)) == 4 and all(bm.ref_count[b] == 1 for b in ids), \
        f"each new block must be a fresh one with ref_count 1: table {ids}, ref counts {bm.ref_count}"


def check_copy_on_write():
    """a shared, partly filled last block is copied before a write, and the (src, dst) pair returned; the last holder writes in place"""
    bm = _pool()
    parent = _holding(bm, 0, 6, [0, 1])                 # block 1 holds 2 of 4 tokens
    child = _holding(bm, 1, 6, [0, 1])                  # as after a fork: ref counts 2, 2
    parent.append_token(100)
    child.append_token(200)
    copies = bm.append_slots([parent])
    dst = parent.block_table.block_ids[-1]
    assert len(copies) == 1 and copies[0][0] == 1 and copies[0][1] not in (0, 1), (
        f"the parent writes position 6 into block 1, which the child holds too: expected one pair (1, a fresh "
        f"block), you returned {copies}")
    assert parent.block_table.block_ids == [0, dst] and dst == copies[0][1], \
        f"the parent's table should be [0, {copies[0][1]}] (the copy), it is {parent.block_table.block_ids}"
    assert [bm.ref_count[b] for b in (0, 1, dst)] == [2, 1, 1], (
        f"ref counts of blocks 0, 1 and the copy: {[bm.ref_count[b] for b in (0, 1, dst)]}, expected [2, 1, 1] "
        "(block 0 is full and stays shared; block 1 lost a holder)")
    copies = bm.append_slots([child])
    assert copies == [] and child.block_table.block_ids == [0, 1], (
        f"the child is block 1's only holder now: it writes in place; you returned {copies} and the table "
        f"{child.block_table.block_ids}")
    assert bm.num_copy_on_write == 1, f"num_copy_on_write is {bm.num_copy_on_write}, one block was copied"
    full_a = _holding(bm, 2, 8, [4, 5])
    full_b = _holding(bm, 3, 8, [4, 5])                 # shared, but block 5 is full
    full_a.append_token(7)
    copies = bm.append_slots([full_a])
    assert copies == [] and full_a.block_table.block_ids[:2] == [4, 5] and len(full_a.block_table.block_ids) == 3, (
        f"a full shared block is never written again: position 8 goes to a new block, nothing is copied; you "
        f"returned {copies} and the table {full_a.block_table.block_ids}")
    assert full_b.block_table.block_ids == [4, 5]


def check_all_or_nothing():
    """append_slots says None and changes nothing when the pool lacks the blocks, for one sequence or for a group"""
    for num_blocks, group, what in ((3, False, "a alone needs 2 blocks and 1 is free"),
                                    (4, True, "a and b together need 3 blocks (a: a copy of block 1 and a new "
                                              "block; b, block 1's last holder then: a new block) and 2 are free, "
                                              "though a alone would fit")):
        bm = _pool(num_blocks)
        a = _holding(bm, 0, 6, [0, 1])
        b = _holding(bm, 1, 6, [0, 1])
        for seq in (a, b):
            seq.output_token_ids = [9] * 6              # 12 tokens: positions 6..11 to write
        free, refs = list(bm.free_block_ids), list(bm.ref_count)
        got = bm.append_slots([a, b] if group else [a])
        assert got is None, f"{what}: append_slots should return None, it returned {got}"
        tables = [a.block_table.block_ids, b.block_table.block_ids]
        assert tables == [[0, 1], [0, 1]] and list(bm.free_block_ids) == free and bm.ref_count == refs \
            and bm.num_copy_on_write == 0, (
                f"{what}: after saying None the tables are {tables}, ref counts {bm.ref_count}, free "
                f"{list(bm.free_block_ids)}, copies counted {bm.num_copy_on_write}: all should be unchanged "
                f"([[0, 1], [0, 1]], {refs}, {free}, 0)")


def _sample_and_beam():
    """n=3 seeded samples of two prompts, and a beam search, on one tiny engine:
    (samples, beams, num_copy_on_write)."""
    from nanopaged import LLM, BeamSearchParams, SamplingParams

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=48, attention_backend="torch")
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=7, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27]]     # a half-full last block; 2 full ones
    outs = llm.generate(prompts, params, use_tqdm=False)
    samples = [[list(c.token_ids) for c in o.outputs] for o in outs]
    beams = [s.tokens for s in llm.beam_search([[30, 31, 32, 33, 34]], BeamSearchParams(beam_width=3,
                                                                                          max_tokens=6))[0].sequences]
    stats = llm.engine.get_stats()
    leaked = stats["num_total_gpu_blocks"] - stats["num_free_gpu_blocks"]
    assert not leaked, f"after every request finished, {leaked} KV blocks are still held (a leak)"
    return samples, beams, stats["num_copy_on_write"]


def check_engine_runs_on_it():
    """the engine samples n=3 and beam-searches with your code: same tokens and copies as its own, no block lost"""
    from . import engines_own

    samples, beams, copies = _sample_and_beam()
    with engines_own():
        want_samples, want_beams, want_copies = _sample_and_beam()
    for i, (g, w) in enumerate(zip(samples, want_samples)):
        assert g == w, f"prompt {i}, n=3: with your code the samples are {g}, with the engine's own {w}"
    assert beams == want_beams, f"beam search: with your code {beams}, with the engine's own {want_beams}"
    assert copies == want_copies, f"num_copy_on_write: {copies} with your code, {want_copies} with the engine's own"


CHECKS = [check_fork, check_append_slots_grows, check_copy_on_write, check_all_or_nothing, check_engine_runs_on_it]
