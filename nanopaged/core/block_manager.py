"""BlockManager: the physical KV-cache pool, its free list, ref counts and prefix cache.

PagedAttention (Kwon et al., SOSP'23, §4.2-4.4) splits the KV cache into fixed-size
physical blocks and hands them to sequences one at a time, on demand, the way an OS
hands out pages. This file is the allocator; the BlockTable of each sequence
(block_table.py) records which blocks it got; the scheduler decides *when* to ask.

    pool: num_gpu_blocks blocks of block_size token slots each (per layer, K and V)
    ref_count[b]: how many block tables hold block b (0 = free)
    free_block_ids: the free blocks, least recently freed first

Blocks are shared, which is why they are reference counted:

- Parallel sampling (n > 1) and beam search *fork* a sequence: the child's table points
  at the parent's blocks (`fork`). Before a sequence writes into a block someone else
  also holds, it gets a private copy (copy-on-write, paper §4.4): `append_slots`
  returns the (src, dst) pairs and the model runner copies them before the forward pass.
  The write position is seq.num_computed_tokens, which only the scheduler writes.
- Automatic prefix caching (vLLM v1's KVCacheManager): every *full* block is named by a
  hash of its tokens chained with its parent block's hash, so equal hashes mean equal
  prefixes. A new request whose first blocks hash the same reuses those blocks instead
  of recomputing them. We use sha256 (collision-safe: a false hit would silently corrupt
  an answer) and also keep each cached block's token ids to confirm a hit.
  A block whose ref_count drops to 0 keeps its hash and stays in the free queue; it is
  evicted only when a fresh block is needed and it is the least recently freed.

Every change to a block is published as an event (events.py) when someone listens.
"GPU" is vLLM's name for the device pool; on a CPU-only run it lives in host memory.
vLLM: `vllm/core/block_manager.py` (v0), `vllm/v1/core/block_pool.py`,
`vllm/v1/core/kv_cache_manager.py` and `kv_cache_utils.py` (v1).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass

from ..events import (BlockAllocated, BlockCached, BlockEvicted, BlockFreed, BlocksShared, CopyOnWrite,
                     Observers, PrefixCacheHit, SwapIn, SwapOut)
from .sequence import Sequence, SequenceGroup, SequenceStatus


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """sha256(parent hash || token ids as int64): the prefix-cache name of a full block."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class ComputedBlocks:
    """What a waiting request already has in the pool (get_computed_blocks' answer).

    Attributes:
        block_ids: cached blocks holding its first sequence's longest cached prefix.
        num_computed_tokens: the tokens they hold (len(block_ids) * block_size).
        num_shared_tokens: the tokens in its prompt's full blocks, which its other
            sequences (only after a recompute preemption of n > 1) share with the first.
        never_fits: it needs more blocks than the whole pool, even with the pool to
            itself and no cache hits, so waiting for others to finish cannot help.
    """

    block_ids: list[int]
    num_computed_tokens: int
    num_shared_tokens: int
    never_fits: bool = False


