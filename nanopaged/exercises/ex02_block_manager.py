"""Exercise 2 (chapter 02): the block pool's get_new_block and free_block, with reference counts."""
from __future__ import annotations

NUMBER = 2
CHAPTER = "02-block-manager.md"
TITLE = "BlockPool: hand out and take back blocks, with reference counts"
TARGETS = ["nanopaged.core.block_pool:BlockPool.get_new_block",
           "nanopaged.core.block_pool:BlockPool.free_block"]
TASK = """
Write the two ends of the allocator (PagedAttention §4.2-4.3): `get_new_block` takes
the least recently freed block off the free queue and gives it one holder; `free_block`
drops one holder of a block, and a block that nobody holds any more goes back to the
free queue (at the back, or at the front when asked). Both KV pools, the device pool
and the CPU swap pool, are BlockPools: every allocation, finished request and swap of
the engine goes through them.
"""
HINT = """
Each block has a record, self.block(b) (a KVCacheBlock: ref_count, block_hash, token_ids).
self.free_block_queue is the free queue: popleft() takes the least recently freed id,
append(b) puts b at the back, appendleft(b) at the front. get_new_block: raise
ValueError when the queue is empty; else pop an id, and if its block still has a
prefix-cache name (block.block_hash is not None) forget it with
self._evict_cached_block(block) (chapter 08); set ref_count to 1 and return the id.
free_block(b, front=False): lower ref_count; at 0 the block goes back to the queue
(append, or appendleft when front); return the new ref_count. BlockManager.free calls
it for a table's blocks, last block first.
"""


def _manager(num_blocks=8, prefix_caching=False, num_cpu_blocks=0):
    from nanopaged.core.block_manager import BlockManager

    return BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching, num_cpu_blocks=num_cpu_blocks)


def _seq(seq_id, prompt, block_ids=(), pool=None):
    """A Sequence whose table holds block_ids (a holder each in pool, if given)."""
    from nanopaged.core.sequence import Sequence

    seq = Sequence(seq_id, 0, list(prompt), block_size=4)
    seq.block_table.block_ids, seq.num_computed_tokens = list(block_ids), len(prompt)
    for b in block_ids if pool is not None else ():
        pool.touch(b)
    return seq


def _set_free_queue(pool, order):
    """Every block of pool held once, except `order`: free, in that queue order."""
    for b in range(pool.num_blocks):
        if pool.ref_count(b) == 0:
            pool.touch(b)
    for b in order:
        pool.blocks[b].ref_count = 0
        pool.free_block_queue.append(b)


def check_allocate_least_recently_freed():
    """get_new_block hands out the least recently freed block, with ref_count 1"""
    from nanopaged.core.block_pool import BlockPool

    pool = BlockPool(8)
    got = [pool.get_new_block() for _ in range(3)]
    assert got == [0, 1, 2], f"a fresh pool of 8 (free queue 0..7), three allocations: you gave {got}, want [0, 1, 2]"
    refs = [pool.ref_count(b) for b in range(3)]
    assert refs == [1, 1, 1], f"ref_count after handing out 0, 1, 2: {refs}, want [1, 1, 1]"
    assert list(pool.free_block_queue) == [3, 4, 5, 6, 7], (
        f"free queue after three allocations: {list(pool.free_block_queue)}, want [3, 4, 5, 6, 7]")
    pool = BlockPool(8)
    _set_free_queue(pool, [6, 2, 5])                            # freed in that order
    got = pool.get_new_block()
    assert got == 6, f"free queue [6, 2, 5] (6 freed first): you gave block {got}, want 6"
    assert list(pool.free_block_queue) == [2, 5], f"free queue after it: {list(pool.free_block_queue)}, want [2, 5]"
    pool.get_new_block(), pool.get_new_block()
    try:
        pool.get_new_block()
    except ValueError:
        pass
    else:
        raise AssertionError("get_new_block on a pool with no free block must raise ValueError")


