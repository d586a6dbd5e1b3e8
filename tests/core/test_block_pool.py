"""BlockPool (nanopaged/core/block_pool.py), the pool both KV pools are made of, with no model.

Its free queue does not list the blocks never handed out (a swap pool can hold
millions): they are a range of ids. Whatever happens, the queue must hand blocks out
in exactly the order of the plain queue it stands for, an OrderedDict of every free
id that starts 0, 1, 2, ...: the block ids of every run depend on it.
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

from nanopaged.core.block_pool import BlockPool
from nanopaged.events import BlockEvicted, Observers


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.sampled_from(["new", "free", "free_front", "touch"]),
                                              st.integers(0, 11)), max_size=60))
def test_the_free_queue_keeps_the_order_of_a_plain_queue(num_blocks, ops):
    pool = BlockPool(num_blocks)
    queue = OrderedDict.fromkeys(range(num_blocks))              # the plain queue
    refs = [0] * num_blocks
    for op, b in ops:
        b %= num_blocks
        if op == "new" and queue:
            want = queue.popitem(last=False)[0]
            assert pool.get_new_block() == want
            refs[want] = 1
        elif op in ("free", "free_front") and refs[b]:
            refs[b] -= 1
            assert pool.free_block(b, front=op == "free_front") == refs[b]
            if refs[b] == 0:
                queue[b] = None
                if op == "free_front":
                    queue.move_to_end(b, last=False)
        elif op == "touch":
            if refs[b] == 0:
                del queue[b]
            refs[b] += 1
            pool.touch(b)
        assert list(pool.free_block_queue) == list(queue)
        assert pool.get_num_free_blocks() == len(queue)
        assert all((i in pool.free_block_queue) == (i in queue) for i in range(num_blocks))
        assert pool.field("ref_count") == refs


def test_a_million_block_pool_is_cheap_until_used():
    pool = BlockPool(10**7)
    assert pool.get_num_free_blocks() == 10**7 and pool.blocks == []
    assert [pool.get_new_block() for _ in range(3)] == [0, 1, 2] and len(pool.blocks) == 3
    assert pool.field("ref_count")[:4] == [1, 1, 1, 0] and pool.field("ref_count")[-1] == 0


def test_a_name_lasts_until_the_block_is_handed_out_again():
    seen = Observers()
    events = []
    seen.append(events.append)
    pool = BlockPool(2, observers=seen)
    b = pool.get_new_block()
    assert pool.cache_block(b, b"h0", [1, 2])
    assert not pool.cache_block(b, b"h1", [3, 4])                 # named already
    other = pool.get_new_block()
    assert not pool.cache_block(other, b"h0", [1, 2])             # the name is taken: the first keeps it
    assert pool.get_cached_block(b"h0", [1, 2]) == b
    assert pool.get_cached_block(b"h0", [9, 9]) is None           # same name, other tokens: no hit
    pool.free_block(b)
    assert pool.get_cached_block(b"h0", [1, 2]) == b and not events
    pool.touch(b)                                                 # a hit takes it back, name and all
    pool.free_block(b)
    assert pool.get_new_block() == b and events == [BlockEvicted(b)]
    assert pool.get_cached_block(b"h0", [1, 2]) is None and pool.blocks[b].token_ids is None
    with pytest.raises(ValueError, match="no free block in a pool of 2"):
        pool.get_new_block()


def test_a_block_id_outside_the_pool_is_refused():
    pool = BlockPool(4)
    with pytest.raises(IndexError, match="block_id 4 is not in a pool of 4 blocks"):
        pool.touch(4)
    assert pool.get_num_free_blocks() == 4 and list(pool.free_block_queue) == [0, 1, 2, 3]
