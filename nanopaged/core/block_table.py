"""BlockTable: one sequence's map from logical KV blocks to physical ones.

This is the page table of PagedAttention (Kwon et al., SOSP'23, §4.2, Fig. 6). A
sequence's tokens are cut into logical blocks of `block_size` tokens: token at position
`p` lives in logical block `p // block_size`, at offset `p % block_size`. The table says
which physical block of the KV pool holds each logical block, so the blocks of one
sequence can be scattered anywhere in memory and grow one block at a time:

    logical block   0    1    2            physical pool
    block_ids     [ 7,   1,   3 ]          block 7: tokens 0..15
    37 tokens computed -> last block holds 37 - 2*16 = 5 tokens (the "fill count")

The KV pool is one flat array of slots, so the slot of position `p` is
`block_ids[p // block_size] * block_size + p % block_size` (vLLM's `slot_mapping`).

The table only records; it never allocates. The BlockManager (block_manager.py) owns
the pool and decides which physical blocks to hand out. The table stores nothing that
is known elsewhere: how many of its slots are written is the sequence's
`num_computed_tokens` (len(block_ids) == ceil(num_computed_tokens / block_size)), and
whether its ids are CPU swap-pool blocks is the sequence's status (SWAPPED). vLLM: `vllm/core/block/
block_table.py` (v0) and `vllm/v1/core/kv_cache_manager.py` (v1, `req_to_blocks`).
"""
from __future__ import annotations


class BlockTable:
    """Logical -> physical block ids of one sequence.

    Attributes:
        block_size: tokens per block.
        block_ids: physical block id of each logical block, in order (device blocks,
            or CPU swap-pool blocks while the sequence is SWAPPED).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_ids: list[int] = []

    def __len__(self) -> int:
        """Number of blocks held."""
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable(block_ids={self.block_ids})"

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks_for(self, num_tokens: int) -> int:
        """Extra blocks this table must gain before it can hold `num_tokens` tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(self.block_ids))

    def append_block(self, block_id: int) -> None:
        """Give the table one more physical block (at the next logical index)."""
        self.block_ids.append(block_id)

    def slot(self, position: int) -> int:
        """Flat KV-pool slot of the token at `position` (needs a block already)."""
        block_index, offset = divmod(position, self.block_size)
        return self.block_ids[block_index] * self.block_size + offset

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions start..end-1, in order (the slot_mapping of a chunk)."""
        bs, ids = self.block_size, self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]

    def clear(self) -> list[int]:
        """Forget every block; returns the ids that were held (the caller frees them)."""
        ids, self.block_ids = self.block_ids, []
        return ids