def check_free_ref_counts():
    """free_block drops one holder; a block is free again only once its last holder lets go (CPU pool too)"""
    from nanopaged.core.sequence import SequenceStatus

    bm = _manager(8)
    pool = bm.block_pool
    a = _seq(0, range(10), [0, 1, 2], pool)                      # a holds 0 1 2
    b = _seq(1, range(6), [0, 1], pool)                          # b shares 0 1 with a
    got = [pool.free_block(x) for x in (2, 1, 0)]
    assert got == [0, 1, 1], f"free_block(2), (1), (0) with a holding 0 1 2 and b 0 1 returned {got}, want [0, 1, 1]"
    assert 0 not in pool.free_block_queue and 1 not in pool.free_block_queue, \
        f"b still holds blocks 0 and 1, yet the free queue is {list(pool.free_block_queue)}"
    assert 2 in pool.free_block_queue, f"nobody holds block 2 any more, yet the free queue is {list(pool.free_block_queue)}"
    a.block_table.block_ids = []
    bm.free(b)
    refs = [pool.ref_count(x) for x in range(8)]
    assert refs == [0] * 8 and sorted(pool.free_block_queue) == list(range(8)), (
        f"after freeing both, ref_count {refs} and free queue {list(pool.free_block_queue)}: "
        "want all 0 and all 8 blocks free")
    cpu = _manager(8, num_cpu_blocks=4)                          # a swapped-out sequence: CPU blocks
    s = _seq(2, range(6), [3, 1], cpu.cpu_block_pool)
    s.status = SequenceStatus.SWAPPED
    cpu.free(s)
    assert sorted(cpu.free_cpu_block_ids) == [0, 1, 2, 3] and cpu.cpu_ref_count == [0] * 4, (
        f"a swapped-out sequence holding CPU blocks 3, 1: after free, cpu_ref_count {cpu.cpu_ref_count} and "
        f"free CPU blocks {list(cpu.free_cpu_block_ids)}, want all 0 and [0, 1, 2, 3] in any order")
    assert cpu.ref_count == [0] * 8 and len(cpu.free_block_ids) == 8, \
        f"freeing CPU blocks changed the device pool: ref_count {cpu.ref_count}"


def check_free_tail_first():
    """a block freed goes to the back of the free queue (front=True: the front), so BlockManager.free puts a table's tail first"""
    bm = _manager(8)
    _set_free_queue(bm.block_pool, [7, 6])
    seq = _seq(0, range(14), [4, 0, 5, 2])
    bm.free(seq)
    got = list(bm.free_block_ids)
    assert got == [7, 6, 2, 5, 0, 4], (
        f"free queue [7, 6], then free a sequence with block table [4, 0, 5, 2]: the queue is {got}, "
        "want [7, 6, 2, 5, 0, 4] (its last block first, appended after the blocks already free)")
    bm.block_pool.touch(4)
    bm.block_pool.free_block(4, front=True)
    got = list(bm.free_block_ids)
    assert got == [4, 7, 6, 2, 5, 0], f"free_block(4, front=True): the queue is {got}, want block 4 first"


def check_cache_kept_until_reused():
    """a freed block keeps its prefix-cache name until get_new_block hands it out again"""
    bm = _manager(4, prefix_caching=True)
    seq = _seq(0, range(1, 9), [0, 1], bm.block_pool)            # 8 tokens in blocks 0, 1
    bm.cache_full_blocks(seq, 0, 8)
    named = dict(bm.cached_blocks)
    bm.free(seq)
    assert bm.cached_blocks == named, (
        f"freeing must not forget a block's prefix-cache name (a later request may reuse its K/V): blocks 0, 1 "
        f"were cached, after free the cache names blocks {sorted(bm.cached_blocks.values())}")
    for b in (0, 1):
        bm.block_pool.touch(b)
    _set_free_queue(bm.block_pool, [2, 3, 1, 0])                 # free queue 2 3 1 0
    got = [bm.block_pool.get_new_block() for _ in range(3)]
    assert got == [2, 3, 1], f"free queue [2, 3, 1, 0]: three allocations gave {got}, want [2, 3, 1]"
    left = sorted(bm.cached_blocks.values())
    assert left == [0], (f"block 1 was handed out again, so its cache name must go "
                         f"(self._evict_cached_block); the cache still names blocks {left}, want [0]")
    assert bm.block_hash[1] is None, "the reused block 1 still has a block_hash (_evict_cached_block clears it)"


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
