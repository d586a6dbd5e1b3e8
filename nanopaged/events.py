"""Engine events: what happened in a step, as data, for the tracer and for tests.

The engine publishes one small frozen dataclass per fact, from the place where the fact
happens: the scheduler for requests coming and going and for its decisions, the block
manager and its pools (block_pool.py) for every change to a physical block. Anyone can listen:

    engine.add_observer(events.append)          # any callable taking one event
    engine.step()                               # events now holds what this step did

Publishing costs nothing when nobody listens. Every hook reads

    if self.observers:
        self.observers.publish(BlockAllocated(...))

so with no observer the event is never even built: the cost is one truth test of an
empty list.

The device-pool events are complete: replaying them from a snapshot rebuilds every
block's ref_count, the free queue's contents and the prefix cache's block set
(tests/invariants.py `EventReplay` does exactly that after every step of a random
workload). Each block event says who holds what:

    BlockAllocated   a fresh block from the free queue; ref_count 0 -> 1
    PrefixCacheHit   cached blocks reused by a new sequence; ref_count + 1 each
    BlocksShared     a fork, or recomputed siblings sharing their prompt; + 1 each
    CopyOnWrite      a shared last block replaced by a fresh copy; src - 1, dst 0 -> 1
    BlockFreed       a sequence lets go of a block; ref_count - 1 (0: free again)
    BlockCached      a full block named in the prefix cache (vLLM's BlockStored)
    BlockEvicted     a cached block's name dropped, to reuse it (vLLM's BlockRemoved)
    SwapOut, SwapIn  a preempted request's blocks moved to / from the CPU pool

vLLM publishes the prefix cache's half of this as KV-cache events for routers
(`vllm/distributed/kv_events.py`: BlockStored, BlockRemoved, AllBlocksCleared) and its
scheduler's decisions as per-request events (`vllm/v1/engine/__init__.py`,
EngineCoreEventType: QUEUED, SCHEDULED, PREEMPTED).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


class Observers(list):
    """The callables listening to an engine's events: a plain list, plus `publish`.

    One list is shared by the engine, its scheduler and its block manager, so a callable
    appended by `LLMEngine.add_observer` hears all three. Publishers test the list
    before building an event (see the module doc).
    """

    def publish(self, *events: Event) -> None:
        """Call every observer with each event, in order."""
        for event in events:
            for observer in self:
                observer(event)


# -- requests (published by the scheduler, which owns them) ----------------------------------------------------

@dataclass(frozen=True)
class RequestAdded:
    """A request was queued (`Scheduler.add_request`, from `LLMEngine.add_request`).

    seq_ids: its sequences (n of them; beams for beam search). num_prompt_tokens: > 0.
    """

    request_id: str
    seq_ids: tuple[int, ...]
    num_prompt_tokens: int

    def __str__(self) -> str:
        return f"request {self.request_id} added: {self.num_prompt_tokens} prompt tokens, seqs {list(self.seq_ids)}"


@dataclass(frozen=True)
class RequestFinished:
    """A request left the engine and all its blocks are free.

    finish_reasons: one per sequence, "stop", "length" or "abort" (vLLM's names).
    """

    request_id: str
    finish_reasons: tuple[str | None, ...]

    def __str__(self) -> str:
        return f"request {self.request_id} finished ({', '.join(map(str, self.finish_reasons))})"


# -- the scheduler's decisions --------------------------------------------------------------

@dataclass(frozen=True)
class SequenceScheduled:
    """One sequence in this step's batch (a ScheduledSequence, flattened).

    kind: "decode" when it computes just its last sampled token, else "prefill" (a
    prompt, a chunk of one, or prompt + output again after a recompute).
    start, num_tokens: it computes positions [start, start + num_tokens).
    forks: seq ids that sample from its logits too (the other n - 1 samples of a
    fresh request, which fork its blocks once this prefill is done).
    spec_token_ids: draft tokens it verifies (speculative decoding): they are the last
    len(spec_token_ids) of its num_tokens positions; kind is then "verify".
    """

    request_id: str
    seq_id: int
    kind: str
    start: int
    num_tokens: int
    forks: tuple[int, ...] = ()
    spec_token_ids: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = (f"position {self.start}" if self.num_tokens == 1 else
                 f"{self.num_tokens} tokens, positions {self.start}..{self.start + self.num_tokens - 1}")
        forks = f", sampled by seqs {list(self.forks)} too" if self.forks else ""
        drafts = f", drafts {list(self.spec_token_ids)}" if self.spec_token_ids else ""
        return f"seq {self.seq_id} ({self.request_id}) {self.kind}: {where}{forks}{drafts}"


@dataclass(frozen=True)
class DraftsVerified:
    """Speculative decoding: a sequence's drafts were checked by the forward (published
    by the scheduler in update_from_output; then come the BlockCached of blocks its
    accepted tokens filled, and the BlockFreed of blocks that held only rejected slots).

    spec_token_ids: the drafts, at positions start + 1 .. start + k.
    num_accepted: how many of them, from the first, the model agreed with.
    num_computed_tokens: the sequence's num_computed_tokens after the rollback (the
    positions of rejected drafts are no longer counted: their slots are taken back).
    """

    request_id: str
    seq_id: int
    start: int
    spec_token_ids: tuple[int, ...]
    num_accepted: int
    num_computed_tokens: int

    def __str__(self) -> str:
        k, a = len(self.spec_token_ids), self.num_accepted
        rejected = f", slots from position {self.num_computed_tokens} taken back" if a < k else ""
        return (f"seq {self.seq_id} ({self.request_id}) verified drafts {list(self.spec_token_ids)}: "
                f"accepted {a} of {k}{rejected}")


@dataclass(frozen=True)
class Preempted:
    """A running request gave its device blocks back (paper §4.5).

    mode: "swap" (blocks copied to the CPU pool; a SwapOut follows) or "recompute"
    (blocks freed; it recomputes prompt + output when readmitted).
    """

    request_id: str
    mode: str

    def __str__(self) -> str:
        return f"request {self.request_id} preempted by {self.mode}"


@dataclass(frozen=True)
class WaitingForLoRASlot:
    """A waiting request was passed over: its LoRA adapter is in none of the model's
    slots and every slot holds an adapter that a running or swapped request uses
    (lora/scheduler.py). Published once per wait, when it starts.

    lora_int_id: its adapter. slots: the adapter id in each slot, all in use.
    """

    request_id: str
    lora_int_id: int
    slots: tuple[int, ...]

    def __str__(self) -> str:
        return (f"request {self.request_id} waits for a LoRA slot: adapter {self.lora_int_id} is not loaded, "
                f"and the slots hold adapters {list(self.slots)}, all in use")


# -- the device pool (published by the block manager; BlockEvicted by block_pool.py) --------

@dataclass(frozen=True)
class BlockAllocated:
    """seq_id took a fresh block from the free queue (ref_count 0 -> 1) as its logical
    block `logical_index` (its table's last entry)."""

    seq_id: int
    block_id: int
    logical_index: int

    def __str__(self) -> str:
        return f"block {self.block_id} allocated to seq {self.seq_id} as logical block {self.logical_index}"


@dataclass(frozen=True)
class BlockFreed:
    """seq_id let go of block_id; ref_count is the block's count afterwards (0: it is
    back in the free queue, keeping its prefix-cache name until evicted)."""

    seq_id: int
    block_id: int
    ref_count: int

    def __str__(self) -> str:
        state = "now free" if self.ref_count == 0 else f"ref_count {self.ref_count}"
        return f"block {self.block_id} released by seq {self.seq_id} ({state})"


@dataclass(frozen=True)
class BlocksShared:
    """seq_id now also holds block_ids, which parent_seq_id holds (ref_count + 1 each),
    appended to its table in order: a fork (the n samples of a request after their
    prefill, a beam chosen twice) or siblings recomputed together sharing their prompt."""

    seq_id: int
    parent_seq_id: int
    block_ids: tuple[int, ...]

    def __str__(self) -> str:
        return f"seq {self.seq_id} shares seq {self.parent_seq_id}'s blocks {list(self.block_ids)}"


@dataclass(frozen=True)
class PrefixCacheHit:
    """A new (or readmitted) sequence found its first len(block_ids) blocks in the
    prefix cache and takes them (ref_count + 1 each; a free one leaves the free queue):
    num_tokens = len(block_ids) * block_size tokens it does not compute."""

    request_id: str
    seq_id: int
    block_ids: tuple[int, ...]
    num_tokens: int

    def __str__(self) -> str:
        return (f"prefix-cache hit: seq {self.seq_id} ({self.request_id}) reuses blocks "
                f"{list(self.block_ids)}, {self.num_tokens} tokens not recomputed")


@dataclass(frozen=True)
class CopyOnWrite:
    """seq_id was about to write into its last block, shared with others: it gets a
    fresh block dst (ref_count 1) in place of src (ref_count - 1), and the model runner
    copies src's K/V into dst before the forward pass (paper §4.4)."""

    seq_id: int
    logical_index: int
    src: int
    dst: int

    def __str__(self) -> str:
        return (f"copy-on-write: seq {self.seq_id}'s logical block {self.logical_index}: "
                f"block {self.src} copied to {self.dst}")


@dataclass(frozen=True)
class BlockCached:
    """Full block block_id, held by seq_id, is now named in the prefix cache (vLLM's
    BlockStored); token_ids are its block_size tokens."""

    block_id: int
    seq_id: int
    token_ids: tuple[int, ...]

    def __str__(self) -> str:
        return f"block {self.block_id} cached (seq {self.seq_id})"


@dataclass(frozen=True)
class BlockEvicted:
    """Free cached block block_id lost its prefix-cache name because a fresh block was
    needed and it was the least recently freed (vLLM's BlockRemoved)."""

    block_id: int

    def __str__(self) -> str:
        return f"block {self.block_id} evicted from the prefix cache"


@dataclass(frozen=True)
class SwapOut:
    """A preempted request's blocks move to the CPU pool (paper §4.5).

    block_pairs: (device block, CPU block) pairs the model runner copies; the device
    side was already released (a BlockFreed per sequence and block precedes this).
    block_tables: seq_id -> its table of CPU block ids, in logical order.
    """

    request_id: str
    block_pairs: tuple[tuple[int, int], ...]
    block_tables: dict[int, tuple[int, ...]]

    def __str__(self) -> str:
        pairs = ", ".join(f"{g}->cpu {c}" for g, c in self.block_pairs)
        return f"swap out {self.request_id}: {pairs}"


@dataclass(frozen=True)
class SwapIn:
    """A swapped-out request comes back into fresh device blocks (their CPU blocks are free).

    block_pairs: (CPU block, device block) pairs the model runner copies.
    block_tables: seq_id -> its new table of device block ids (a block in two tables
    has ref_count 2).
    """

    request_id: str
    block_pairs: tuple[tuple[int, int], ...]
    block_tables: dict[int, tuple[int, ...]]

    def __str__(self) -> str:
        pairs = ", ".join(f"cpu {c}->{g}" for c, g in self.block_pairs)
        return f"swap in {self.request_id}: {pairs}"


Event = Union[RequestAdded, RequestFinished, SequenceScheduled, DraftsVerified, Preempted, WaitingForLoRASlot,
              BlockAllocated, BlockFreed, BlocksShared, PrefixCacheHit, CopyOnWrite, BlockCached, BlockEvicted,
              SwapOut, SwapIn]
Observer = Callable[[Event], None]
