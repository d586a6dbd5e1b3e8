"""Exercise 2 (chapter 02): the block manager's allocate and free, with reference counts."""
from __future__ import annotations

NUMBER = 2
CHAPTER = "02-block-manager.md"
TITLE = "BlockManager: allocate and free with reference counts"
TARGETS = ["nanopaged.core.block_manager:BlockManager._allocate_block",
           "nanopaged.core.block_manager:BlockManager.free"]
TASK = """
Write the two ends of the allocator (PagedAttention §4.2-4.3): `_allocate_block` takes
the least recently freed block off the free queue and gives it one holder; `free` drops
a sequence's hold on each of its blocks, and a block that nobody holds any more goes back
to the free queue, tail blocks first. Every allocation and every finished or preempted
request of the engine goes through them.
"""
HINT = """
`free_block_ids` is an OrderedDict used as a queue: `popitem(last=False)` takes the
oldest entry, `free_block_ids[b] = None` puts b at the back. `ref_count[b]` counts the
block tables holding b (fork and the prefix cache make it more than 1): free decrements
it and returns b to the queue only at 0. `seq.block_table.clear()` empties the table and
returns the ids it held; free walks them from the last to the first. A block taken off
the queue may still be named in the prefix cache (chapter 08): `self._evict(b)` forgets
that name. A swapped-out sequence (`seq.is_swapped`) holds CPU blocks: the same
counting with `cpu_ref_count` and the list `free_cpu_block_ids` (append). Events
(`self.observers`) are optional; the checks do not look at them.
"""


def _manager(num_blocks=8, prefix_caching=False, num_cpu_blocks=0):
    from nanopaged.core.block_manager import BlockManager

    return BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching, num_cpu_blocks=num_cpu_blocks)


def _seq(seq_id, prompt, block_ids=(), bm=None):
    """A Sequence whose table holds block_ids (ref counts taken in bm)."""
    from nanopaged.core.sequence import Sequence

    seq = Sequence(seq_id, 0, list(prompt), block_size=4)
    seq.block_table.block_ids, seq.num_computed_tokens = list(block_ids), len(prompt)
    if bm is not None:
        for b in block_ids:
            if bm.ref_count[b] == 0:
                del bm.free_block_ids[b]
            bm.ref_count[b] += 1
    return seq


def check_allocate_least_recently_freed():
    """_allocate_block hands out the least recently freed block, with ref_count 1"""
    bm = _manager(8)
    got = [bm._allocate_block() for _ in range(3)]
    assert got == [0, 1, 2], f"a fresh pool of 8 (free queue 0..7), three allocations: you gave {got}, want [0, 1, 2]"
    assert bm.ref_count[:3] == [1, 1, 1], f"ref_count after handing out 0, 1, 2: {bm.ref_count[:3]}, want [1, 1, 1]"
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7], (
        f"free queue after three allocations: {list(bm.free_block_ids)}, want [3, 4, 5, 6, 7]")
    bm.free_block_ids.clear()
    bm.free_block_ids.update(dict.fromkeys([6, 2, 5]))         # freed in that order
    got = bm._allocate_block()
    assert got == 6, f"free queue [6, 2, 5] (6 freed first): you gave block {got}, want 6"
    assert list(bm.free_block_ids) == [2, 5], f"free queue after it: {list(bm.free_block_ids)}, want [2, 5]"


def check_free_ref_counts():
    """free drops one holder per block; a block is free again only once its last holder lets go (swapped-out CPU blocks too)"""
    from nanopaged.core.sequence import SequenceStatus

    bm = _manager(8)
    a = _seq(0, range(10), [0, 1, 2], bm)                        # a holds 0 1 2
    b = _seq(1, range(6), [0, 1], bm)                            # b shares 0 1 with a
    bm.free(a)
    assert bm.ref_count[:3] == [1, 1, 0], (
        f"blocks 0, 1 held by a and b, block 2 by a alone; after free(a) ref_count is {bm.ref_count[:3]}, "
        "want [1, 1, 0]")
    assert 0 not in bm.free_block_ids and 1 not in bm.free_block_ids, \
        f"b still holds blocks 0 and 1, yet the free queue is {list(bm.free_block_ids)}"
    assert 2 in bm.free_block_ids, f"nobody holds block 2 any more, yet the free queue is {list(bm.free_block_ids)}"
    assert a.block_table.block_ids == [], \
        f"after free(a) its table should be empty, it is {a.block_table}"
    bm.free(b)
    assert bm.ref_count == [0] * 8 and sorted(bm.free_block_ids) == list(range(8)), (
        f"after freeing both, ref_count {bm.ref_count} and free queue {list(bm.free_block_ids)}: "
        "want all 0 and all 8 blocks free")
    cpu = _manager(8, num_cpu_blocks=4)                          # a swapped-out sequence: CPU blocks
    s = _seq(2, range(6), [3, 1])
    s.status = SequenceStatus.SWAPPED
    cpu.cpu_ref_count[3] = cpu.cpu_ref_count[1] = 1
    cpu.free_cpu_block_ids = [2, 0]
    cpu.free(s)
    assert sorted(cpu.free_cpu_block_ids) == [0, 1, 2, 3] and cpu.cpu_ref_count == [0] * 4, (
        f"a swapped-out sequence holding CPU blocks 3, 1: after free, cpu_ref_count {cpu.cpu_ref_count} and "
        f"free_cpu_block_ids {cpu.free_cpu_block_ids}, want all 0 and [0, 1, 2, 3] in any order")
    assert cpu.ref_count == [0] * 8 and len(cpu.free_block_ids) == 8, \
        f"freeing CPU blocks changed the device pool: ref_count {cpu.ref_count}"