class BlockManager:
    """Allocates, shares and frees physical blocks of the device KV pool.

    Args:
        num_gpu_blocks: blocks in the pool (>= 1).
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
        self.ref_count = [0] * num_gpu_blocks
        # An OrderedDict is a queue we can also delete from in the middle: a prefix-cache
        # hit pulls a free cached block back out of it.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_gpu_blocks))
        self.cached_blocks: dict[bytes, int] = {}                   # block hash -> block id
        self.block_hash: list[bytes | None] = [None] * num_gpu_blocks
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_gpu_blocks
        self.prefix_cache_queries = 0      # tokens looked up
        self.prefix_cache_hits = 0         # tokens found
        self.num_copy_on_write = 0         # blocks copied because they were shared
        # the CPU swap pool (paper §4.5): plain ref counts and a free list, no caching
        self.cpu_ref_count = [0] * num_cpu_blocks
        self.free_cpu_block_ids: list[int] = list(range(num_cpu_blocks - 1, -1, -1))

    def get_num_free_gpu_blocks(self) -> int:
        """Free blocks in the device pool (cached-but-unused blocks count as free)."""
        return len(self.free_block_ids)

    # -- prefix cache ------------------------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of seq's full blocks, extended incrementally and kept across preemption.

        Returns seq.block_hashes itself, after appending the names of the full blocks that
        have none yet: block i holds positions i * block_size .. (i + 1) * block_size - 1
        and is named hash_block_tokens(name of block i - 1 (None for block 0), its tokens).
        A partly filled last block gets no name (its content still changes)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < seq.num_tokens // bs:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            seq.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes

    def _cached_prefix(self, seq_group: SequenceGroup, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's longest cached prefix. At most num_tokens - 1 tokens
        can hit: the last token is always computed, to have logits to sample from. A
        request that wants prompt logprobs reads no cache (as vLLM v1): a cached token
        would have no logits to take them from."""
        if not self.enable_prefix_caching or seq_group.sampling_params.prompt_logprobs is not None:
            return []
        bs, blocks = self.block_size, []
        hashes = self._full_block_hashes(seq)
        for i, h in enumerate(hashes[:(seq.num_tokens - 1) // bs]):
            block_id = self.cached_blocks.get(h)
            if block_id is None or self.block_token_ids[block_id] != tuple(seq.token_ids_slice(i * bs, (i + 1) * bs)):
                break
            blocks.append(block_id)
        return blocks

    def get_computed_blocks(self, seq_group: SequenceGroup) -> ComputedBlocks:
        """What a waiting request already has in the pool (no side effects): its first
        sequence's longest cached prefix, the full prompt blocks its other sequences
        will share with the first (they exist only after a recompute preemption; see
        allocate), and whether the whole pool could ever hold it. The scheduler's one
        question before allocate (vLLM v1's KVCacheManager.get_computed_blocks)."""
        first, *rest = seq_group.seqs_to_compute()
        hits = self._cached_prefix(seq_group, first)
        shared = len(first.prompt_token_ids) // self.block_size
        need = first.block_table.num_blocks_for(first.num_tokens)
        need += sum(s.block_table.num_blocks_for(s.num_tokens) - shared for s in rest)
        return ComputedBlocks(hits, len(hits) * self.block_size, shared * self.block_size,
                              need > self.num_gpu_blocks)

    def cache_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Name the blocks that became full when seq's positions [start, end) were
        computed, in the prefix cache. Called by the scheduler *after* the forward that
        wrote their K/V (update_from_output), never before: a forward that fails (an
        exception, Ctrl-C) must not leave a named block whose K/V were never written,
        or a later request would reuse garbage (field case C39)."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        hashes = self._full_block_hashes(seq)
        for i in range(start // bs, min(len(hashes), end // bs)):
            h, block_id = hashes[i], table.block_ids[i]
            if self.block_hash[block_id] is not None:
                continue                      # already named (a hit, or cached earlier)
            if h in self.cached_blocks:
                continue                      # same content computed twice: keep the first
            self.cached_blocks[h] = block_id
            self.block_hash[block_id] = h
            self.block_token_ids[block_id] = tuple(seq.token_ids_slice(i * bs, (i + 1) * bs))
            if self.observers:
                self.observers.publish(BlockCached(block_id, seq.seq_id, self.block_token_ids[block_id]))

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            del self.cached_blocks[h]
            self.block_hash[block_id] = self.block_token_ids[block_id] = None
            if self.observers:
                self.observers.publish(BlockEvicted(block_id))

    # -- questions the scheduler asks before it commits to anything ----------------------

    def _blocks_to_take(self, seq_group: SequenceGroup, computed: ComputedBlocks, first_end: int) -> int:
        """Blocks a waiting request would take from the free queue: fresh blocks plus
        cached hits that are currently free. Sequences recomputed together share the
        full blocks of their common prompt (see allocate)."""
        first, *rest = seq_group.seqs_to_compute()
        hits = computed.block_ids
        take = first.block_table.num_blocks_for(first_end) - len(hits)
        take += sum(1 for b in set(hits) if self.ref_count[b] == 0)
        shared = computed.num_shared_tokens // self.block_size
        return take + sum(s.block_table.num_blocks_for(s.num_tokens) - shared for s in rest)

    def _writes_shared_block(self, seq: Sequence) -> bool:
        """seq's next write (position num_computed_tokens) lands in a partly filled last
        block that another table also holds: it must copy that block first."""
        return bool(seq.num_computed_tokens % self.block_size) and self.ref_count[seq.block_table.block_ids[-1]] > 1

    def _blocks_to_append(self, seqs: list[Sequence], ends: list[int]) -> int:
        """New blocks the seqs need for slots up to ends[i], copy-on-write included."""
        need, sharers = 0, Counter()
        for seq, end in zip(seqs, ends):
            need += seq.block_table.num_new_blocks_for(end)
            if self._writes_shared_block(seq):
                sharers[seq.block_table.block_ids[-1]] += 1
        for block_id, k in sharers.items():
            # the last holder of a shared block may write it in place
            need += k if self.ref_count[block_id] > k else k - 1
        return need

    # -- the changes ------------------------------------------------------------------------

    def allocate(self, seq_group: SequenceGroup, computed: ComputedBlocks,
                 first_end: int | None = None) -> list[int] | None:
        """Give a waiting request its blocks, reusing its cached prefix blocks (`computed`,
        from get_computed_blocks in the same schedule()), or say no.

        The first sequence gets slots for positions < first_end (its first chunk; default
        all its tokens). A fresh request with n > 1 is computed once, by the first
        sequence; the others fork it when its prefill is done
        (Scheduler.update_from_output). Sequences recomputed after a preemption share the
        first one's full prompt blocks (computed by it in this same step: each layer
        writes K/V before it reads them) and compute only their own tokens.
        Returns each sequence's num_computed_tokens (seqs_to_compute order: the first's
        cache hit, the others' shared prompt tokens), which the scheduler, their one
        writer, sets; or None, changing nothing, when the free blocks do not suffice
        (vLLM v1's allocate_slots says no the same way).
        """
        first, *rest = seq_group.seqs_to_compute()
        first_end = first.num_tokens if first_end is None else first_end
        if self._blocks_to_take(seq_group, computed, first_end) > self.get_num_free_gpu_blocks():
            return None
        hits = computed.block_ids
        if self.enable_prefix_caching:
            self.prefix_cache_queries += first.num_tokens
            self.prefix_cache_hits += computed.num_computed_tokens
        for block_id in hits:
            if self.ref_count[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_count[block_id] += 1
            first.block_table.append_block(block_id)
        if hits and self.observers:
            self.observers.publish(PrefixCacheHit(seq_group.request_id, first.seq_id, tuple(hits),
                                                  computed.num_computed_tokens))
        self._append_blocks(first, first_end)
        shared = first.block_table.block_ids[:computed.num_shared_tokens // self.block_size]
        for seq in rest:
            for block_id in shared:
                self.ref_count[block_id] += 1
                seq.block_table.append_block(block_id)
            if self.observers:
                self.observers.publish(BlocksShared(seq.seq_id, first.seq_id, tuple(shared)))
            self._append_blocks(seq, seq.num_tokens)
        return [computed.num_computed_tokens] + [computed.num_shared_tokens] * len(rest)

    def append_slots(self, seqs: list[Sequence], ends: list[int] | None = None) -> list[tuple[int, int]] | None:
        """Give one request's running seqs slots for positions < ends[i] (what each
        computes this step; default all its tokens), all of them or none.

        Each writes next at seq.num_computed_tokens. If that lands in a partly filled
        block that another table also holds, the block is first copied to a fresh one
        (the table points at the copy, the shared block loses a holder, num_copy_on_write
        counts it; its last holder writes in place). Otherwise a block is added only when
        the last one is full: the paper's one-block waste bound (§4.3). Returns the
        copy-on-write (src, dst) pairs, or None, changing nothing, when the free blocks
        do not suffice (as vLLM v1's KVCacheManager.allocate_slots; the scheduler then
        preempts)."""
        ends = [s.num_tokens for s in seqs] if ends is None else ends
        if self._blocks_to_append(seqs, ends) > self.get_num_free_gpu_blocks():
            return None
        copies = []
        for seq, end in zip(seqs, ends):
            table = seq.block_table
            if self._writes_shared_block(seq):
                src, dst = table.block_ids[-1], self._allocate_block()
                self.ref_count[src] -= 1
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
            table.append_block(self._allocate_block())
            if self.observers:
                self.observers.publish(BlockAllocated(seq.seq_id, table.block_ids[-1], len(table) - 1))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make child share all of parent's blocks (ref_count + 1 each), e.g. a new sample
        or a surviving beam. Any blocks child held are freed first. The child's table and
        block_hashes become copies of the parent's. Its num_computed_tokens is the
        scheduler's to set (Scheduler._fork), as every num_computed_tokens is."""
        self.free(child)
        for block_id in parent.block_table.block_ids:
            self.ref_count[block_id] += 1
        child.block_table.block_ids = list(parent.block_table.block_ids)
        child.block_hashes = list(parent.block_hashes)
        if self.observers:
            self.observers.publish(BlocksShared(child.seq_id, parent.seq_id, tuple(parent.block_table.block_ids)))

    # -- swapping (preemption by swap, paper §4.5) -------------------------------------------

    def get_num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_block_ids)

    @staticmethod
    def _distinct_blocks(seqs: list[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in s.block_table.block_ids))

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return len(self._distinct_blocks(seqs)) <= self.get_num_free_cpu_blocks()

    def can_swap_in(self, seq_group: SequenceGroup, headroom: int) -> bool:
        """Room for the request's blocks plus `headroom` more (one per sequence keeps it
        from being preempted again at once; 0 when the pool has nobody else)."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        return len(self._distinct_blocks(seqs)) + headroom <= self.get_num_free_gpu_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move a running request's blocks to the CPU pool; returns (gpu, cpu) pairs to
        copy. Blocks its sequences share stay shared (one copy, ref counted). Called
        while they are RUNNING; the scheduler then marks them SWAPPED (which says their
        ids are CPU blocks)."""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        mapping = {}
        for gpu in self._distinct_blocks(seqs):
            mapping[gpu] = cpu = self.free_cpu_block_ids.pop()
        for seq in seqs:
            table = seq.block_table
            gpu_ids = list(table.block_ids)
            self.free(seq)                    # (still RUNNING) freed GPU blocks keep their cache entries
            table.block_ids = [mapping[g] for g in gpu_ids]
            for cpu in table.block_ids:
                self.cpu_ref_count[cpu] += 1
        if self.observers:
            self.observers.publish(SwapOut(seq_group.request_id, tuple(mapping.items()),
                                           {s.seq_id: tuple(s.block_table.block_ids) for s in seqs}))
        return list(mapping.items())

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move a swapped request's blocks back to the device pool; returns (cpu, gpu)
        pairs. Called while its sequences are SWAPPED; the scheduler then marks them RUNNING."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        mapping = {cpu: self._allocate_block() for cpu in self._distinct_blocks(seqs)}
        for gpu in mapping.values():
            self.ref_count[gpu] = 0
        for seq in seqs:
            table = seq.block_table
            cpu_ids = list(table.block_ids)
            self.free(seq)                    # (still SWAPPED) its CPU blocks
            table.block_ids = [mapping[c] for c in cpu_ids]
            for gpu in table.block_ids:
                self.ref_count[gpu] += 1
        if self.observers:
            self.observers.publish(SwapIn(seq_group.request_id, tuple(mapping.items()),
                                          {s.seq_id: tuple(s.block_table.block_ids) for s in seqs}))
        return list(mapping.items())

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks; a block nobody holds goes to the free queue.

        Tail blocks go in first, so when the cache evicts the least recently freed block
        it takes a sequence's last blocks before its first ones (the prefix others share).
        A freed block keeps its prefix-cache entry until it is evicted. A swapped-out
        sequence (seq.is_swapped) holds CPU-pool blocks instead: those go back to the
        CPU pool's free list by its own ref counts. So free a sequence before its status
        changes (Scheduler._finish_seq does).
        """
        if seq.is_swapped:
            for block_id in seq.block_table.clear():
                self.cpu_ref_count[block_id] -= 1
                if self.cpu_ref_count[block_id] == 0:
                    self.free_cpu_block_ids.append(block_id)
            return
        for block_id in reversed(seq.block_table.clear()):
            self.ref_count[block_id] -= 1
            if self.ref_count[block_id] == 0:
                self.free_block_ids[block_id] = None
            if self.observers:
                self.observers.publish(BlockFreed(seq.seq_id, block_id, self.ref_count[block_id]))

    def free_slots_past_computed(self, seq: Sequence) -> None:
        """Speculative decoding's rollback: give back the blocks at the end of seq's table
        that hold no computed token, only slots of rejected drafts (or the draft model's
        lookahead), so the table again holds ceil(num_computed_tokens / block_size)
        blocks. They were fresh this step and never named (a block is named only when
        all its slots hold accepted tokens: cache_full_blocks), so they go to the *front*
        of the free queue, reused before any block whose prefix-cache entry has value."""
        table = seq.block_table
        keep = table.num_blocks_for(seq.num_computed_tokens)
        for block_id in reversed(table.block_ids[keep:]):
            self.ref_count[block_id] -= 1
            if self.ref_count[block_id] == 0:
                self.free_block_ids[block_id] = None
                self.free_block_ids.move_to_end(block_id, last=False)
            if self.observers:
                self.observers.publish(BlockFreed(seq.seq_id, block_id, self.ref_count[block_id]))
        del table.block_ids[keep:]

    def _allocate_block(self) -> int:
        """Take the least recently freed block off the free queue for one holder
        (ref_count 1); a name it still had in the prefix cache is forgotten (evicted).
        The caller has checked that a block is free (allocate, append_slots)."""
        block_id, _ = self.free_block_ids.popitem(last=False)   # least recently freed
        self._evict(block_id)
        self.ref_count[block_id] = 1
        return block_id

