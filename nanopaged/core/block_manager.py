"""BlockManager: the KV-cache policy: who gets which blocks, shares them, copies them, swaps them.

PagedAttention (Kwon et al., SOSP'23, §4.2-4.5) gives each sequence blocks on demand: its
BlockTable (block_table.py) records them, the scheduler decides when to ask, and two
BlockPools (block_pool.py) hold them, the device ("GPU") pool and the CPU swap pool.
- n > 1 and beams *fork*: the child shares the parent's blocks, and a write into a shared
  block first copies it (copy-on-write, §4.4): `append_slots` returns the (src, dst) pairs.
- automatic prefix caching (vLLM v1): a full block is named by sha256(parent's name,
  its tokens); a new request reuses the blocks of its longest named prefix.
- preemption by swap (§4.5): a request's blocks move to the CPU pool and back.
Every change to a device block is published as an event (events.py) when someone listens.
vLLM: `vllm/v1/core/kv_cache_manager.py`, `kv_cache_utils.py`; `vllm/core/block_manager.py` (v0, swap).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from dataclasses import dataclass

from ..events import (BlockAllocated, BlockCached, BlockFreed, BlocksShared, CopyOnWrite, Observers,
                      PrefixCacheHit, SwapIn, SwapOut)
from .block_pool import BlockPool
from .sequence import Sequence, SequenceGroup, SequenceStatus


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """sha256(parent hash || token ids as int64): the prefix-cache name of a full block."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class ComputedBlocks:
    """What a waiting request already has in the pool (get_computed_blocks' answer)."""

    block_ids: list[int]            # cached blocks of its first sequence's longest cached prefix
    num_computed_tokens: int        # the tokens they hold
    num_shared_tokens: int          # its prompt's full blocks' tokens, shared by its other sequences
    never_fits: bool = False        # needs more blocks than the whole pool, alone and with no hits