def check_free_tail_first():
    """free puts a sequence's tail blocks in the free queue before its head blocks"""
    bm = _manager(8)
    for b in list(bm.free_block_ids):
        del bm.free_block_ids[b]
    bm.free_block_ids.update(dict.fromkeys([7, 6]))
    bm.ref_count = [1] * 6 + [0, 0]
    seq = _seq(0, range(14), [4, 0, 5, 2])
    bm.free(seq)
    got = list(bm.free_block_ids)
    assert got == [7, 6, 2, 5, 0, 4], (
        f"free queue [7, 6], then free a sequence with block table [4, 0, 5, 2]: the queue is {got}, "
        "want [7, 6, 2, 5, 0, 4] (its last block first, appended after the blocks already free)")


def check_cache_kept_until_reused():
    """a freed block keeps its prefix-cache name until _allocate_block hands it out again"""
    bm = _manager(4, prefix_caching=True)
    seq = _seq(0, range(1, 9), [0, 1], bm)                       # 8 tokens in blocks 0, 1
    bm.cache_full_blocks(seq, 0, 8)
    named = dict(bm.cached_blocks)
    bm.free(seq)
    assert bm.cached_blocks == named, (
        f"free must not forget a block's prefix-cache name (a later request may reuse its K/V): blocks 0, 1 were "
        f"cached, after free the cache names blocks {sorted(bm.cached_blocks.values())}")
    bm.free_block_ids.clear()
    bm.free_block_ids.update(dict.fromkeys([2, 3, 1, 0]))        # free queue 2 3 1 0
    got = [bm._allocate_block() for _ in range(3)]
    assert got == [2, 3, 1], f"free queue [2, 3, 1, 0]: three allocations gave {got}, want [2, 3, 1]"
    left = sorted(bm.cached_blocks.values())
    assert left == [0], (f"block 1 was handed out again, so its cache name must go (self._evict); "
                         f"the cache still names blocks {left}, want [0]")
    assert bm.block_hash[1] is None, "the reused block 1 still has a block_hash (self._evict clears it)"


def check_engine_runs_on_it():
    """the engine runs on your allocator in a tight pool (n=2, preemption by recompute and by swap): same tokens, no block lost"""
    from nanopaged import LLM, SamplingParams

    from . import engines_own, tiny_model_folder

    prompts = [list(range(1, 14)), list(range(20, 29)), [7, 8, 9]]
    params = [SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]

    def run(mode):
        llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=12, num_cpu_blocks=16,
                  preemption_mode=mode, attention_backend="torch")
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs], llm.engine.get_stats()

    for mode in ("recompute", "swap"):
        got, stats = run(mode)
        with engines_own():
            want, want_stats = run(mode)
        assert want_stats["num_preemptions"] > 0, f"(setup) {mode}: the engine's own run preempted nobody"
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"preemption by {mode}, request {i}: your run gave {g}, the engine's own {w}"
        for pool in ("gpu", "cpu"):
            total, free = stats[f"num_total_{pool}_blocks"], stats[f"num_free_{pool}_blocks"]
            assert free == total, (f"preemption by {mode}: after every request finished, {total - free} "
                                   f"{pool.upper()} blocks are still held (a leak)")


CHECKS = [check_allocate_least_recently_freed, check_free_ref_counts, check_free_tail_first,
          check_cache_kept_until_reused, check_engine_runs_on_it]
