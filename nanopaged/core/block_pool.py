"""BlockPool: one pool of physical KV blocks: a record per block, the free queue, the prefix-hash map.

PagedAttention (Kwon et al., SOSP'23, §4.2-4.3) hands out fixed-size blocks the way an OS
hands out pages. A pool counts each block's holders (ref_count); a block nobody holds
waits in the free queue, least recently freed first. A free block keeps its prefix-cache
name (block_manager.py computes it) until it is handed out again: then the name is
evicted, so the queue's order is also the cache's LRU order.
The device ("GPU") pool and the CPU swap pool are both BlockPools; the BlockManager
(block_manager.py) is the policy on top.
vLLM: `vllm/v1/core/block_pool.py` (BlockPool), `kv_cache_utils.py` (KVCacheBlock,
FreeKVCacheBlockQueue).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, islice, repeat
from operator import attrgetter

from ..events import BlockEvicted, Observers


@dataclass(slots=True)
class KVCacheBlock:
    """One physical block's record."""

    block_id: int
    ref_count: int = 0                           # block tables holding it (0: free)
    block_hash: bytes | None = None              # its prefix-cache name, None while unnamed
    token_ids: tuple[int, ...] | None = None     # the tokens it was named for (confirms a hit)


class FreeBlockQueue:
    """Free block ids, least recently freed first.

    A swap pool of tiny blocks can hold millions, so blocks never handed out are not
    listed: they are the ids [next_fresh, num_blocks), in order, between the blocks put
    at the front (appendleft) and those put at the back (append).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks, self.next_fresh = num_blocks, 0
        self.front: OrderedDict[int, None] = OrderedDict()
        self.back: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.front) + self.num_blocks - self.next_fresh + len(self.back)

    def __iter__(self):
        return chain(self.front, range(self.next_fresh, self.num_blocks), self.back)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.front or block_id in self.back or self.next_fresh <= block_id < self.num_blocks

    def popleft(self) -> int:
        if self.front:
            return self.front.popitem(last=False)[0]
        if self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            return self.next_fresh - 1
        return self.back.popitem(last=False)[0]

    def append(self, block_id: int) -> None:
        self.back[block_id] = None

    def appendleft(self, block_id: int) -> None:
        self.front[block_id] = None
        self.front.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        """Take a free block out of the middle (a prefix-cache hit). KeyError if not free."""
        if block_id >= self.next_fresh:
            # list the fresh ids up to it at the end of the front: the order stays the same
            self.front.update(dict.fromkeys(range(self.next_fresh, block_id + 1)))
            self.next_fresh = block_id + 1
        del (self.front if block_id in self.front else self.back)[block_id]


class BlockPool:
    """num_blocks physical blocks: who holds each, which are free, which are named.

    Args:
        num_blocks: blocks in the pool (>= 0).
        observers: where BlockEvicted is published (events.py).
    """

    def __init__(self, num_blocks: int, observers: Observers | None = None) -> None:
        self.num_blocks = num_blocks
        self.observers = Observers() if observers is None else observers
        self.blocks: list[KVCacheBlock] = []       # records of blocks 0 .. len - 1, made on first use
        self.free_block_queue = FreeBlockQueue(num_blocks)
        self.cached_block_hash_to_block: dict[bytes, int] = {}

    def block(self, block_id: int) -> KVCacheBlock:
        """block_id's record (made on first use: a fresh block is free and unnamed).
        Raises IndexError for an id outside [0, num_blocks)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id {block_id} is not in a pool of {self.num_blocks} blocks")
        while len(self.blocks) <= block_id:
            self.blocks.append(KVCacheBlock(len(self.blocks)))
        return self.blocks[block_id]

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count if block_id < len(self.blocks) else 0

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_new_block(self) -> int:
        """The least recently freed block, for one holder (ref_count 1); a name it
        still had is evicted. Raises ValueError when no block is free (callers check first)."""
        try:
            block_id = self.free_block_queue.popleft()
        except KeyError:                                  # the queue is empty
            raise ValueError(f"no free block in a pool of {self.num_blocks}") from None
        block = self.blocks[block_id] if block_id < len(self.blocks) else self.block(block_id)
        if block.block_hash is not None:
            self._evict_cached_block(block)
        block.ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """One more holder; a free block (a cache hit) leaves the free queue."""
        block = self.block(block_id)
        if block.ref_count == 0:
            self.free_block_queue.remove(block_id)
        block.ref_count += 1

    def free_block(self, block_id: int, front: bool = False) -> int:
        """One holder fewer; at 0 the block joins the free queue, at the back (it keeps
        its name, evicted last) or at the front (reused first). Returns the new ref_count."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if front:
                self.free_block_queue.appendleft(block_id)
            else:
                self.free_block_queue.append(block_id)
        return block.ref_count

    # -- the prefix-hash map ------------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block named block_hash, if its stored tokens are token_ids, else None."""
        block_id = self.cached_block_hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> bool:
        """Name a full block; False (nothing changes) if it is named already or the name
        is taken (the same content computed twice: the first copy keeps it)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
            return False
        self.cached_block_hash_to_block[block_hash] = block_id
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        return True

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = block.token_ids = None
        if self.observers:
            self.observers.publish(BlockEvicted(block.block_id))

    def field(self, name: str) -> BlockField:
        """A read-only list view of one field of every block: pool.field("ref_count")[b]."""
        return BlockField(self, name)


class BlockField(Sequence):
    """A read-only list of one field of every block's record (ref_count 0 and None
    for blocks not used yet); compares equal to a list of the same values."""

    def __init__(self, pool: BlockPool, name: str) -> None:
        self.pool, self.name = pool, name
        self.default = getattr(KVCacheBlock(0), name)

    def __len__(self) -> int:
        return self.pool.num_blocks

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:                    # the common case, at C speed (the dashboard's snapshots)
                return list(islice(self, start, stop))
            return [self[j] for j in range(start, stop, step)]
        if not -len(self) <= i < len(self):
            raise IndexError(f"block {i} of a pool of {len(self)}")
        i %= len(self)
        return getattr(self.pool.blocks[i], self.name) if i < len(self.pool.blocks) else self.default

    def __iter__(self):
        blocks = self.pool.blocks
        return chain(map(attrgetter(self.name), blocks), repeat(self.default, len(self) - len(blocks)))

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, BlockField)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))
