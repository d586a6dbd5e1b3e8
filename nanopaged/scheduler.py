"""Scheduler: each step, decide which requests run and how many tokens each computes.

Continuous batching (Orca, OSDI'22; the PagedAttention paper §4.5): the batch is rebuilt
every step. Requests that finished last step have already left (the engine freed their
blocks); requests that are running get one more token; waiting requests join, oldest
first, while the step's limits and the free blocks allow. So a short request never
waits for a long one to finish, and the KV pool is refilled the moment blocks free up.

The limits of one step:
    max_num_seqs            requests in the batch
    max_num_batched_tokens  tokens computed in the step (prefill tokens + 1 per decode);
                            a prompt that does not fit is chunked over several steps
    free blocks             every token computed needs a KV slot

When a running request needs a new block and none is free, the scheduler preempts
the request that arrived last (vLLM's policy: latest first, so the oldest requests
always make progress and nobody starves). By *swap* its blocks are copied to a CPU pool
and come back before any new request is admitted; by *recompute* they are freed, it goes
back to the head of the waiting queue, and when readmitted it recomputes its prompt plus
the tokens it had generated in one prefill (paper §4.5). "auto" picks the cheaper for
each preemption with costs measured at start (PreemptionCosts). Outputs do not change
either way: the same tokens give the same K/V.

The decision goes to the model runner as a SchedulerOutput; the scheduler never touches
tensors. vLLM: `vllm/core/scheduler.py` (v0), `vllm/v1/core/sched/scheduler.py` (v1).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .events import Preempted, scheduled_events
from .sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    """One sequence in this step's batch.

    Attributes:
        seq: the sequence.
        seq_group: its request.
        num_new_tokens: tokens computed for it this step, starting at
            seq.num_computed_tokens (the uncached prompt on prefill, 1 on decode).
        forks: sequences sharing seq's blocks and this computation (the other n - 1
            samples of a fresh request); each samples its own token from seq's logits.
    """

    seq: Sequence
    seq_group: SequenceGroup
    num_new_tokens: int
    forks: list[Sequence] = field(default_factory=list)


@dataclass
class PreemptionCosts:
    """What preempting costs on this machine, measured when the engine starts.

    Attributes:
        seconds_per_block_swap: copying one KV block (all layers, K and V) between the
            device pool and the CPU pool, one way.
        seconds_per_token_recompute: prefilling one token again.
    A swap costs 2 * blocks * seconds_per_block_swap (out, later back in); a recompute
    costs tokens * seconds_per_token_recompute (the paper's §4.5 trade-off: swapping
    wins for long sequences on slow compute, recompute for short ones on slow PCIe).
    """

    seconds_per_block_swap: float
    seconds_per_token_recompute: float

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        return 2 * num_blocks * self.seconds_per_block_swap < num_tokens * self.seconds_per_token_recompute


@dataclass
class SchedulerOutput:
    """What the model runner must do this step.

    Attributes:
        scheduled: the batch, running (decode) requests first, then new (prefill) ones.
        num_batched_tokens: sum of num_new_tokens (<= max_num_batched_tokens).
        preempted: requests preempted (by recompute) while making room this step.
        blocks_to_copy: (src, dst) physical block pairs the runner copies before the
            forward pass (copy-on-write).
        blocks_to_swap_out / blocks_to_swap_in: block pairs the runner copies device ->
            CPU pool / CPU pool -> device before the forward pass (swap preemption).
        swapped_out / swapped_in: the requests those belong to.
        finished_without_running: requests the scheduler ended itself (a lone sequence
            that outgrew the whole pool); the engine reports them.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[SequenceGroup] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu, gpu)
    swapped_out: list[SequenceGroup] = field(default_factory=list)
    swapped_in: list[SequenceGroup] = field(default_factory=list)
    finished_without_running: list[SequenceGroup] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous-batching scheduler: token budget, chunked prefill, preemption by swap or recompute.

    Args:
        block_manager: the device pool's BlockManager.
        max_num_seqs: most requests in one step's batch.
        max_num_batched_tokens: most tokens computed in one step (the token budget).
        enable_chunked_prefill: compute a prompt that does not fit in what is left of the
            budget over several steps (vLLM's chunked prefill), its num_computed_tokens
            advancing chunk by chunk; attention for a chunk reads the earlier chunks
            through the block table.
        preemption_mode: "recompute", "swap" or "auto" (the cheaper one, by `costs`).
        costs: measured PreemptionCosts, needed by "auto".
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", costs: PreemptionCosts | None = None) -> None:
        self.block_manager = block_manager
        self.observers = block_manager.observers         # one event stream (events.py)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.costs = costs
        self.swapped: deque[SequenceGroup] = deque()    # preempted by swap, arrival order
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()   # kept in arrival order
        self.num_preemptions = 0

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch. Mutates queues and block tables; see the module doc."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running requests first, oldest first: a decode needs a slot for its next
        #    token, a chunked prefill goes on with as much of its prompt as the budget allows.
        kept: deque[SequenceGroup] = deque()
        while self.running:
            group = self.running.popleft()
            seqs = group.seqs_to_compute(SequenceStatus.RUNNING)
            forks = [s for s in group.get_seqs(SequenceStatus.RUNNING) if s not in seqs]
            work = [(s, self._chunk(s.num_uncomputed_tokens, budget)) for s in seqs]
            # Out of budget: it keeps its blocks and waits a step. (A request whose n
            # sequences alone exceed the whole budget runs in a step of its own.)
            if any(n == 0 for _, n in work) or (sum(n for _, n in work) > budget and out.scheduled):
                kept.append(group)
                continue
            ends = [s.num_computed_tokens + n for s, n in work]
            while not self.block_manager.can_append_slots(seqs, ends) and self.running:
                self._preempt(self.running.pop(), out)     # evict the latest arrival
            if not self.block_manager.can_append_slots(seqs, ends):
                if kept:
                    self._preempt(group, out)   # it is the latest arrival left: itself
                else:
                    self._finish_too_long(group, out)
                continue
            for (seq, n), end in zip(work, ends):
                out.blocks_to_copy += self.block_manager.append_slots(seq, end)
                out.scheduled.append(ScheduledSequence(seq, group, n, forks))
                out.num_batched_tokens += n
                budget -= n
            kept.append(group)
        self.running = kept

        # 2. Swapped-out requests come back first, oldest first, when their blocks fit
        #    (they run from the next step; the copies happen before this step's forward).
        while (self.swapped and not out.preempted and len(self.running) < self.max_num_seqs
               and self.block_manager.can_swap_in(self.swapped[0],
                                                  headroom=len(self.swapped[0].seqs) if self.running else 0)):
            group = self.swapped.popleft()
            out.blocks_to_swap_in += self.block_manager.swap_in(group)
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            out.swapped_in.append(group)
            self._add_running(group)

        # 3. Then waiting requests, strictly in order (FCFS: never skip ahead of the head),
        #    and only once nobody is swapped out. Not in a step that had to preempt:
        #    memory is tight, admitting more would only cause more preemption (vLLM too).
        while (self.waiting and not out.preempted and not self.swapped
               and len(self.running) < self.max_num_seqs):
            group = self.waiting[0]
            if self.block_manager.never_fits(group):
                self.waiting.popleft()            # can never fit again; see _finish_too_long
                self._finish_too_long(group, out)
                continue
            first, *rest = group.seqs_to_compute()
            first_tokens, rest_tokens = self.block_manager.num_tokens_to_compute(group)
            # Only a lone sequence is chunked. A recomputed n > 1 request may need more
            # than the whole budget: it then runs in a step of its own rather than never.
            n_first = first_tokens if rest else self._chunk(first_tokens, budget)
            if n_first == 0 or (n_first + rest_tokens > budget and out.scheduled):
                break
            first_end = first.num_tokens - first_tokens + n_first
            if not self.block_manager.can_allocate(group, first_end):
                break
            self.waiting.popleft()
            forks = [s for s in group.get_seqs(SequenceStatus.WAITING) if s is not first and s not in rest]
            self.block_manager.allocate(group, first_end)   # num_computed_tokens = cache hit
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
            for seq in [first, *rest]:
                n = (first_end if seq is first else seq.num_tokens) - seq.num_computed_tokens
                out.scheduled.append(ScheduledSequence(seq, group, n, forks if seq is first else []))
                out.num_batched_tokens += n
                budget -= n
            self._add_running(group)
        if self.observers:               # the block manager's observers: see events.py
            self.observers.publish(*scheduled_events(out))
        return out

    def _add_running(self, group: SequenceGroup) -> None:
        """Keep the running queue in arrival order (preemption takes its tail): a request
        coming back from swap or recompute may be older than ones already running."""
        if self.running and group.arrival_time < self.running[-1].arrival_time:
            self.running = deque(sorted([*self.running, group], key=lambda g: g.arrival_time))
        else:
            self.running.append(group)

    def _chunk(self, num_tokens: int, budget: int) -> int:
        """Tokens of a prefill computed this step: all of them, or with chunked prefill
        as many as the budget has left (a decode is 1 token: never cut)."""
        return min(num_tokens, max(budget, 0)) if self.enable_chunked_prefill else num_tokens

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Free a running request's device blocks by swap or by recompute (see the
        module doc); either way it goes to the head of its queue."""
        self.num_preemptions += 1
        out.preempted.append(group)
        swap = self._should_swap(group)
        if self.observers:
            self.observers.publish(Preempted(group.request_id, "swap" if swap else "recompute"))
        if swap:
            out.blocks_to_swap_out += self.block_manager.swap_out(group)
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(group)
            out.swapped_out.append(group)
            self.num_preemptions_swap += 1
            return
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)
        self.num_preemptions_recompute += 1

    def _should_swap(self, group: SequenceGroup) -> bool:
        if self.preemption_mode == "recompute" or not self.block_manager.can_swap_out(group):
            return False
        if self.preemption_mode == "swap":
            return True
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        num_blocks = len({b for s in seqs for b in s.block_table.block_ids})
        return self.costs.prefer_swap(num_blocks, sum(s.num_computed_tokens for s in seqs))

    def _finish_too_long(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """A request that cannot get its blocks even with the pool to itself will never
        fit: finish it with finish_reason "length". Without this it would sit at the
        head of the waiting queue forever, and FCFS would block everyone behind it."""
        logger.warning("request %r needs more KV blocks than the whole pool has (%d blocks "
                       "of %d tokens); finishing it with finish_reason='length'",
                       group.request_id, self.block_manager.num_gpu_blocks,
                       self.block_manager.block_size)
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_LENGTH
            self.block_manager.free(seq)
        out.finished_without_running.append(group)

    def finish_seq_group(self, group: SequenceGroup) -> None:
        """Free a finished request's blocks and drop it from the running queue."""
        for seq in group.seqs:
            self.block_manager.free(seq)
        try:
            self.running.remove(group)
        except ValueError:
            pass

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is, free its blocks; returns it, or None if unknown."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        if not seq.status.is_finished:
                            seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq)
                    return group
        return None
