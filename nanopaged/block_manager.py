"""BlockManager: the physical KV-cache pool, its free list and per-block ref counts.

PagedAttention (Kwon et al., SOSP'23, §4.2-4.3) splits the KV cache into fixed-size
physical blocks and hands them to sequences one at a time, on demand, the way an OS
hands out pages. This file is the allocator; the BlockTable of each sequence
(block_table.py) records which blocks it got; the scheduler decides *when* to ask.

    pool: num_gpu_blocks blocks of block_size token slots each (per layer, K and V)
    ref_count[b]: how many block tables hold block b (0 = free)
    free_block_ids: the free blocks, oldest-freed first

Why reference counts, when today every block has one owner? Because the next features
share blocks: parallel samples and beams fork a sequence and share its prompt blocks
(copy-on-write before a write into a shared block), and prefix caching lets a new
request reuse blocks whose tokens it has in common with an old one. The free list is
kept in the order blocks were freed so that prefix caching can later evict the least
recently used cached block first (vLLM v1's FreeKVCacheBlockQueue).

"GPU" is vLLM's name for the device pool; on a CPU-only run it lives in host memory.
vLLM: `vllm/core/block_manager.py` (v0), `vllm/v1/core/block_pool.py` (v1).
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence, SequenceGroup


class BlockManager:
    """Allocates and frees physical blocks of the device KV pool.

    Args:
        num_gpu_blocks: blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_gpu_blocks
        # An OrderedDict used as a queue we can also delete from in the middle (prefix
        # caching will pull a cached block back out of it when it gets a hit).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_gpu_blocks))

    def get_num_free_gpu_blocks(self) -> int:
        """Free blocks in the device pool."""
        return len(self.free_block_ids)

    # -- questions the scheduler asks before it commits to anything ----------------------

    def num_new_blocks_needed(self, seq: Sequence) -> int:
        """Blocks `seq` must gain so that all its tokens have a KV slot."""
        return seq.block_table.num_new_blocks_for(seq.num_tokens)

    def can_allocate(self, seq_group: SequenceGroup) -> bool:
        """Can a waiting request get the blocks for all its tokens right now?"""
        return self.num_new_blocks_needed(seq_group.seqs[0]) <= self.get_num_free_gpu_blocks()

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Can every unfinished sequence of a running request get a slot for its next token?"""
        needed = sum(self.num_new_blocks_needed(s) for s in seq_group.seqs if not s.status.is_finished)
        return needed <= self.get_num_free_gpu_blocks()

    # -- the changes ------------------------------------------------------------------------

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give a request that is about to be prefilled blocks for all its tokens.

        Raises:
            RuntimeError: not enough free blocks (call can_allocate first).
        """
        for seq in seq_group.seqs:
            self.append_slots(seq)

    def append_slots(self, seq: Sequence) -> None:
        """Grow `seq`'s block table until every one of its tokens has a slot.

        On decode this adds a block only when the last one is full: the one-block
        waste bound of the paper (§4.3). Raises RuntimeError when the pool is empty.
        """
        table = seq.block_table
        needed = table.num_new_blocks_for(seq.num_tokens)
        if needed > len(self.free_block_ids):      # check first: all or nothing
            raise RuntimeError(f"sequence {seq.seq_id} needs {needed} more KV blocks, only "
                               f"{len(self.free_block_ids)} free (the scheduler should have "
                               "checked can_allocate / can_append_slots)")
        for _ in range(needed):
            table.append_block(self._allocate_block())
        table.num_tokens = seq.num_tokens

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` whose last holder it was to the free list.

        Tail blocks go in first, so when prefix caching evicts the oldest free block it
        takes a sequence's last blocks before its first ones (the prefix others share).
        """
        for block_id in reversed(seq.block_table.clear()):
            self.ref_count[block_id] -= 1
            if self.ref_count[block_id] == 0:
                self.free_block_ids[block_id] = None

    def _allocate_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        self.ref_count[block_id] = 1
        return block_id
