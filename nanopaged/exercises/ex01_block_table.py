"""Exercise 1 (chapter 01): the block table's arithmetic."""
from __future__ import annotations

NUMBER = 1
CHAPTER = "01-block-table.md"
TITLE = "BlockTable: blocks needed, blocks to add, slots"
TARGETS = ["nanopaged.core.block_table:BlockTable.num_blocks_for",
           "nanopaged.core.block_table:BlockTable.num_new_blocks_for",
           "nanopaged.core.block_table:BlockTable.slots"]
TASK = """
Write the three pieces of arithmetic a block table does (PagedAttention §4.2, Fig. 6):
how many blocks n tokens need, how many more blocks this table must gain to hold n
tokens, and the KV-pool slot of each position of a chunk (the slot_mapping). The block
manager calls the first two whenever it allocates, so the whole engine runs on them.
"""
HINT = """
Position p lives in logical block p // block_size at offset p % block_size, and the
table maps logical block i to physical block block_ids[i]. n tokens need the ceiling of
n / block_size blocks (in integer arithmetic: -(-n // block_size)). A table that already
holds len(block_ids) blocks needs only the difference, and never a negative number.
"""


def _table(block_size, block_ids):
    from nanopaged.core.block_table import BlockTable

    t = BlockTable(block_size)
    t.block_ids = list(block_ids)
    return t


def check_num_blocks_for():
    """num_blocks_for(n) is ceil(n / block_size), for n = 0..40 and block sizes 1, 2, 4, 16"""
    from nanopaged.utils.math_utils import cdiv

    for bs in (1, 2, 4, 16):
        for n in range(41):
            got = _table(bs, []).num_blocks_for(n)
            assert got == cdiv(n, bs), f"block_size {bs}, {n} tokens: you said {got} blocks, it is {cdiv(n, bs)}"


def check_num_new_blocks_for():
    """num_new_blocks_for(n) is how many blocks the table lacks for n tokens (never < 0)"""
    t = _table(4, [7, 1])                       # 2 blocks: room for 8 tokens
    for n, want in ((0, 0), (6, 0), (8, 0), (9, 1), (12, 1), (13, 2), (17, 3)):
        got = t.num_new_blocks_for(n)
        assert got == want, f"a table of 2 blocks of 4, asked for {n} tokens: you said {got}, it is {want}"


def check_slots():
    """slots(start, end) gives block_ids[p // block_size] * block_size + p % block_size for each p"""
    t = _table(4, [7, 1, 3])
    for start, end in ((0, 11), (3, 6), (8, 9), (5, 5)):
        want = [[7, 1, 3][p // 4] * 4 + p % 4 for p in range(start, end)]
        got = t.slots(start, end)
        assert got == want, f"block_ids [7, 1, 3], positions {start}..{end - 1}: you said {got}, it is {want}"


def check_engine_runs_on_it():
    """the engine, allocating with your functions, serves a batch that grows past block boundaries: same tokens, no block lost"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 14)]
    same_as_engines_own([[1, 2, 3, 4, 5], list(range(20, 33)), [7, 8]], params)


CHECKS = [check_num_blocks_for, check_num_new_blocks_for, check_slots, check_engine_runs_on_it]