class BlockManager:
    """Allocates, shares, copies, swaps and frees the blocks of the two pools.

    Args:
        num_gpu_blocks: blocks in the device pool (>= 1).
        block_size: token slots per block (>= 1).
        enable_prefix_caching: reuse full blocks across requests by content hash.
        num_cpu_blocks: blocks in the CPU swap pool (0: no swapping).
        observers: where to publish block events (events.py); the engine passes its own.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, observers: Observers | None = None) -> None:
        self.observers = Observers() if observers is None else observers
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_gpu_blocks, self.observers)
        self.cpu_block_pool = BlockPool(num_cpu_blocks)      # no names: swapped blocks are never looked up
        self.prefix_cache_queries = 0      # tokens looked up
        self.prefix_cache_hits = 0         # tokens found
        self.num_copy_on_write = 0         # blocks copied because they were shared

    # read-only views of the pools, for the tracer, the dashboard, tests and chapters
    ref_count = property(lambda self: self.block_pool.field("ref_count"))
    block_hash = property(lambda self: self.block_pool.field("block_hash"))
    block_token_ids = property(lambda self: self.block_pool.field("token_ids"))
    cached_blocks = property(lambda self: self.block_pool.cached_block_hash_to_block)   # hash -> block id
    free_block_ids = property(lambda self: self.block_pool.free_block_queue)
    cpu_ref_count = property(lambda self: self.cpu_block_pool.field("ref_count"))
    free_cpu_block_ids = property(lambda self: self.cpu_block_pool.free_block_queue)

    def get_num_free_gpu_blocks(self) -> int:        # cached-but-unused blocks count as free
        return self.block_pool.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_block_pool.get_num_free_blocks()

    # -- prefix cache ------------------------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence) -> list[bytes]:
        """seq.block_hashes (kept across preemption), extended with the names of its full
        blocks: block i, positions [i * block_size, (i + 1) * block_size), is named
        hash_block_tokens(name of block i - 1, its tokens), block 0's parent being
        seq.cache_salt (None by default); a partial block has none."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < seq.num_tokens // bs:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else seq.cache_salt,
                                            seq.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes

    def _cached_prefix(self, seq_group: SequenceGroup, seq: Sequence) -> list[int]:
        """Cached blocks of seq's longest cached prefix, at most num_tokens - 1 tokens (the last
        is computed, for its logits); none for prompt logprobs (a hit has no logits), as vLLM v1."""
        if not self.enable_prefix_caching or seq_group.sampling_params.prompt_logprobs is not None:
            return []
        bs, blocks = self.block_size, []
        for i, h in enumerate(self._full_block_hashes(seq)[:(seq.num_tokens - 1) // bs]):
            block_id = self.block_pool.get_cached_block(h, seq.token_ids_slice(i * bs, (i + 1) * bs))
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def get_computed_blocks(self, seq_group: SequenceGroup) -> ComputedBlocks:
        """What a waiting request already has in the pool, and whether the whole pool
        could ever hold it; changes nothing (vLLM v1's KVCacheManager.get_computed_blocks)."""
        first, *rest = seq_group.seqs_to_compute()
        hits = self._cached_prefix(seq_group, first)
        shared = len(first.prompt_token_ids) // self.block_size
        need = first.block_table.num_blocks_for(first.num_tokens)
        need += sum(s.block_table.num_blocks_for(s.num_tokens) - shared for s in rest)
        return ComputedBlocks(hits, len(hits) * self.block_size, shared * self.block_size,
                              need > self.num_gpu_blocks)

    def cache_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Name the blocks filled by computing seq's positions [start, end); only after the forward
        that wrote their K/V, or a failed forward leaves a named block of garbage
        (tests/engine/test_engine_v1.py::test_c39_an_interrupted_forward_leaves_no_named_block)."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        hashes = self._full_block_hashes(seq)
        for i in range(start // bs, min(len(hashes), end // bs)):
            block_id, tokens = table.block_ids[i], seq.token_ids_slice(i * bs, (i + 1) * bs)
            if self.block_pool.cache_block(block_id, hashes[i], tokens) and self.observers:
                self.observers.publish(BlockCached(block_id, seq.seq_id, tuple(tokens)))

    # -- questions the scheduler asks before it commits to anything ----------------------

    def _blocks_to_take(self, seq_group: SequenceGroup, computed: ComputedBlocks, first_end: int) -> int:
        """Blocks allocate would take from the free queue: fresh ones plus free cached hits."""
        first, *rest = seq_group.seqs_to_compute()
        hits = computed.block_ids
        take = first.block_table.num_blocks_for(first_end) - len(hits)
        take += sum(1 for b in set(hits) if self.block_pool.ref_count(b) == 0)
        shared = computed.num_shared_tokens // self.block_size
        return take + sum(s.block_table.num_blocks_for(s.num_tokens) - shared for s in rest)

    def _writes_shared_block(self, seq: Sequence) -> bool:
        """seq's next write (at num_computed_tokens) lands in a partly filled block another table holds."""
        return (bool(seq.num_computed_tokens % self.block_size)
                and self.block_pool.ref_count(seq.block_table.block_ids[-1]) > 1)

    def _blocks_to_append(self, seqs: list[Sequence], ends: list[int]) -> int:
        """New blocks the seqs need for slots up to ends[i], copy-on-write included."""
        need, sharers = 0, Counter()
        for seq, end in zip(seqs, ends):
            need += seq.block_table.num_new_blocks_for(end)
            if self._writes_shared_block(seq):
                sharers[seq.block_table.block_ids[-1]] += 1
        for block_id, k in sharers.items():
            # the last holder of a shared block may write it in place
            need += k if self.block_pool.ref_count(block_id) > k else k - 1
        return need

    # -- the changes ------------------------------------------------------------------------

    def allocate(self, seq_group: SequenceGroup, computed: ComputedBlocks,
                 first_end: int | None = None) -> list[int] | None:
        """Give a waiting request its blocks, reusing `computed` (get_computed_blocks, same step).

        The first sequence gets slots for positions < first_end (default: all its tokens); a
        fresh n > 1 request's others fork it after its prefill, recomputed ones share its full
        prompt blocks. Returns each sequence's num_computed_tokens (seqs_to_compute order) for
        the scheduler to set, or None, changing nothing, when the blocks do not fit."""
        first, *rest = seq_group.seqs_to_compute()
        first_end = first.num_tokens if first_end is None else first_end
        if self._blocks_to_take(seq_group, computed, first_end) > self.get_num_free_gpu_blocks():
            return None
        hits = computed.block_ids
        if self.enable_prefix_caching:
            self.prefix_cache_queries += first.num_tokens
            self.prefix_cache_hits += computed.num_computed_tokens
        for block_id in hits:
            self.block_pool.touch(block_id)
            first.block_table.append_block(block_id)
        if hits and self.observers:
            self.observers.publish(PrefixCacheHit(seq_group.request_id, first.seq_id, tuple(hits),
                                                  computed.num_computed_tokens))
        self._append_blocks(first, first_end)
        shared = first.block_table.block_ids[:computed.num_shared_tokens // self.block_size]
        for seq in rest:
            for block_id in shared:
                self.block_pool.touch(block_id)
                seq.block_table.append_block(block_id)
            if self.observers:
                self.observers.publish(BlocksShared(seq.seq_id, first.seq_id, tuple(shared)))
            self._append_blocks(seq, seq.num_tokens)
        return [computed.num_computed_tokens] + [computed.num_shared_tokens] * len(rest)

    def append_slots(self, seqs: list[Sequence], ends: list[int] | None = None) -> list[tuple[int, int]] | None:
        """Give one request's running seqs slots for positions < ends[i] (default: all their
        tokens), all or none. A write into a partly filled block another table holds first
        copies it (its last holder writes in place); a new block comes only when the last is
        full (§4.3). Returns the copy-on-write (src, dst) pairs, or None, changing nothing,
        when the blocks do not fit (vLLM v1's allocate_slots; the scheduler then preempts)."""
        ends = [s.num_tokens for s in seqs] if ends is None else ends
        if self._blocks_to_append(seqs, ends) > self.get_num_free_gpu_blocks():
            return None
        copies = []
        for seq, end in zip(seqs, ends):
            table = seq.block_table
            if self._writes_shared_block(seq):
                src, dst = table.block_ids[-1], self.block_pool.get_new_block()
                self.block_pool.free_block(src)          # still held by another: stays out of the queue
                table.block_ids[-1] = dst
                copies.append((src, dst))
                self.num_copy_on_write += 1
                if self.observers:
                    self.observers.publish(CopyOnWrite(seq.seq_id, len(table) - 1, src, dst))
            self._append_blocks(seq, end)
        return copies

    def _append_blocks(self, seq: Sequence, end: int) -> None:
        """Fresh blocks until seq's table holds positions < end (the caller counted them)."""
        table = seq.block_table
        for _ in range(table.num_new_blocks_for(end)):
            table.append_block(self.block_pool.get_new_block())
            if self.observers:
                self.observers.publish(BlockAllocated(seq.seq_id, table.block_ids[-1], len(table) - 1))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make child share all of parent's blocks (a new sample, a surviving beam), freeing
        what it held; its table and block_hashes become copies of the parent's."""
        self.free(child)
        for block_id in parent.block_table.block_ids:
            self.block_pool.touch(block_id)
        child.block_table.block_ids = list(parent.block_table.block_ids)
        child.block_hashes = list(parent.block_hashes)
        if self.observers:
            self.observers.publish(BlocksShared(child.seq_id, parent.seq_id, tuple(parent.block_table.block_ids)))

    # -- swapping (preemption by swap, §4.5) -------------------------------------------------

    @staticmethod
    def _num_distinct_blocks(seq_group: SequenceGroup, status: SequenceStatus) -> int:
        return len({b for s in seq_group.get_seqs(status) for b in s.block_table.block_ids})

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        return self._num_distinct_blocks(seq_group, SequenceStatus.RUNNING) <= self.get_num_free_cpu_blocks()

    def can_swap_in(self, seq_group: SequenceGroup, headroom: int) -> bool:
        """Room for the request's blocks plus `headroom` more (one per sequence keeps it
        from being preempted again at once; 0 when the pool has nobody else)."""
        return (self._num_distinct_blocks(seq_group, SequenceStatus.SWAPPED) + headroom
                <= self.get_num_free_gpu_blocks())

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move a RUNNING request's blocks to the CPU pool; returns the (gpu, cpu) pairs to copy.
        The scheduler then marks its sequences SWAPPED (their ids are now CPU blocks)."""
        return self._move(seq_group, SequenceStatus.RUNNING, self.cpu_block_pool, SwapOut)

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move a SWAPPED request's blocks back to the device pool; returns the (cpu, gpu)
        pairs to copy. The scheduler then marks its sequences RUNNING."""
        return self._move(seq_group, SequenceStatus.SWAPPED, self.block_pool, SwapIn)

    def _move(self, seq_group: SequenceGroup, status: SequenceStatus, dst: BlockPool,
              event: type[SwapIn | SwapOut]) -> list[tuple[int, int]]:
        """New blocks in dst for seq_group's `status` sequences (a shared block stays shared),
        the old ones freed; returns the (old, new) pairs."""
        seqs, mapping = seq_group.get_seqs(status), {}
        for seq in seqs:
            old = list(seq.block_table.block_ids)
            self.free(seq)                    # from the pool its status says it is in
            for b in old:
                if b in mapping:
                    dst.touch(mapping[b])
                else:
                    mapping[b] = dst.get_new_block()
            seq.block_table.block_ids = [mapping[b] for b in old]
        if self.observers:
            self.observers.publish(event(seq_group.request_id, tuple(mapping.items()),
                                         {s.seq_id: tuple(s.block_table.block_ids) for s in seqs}))
        return list(mapping.items())

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks, tail first, so the cache evicts a sequence's last
        blocks before the prefix others share. A swapped-out sequence (seq.is_swapped)
        holds CPU blocks: free a sequence before its status changes."""
        pool = self.cpu_block_pool if seq.is_swapped else self.block_pool
        for block_id in reversed(seq.block_table.clear()):
            ref_count = pool.free_block(block_id)
            if self.observers and pool is self.block_pool:     # events follow the device pool
                self.observers.publish(BlockFreed(seq.seq_id, block_id, ref_count))
