"""Scheduler: each step, which requests run and how many tokens each computes; after it,
what the model produced. Continuous batching (Orca; PagedAttention §4.5): `schedule()`
runs the running requests (a decode or a prompt's next chunk; preempting the latest
arrival by swap or recompute when blocks run out), then the swapped-out, then the
waiting (FCFS), within max_num_seqs, max_num_batched_tokens and the free blocks.
Later features override the methods marked "Hook" (features.py composes them).
vLLM: `vllm/v1/core/sched/scheduler.py`; v0's for swapping.
"""
from __future__ import annotations

import itertools
from collections import deque

from ..config import EngineConfig
from ..events import Preempted, SequenceScheduled
from ..messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, ModelRunnerOutput,
                        PreemptionCosts, SchedulerOutput)
from .block_manager import BlockManager, ComputedBlocks
from .request_queues import RequestQueues
from .runner_view import RunnerView
from .scheduler_output import ScheduledSequence, ScheduledStep
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .stop_checker import check_stop


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption. config: an EngineConfig
    (max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
    preemption_mode); costs: PreemptionCosts, for "auto". Queues: self.queues (RequestQueues)."""

    runner_view_cls = RunnerView
    scheduler_output_cls = SchedulerOutput    # a feature that adds fields to the step's message subclasses it

    def __init__(self, config: EngineConfig, block_manager: BlockManager, *, costs: PreemptionCosts | None = None):
        self.config = config
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.observers = block_manager.observers         # one event stream (events.py)
        self.costs = costs
        self.runner_view = self.runner_view_cls()
        self.queues = RequestQueues(block_manager, self.runner_view, self.observers, self._request_removed)
        self._seq_ids = itertools.count()
        self.num_preemptions = self.num_preemptions_swap = self.num_preemptions_recompute = 0
        self.num_generated_tokens = self.num_prompt_tokens_computed = 0   # (prompt: cache hits excluded)

    waiting = property(lambda self: self.queues.waiting)
    running = property(lambda self: self.queues.running)
    swapped = property(lambda self: self.queues.swapped)
    requests = property(lambda self: self.queues.requests)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (RequestQueues.add raises ValueError for a bad one)."""
        self.queues.add(request, self._make_group)

    def _make_group(self, request: EngineCoreRequest) -> SequenceGroup:
        """Hook: the request's SequenceGroup of n fresh sequences. Raises ValueError."""
        bs, n, prompt = self.block_manager.block_size, request.sampling_params.n, request.prompt_token_ids
        return SequenceGroup(request, [Sequence(next(self._seq_ids), i, prompt, bs) for i in range(n)])

    def _request_removed(self, group: SequenceGroup) -> None:
        """Hook: group left the books (all its sequences finished, or it was aborted):
        what a feature keeps for it goes too."""

    def has_unfinished_requests(self) -> bool:
        return self.queues.has_unfinished()

    def abort_requests(self, request_ids) -> None:
        """Remove requests wherever they are, freeing their blocks; unknown ids are ignored."""
        self.queues.abort(request_ids)

    def stop_sequences(self, seqs: list[tuple[str, int]]) -> None:
        """Finish (request_id, index) sequences whose stop string matched."""
        self.queues.stop(seqs)

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch; mutates queues and block tables."""
        step = ScheduledStep(budget=self.config.scheduler_config.max_num_batched_tokens)
        self._schedule_running(step)
        self._schedule_swapped(step)
        self._schedule_waiting(step)
        if self.observers:
            self.observers.publish(*(self._scheduled_event(s) for s in step.scheduled))
        samples = [s.samples(self._num_pending_tokens(s.seq)) for s in step.scheduled]   # before anything counts
        out = self.runner_view.message(step, samples, self.scheduler_output_cls)
        self._after_schedule(step, samples, out)
        return out

    def _schedule_running(self, step: ScheduledStep) -> None:
        """Running requests, oldest first: a decode or the next chunk of a prompt."""
        kept = deque()
        while self.running:
            group = self.running.popleft()
            running = [s for s in group.get_seqs(SequenceStatus.RUNNING) if self._schedulable(s, group)]
            if not running:
                kept.append(group)
                continue
            seqs = [s for s in group.seqs_to_compute(SequenceStatus.RUNNING) if s in running]
            forks = [s for s in running if s not in seqs]
            work = [ScheduledSequence(s, group, self._chunk(s.num_uncomputed_tokens + self._num_pending_tokens(s),
                                                            step.budget), forks) for s in seqs]
            total = sum(w.num_new_tokens for w in work)
            # out of budget: it waits (n sequences alone over the budget run in a step of their own)
            if any(w.num_new_tokens == 0 for w in work) or (total > step.budget and step.scheduled):
                kept.append(group)
                continue
            ends = [s.num_computed_tokens + w.num_new_tokens for s, w in zip(seqs, work)]
            before = [list(s.block_table.block_ids) for s in seqs]
            copies = self._append_slots(work, ends, step)
            while copies is None and self.running:
                self._preempt(self.running.pop(), step)          # evict the latest arrival
                copies = self.block_manager.append_slots(seqs, ends)
            if copies is None:
                if kept:
                    self._preempt(group, step)       # it is the latest arrival left
                elif self._may_fit_later(group):
                    kept.append(group)
                else:
                    self.queues.finish_too_long(group)
                continue
            step.blocks_to_copy += copies
            for w, ids in zip(work, before):         # copy-on-write replaces a last block
                w.num_blocks_before = len(ids)
                w.table_replaced = w.seq.block_table.block_ids[:len(ids)] != ids
                step.add(w)
            kept.append(group)
        self.queues.running = kept

    def _schedulable(self, seq: Sequence, group: SequenceGroup) -> bool:
        """Hook: may running seq be scheduled this step?"""
        return True

    def _num_pending_tokens(self, seq: Sequence) -> int:
        """Hook: tokens that steps already scheduled will sample for seq and that are not
        appended yet (0 here: each step's output is taken in before the next schedule)."""
        return 0

    def _num_tokens_allowed(self, seq: Sequence, token_ids: list[int]) -> int:
        """Hook: how many of token_ids, from the first, may follow seq's tokens (all of
        them here; a feature that constrains the output may allow fewer). The base never
        asks: it is where a feature that guesses a sequence's next tokens meets one that
        constrains them."""
        return len(token_ids)

    def _append_slots(self, work: list[ScheduledSequence], ends: list[int], step: ScheduledStep) -> list | None:
        """Hook: slots up to ends[i] for work[i] (copy-on-write pairs, or None when short)."""
        return self.block_manager.append_slots([w.seq for w in work], ends)

    def _may_fit_later(self, group: SequenceGroup) -> bool:
        """Hook: blocks are short with the pool to itself; may it still fit later?"""
        return False

    def _schedule_swapped(self, step: ScheduledStep) -> None:
        """Swapped-out requests come back, oldest first, when they fit with a block to spare per sequence."""
        while (self.swapped and not step.preempted and len(self.running) < self.config.scheduler_config.max_num_seqs
               and self.block_manager.can_swap_in(self.swapped[0],
                                                  headroom=len(self.swapped[0].seqs) if self.running else 0)):
            group = self.swapped.popleft()
            step.blocks_to_swap_in += self.block_manager.swap_in(group)
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
                self.runner_view.forget(seq.seq_id)      # every block moved
            self.queues.add_running(group)

    def _schedule_waiting(self, step: ScheduledStep) -> None:
        """Waiting requests join in order (FCFS) while there is room; none when memory is
        tight. One that may not join this step (`_can_join`) is passed over, in place."""
        i = 0                                     # the first waiting request not passed over
        while (i < len(self.waiting) and not step.preempted and not self.swapped
               and len(self.running) < self.config.scheduler_config.max_num_seqs):
            group = self.waiting[i]
            if not self._can_join(group, step):
                i += 1
                continue
            computed = self.block_manager.get_computed_blocks(group)   # cache hits: not computed
            if computed.never_fits:
                del self.waiting[i]
                self.queues.finish_too_long(group)
                continue
            first, *rest = group.seqs_to_compute()
            first_tokens = first.num_tokens - computed.num_computed_tokens
            rest_tokens = sum(s.num_tokens - computed.num_shared_tokens for s in rest)
            # only a lone sequence is chunked; a recomputed n > 1 request may take a step to itself
            n_first = first_tokens if rest else self._chunk(first_tokens, step.budget)
            if n_first == 0 or (n_first + rest_tokens > step.budget and step.scheduled):
                break
            first_end = computed.num_computed_tokens + n_first
            starts = self._allocate(group, computed, first_end)
            if starts is None:                    # not enough free blocks: wait
                break
            del self.waiting[i]
            self._admit(step, group, first_end, starts)

    def _can_join(self, group: SequenceGroup, step: ScheduledStep) -> bool:
        """Hook: may waiting `group` join this step? False passes it over (it keeps its
        place) and the next waiting request is asked. Always True here: plain FCFS."""
        return True

    def _allocate(self, group: SequenceGroup, computed: ComputedBlocks, first_end: int) -> list[int] | None:
        """Hook: blocks for a joining request (BlockManager.allocate: each sequence's start, or None)."""
        return self.block_manager.allocate(group, computed, first_end)

    def _admit(self, step: ScheduledStep, group: SequenceGroup, first_end: int, starts: list[int]) -> None:
        """A waiting request joins: sequence i starts at starts[i], the first computes to first_end."""
        first, *rest = group.seqs_to_compute()
        forks = [s for s in group.get_seqs(SequenceStatus.WAITING) if s is not first and s not in rest]
        for seq, start in zip([first, *rest], starts):
            seq.num_computed_tokens = start
        if not first.output_token_ids:
            group.num_cached_tokens = first.num_computed_tokens
        for seq in group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.RUNNING
        for seq in [first, *rest]:
            self.runner_view.forget(seq.seq_id)      # (re)starts: send it in full
            n = (first_end if seq is first else seq.num_tokens) - seq.num_computed_tokens
            step.add(ScheduledSequence(seq, group, n, forks if seq is first else []))
        self.queues.add_running(group)

    def _scheduled_event(self, s: ScheduledSequence) -> SequenceScheduled:
        """Hook: the tracer's event for one sequence of the batch (a feature that adds
        tokens to a sequence's step names them here)."""
        return s.event()

    def _after_schedule(self, step: ScheduledStep, samples: list[bool], out: SchedulerOutput) -> None:
        """Hook: the step's message is built; samples[i]: step.scheduled[i] samples."""

    def _needs_output_first(self, s: ScheduledSequence) -> bool:
        """Hook: does the next schedule() depend on s's sample? (n > 1: forks get blocks then)"""
        return bool(s.forks)

    def _chunk(self, num_tokens: int, budget: int) -> int:
        """Tokens of a prefill computed this step: all, or (chunked prefill) what the budget has left."""
        return min(num_tokens, max(budget, 0)) if self.config.scheduler_config.enable_chunked_prefill else num_tokens

    def _preempt(self, group: SequenceGroup, step: ScheduledStep) -> None:
        """Free a running request's device blocks by swap or recompute; it heads its queue."""
        self.num_preemptions += 1
        step.preempted = True
        swap = self._should_swap(group)
        if self.observers:
            self.observers.publish(Preempted(group.request_id, "swap" if swap else "recompute"))
        running = group.get_seqs(SequenceStatus.RUNNING)
        if swap:                                  # its blocks go to the CPU pool
            step.blocks_to_swap_out += self.block_manager.swap_out(group)
        for seq in running:
            self.runner_view.forget(seq.seq_id)
            if not swap:                          # its blocks are freed: all computed again
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
            seq.status = SequenceStatus.SWAPPED if swap else SequenceStatus.WAITING
        (self.swapped if swap else self.waiting).appendleft(group)
        self.num_preemptions_swap += swap
        self.num_preemptions_recompute += not swap

    def _should_swap(self, group: SequenceGroup) -> bool:
        """Swap (True) or recompute? "auto" asks costs.prefer_swap(device blocks, computed tokens)."""
        mode = self.config.scheduler_config.preemption_mode
        if mode == "recompute" or not self.block_manager.can_swap_out(group):
            return False
        if mode == "swap":
            return True
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        num_blocks = len({b for s in seqs for b in s.block_table.block_ids})
        return self.costs.prefer_swap(num_blocks, sum(s.num_computed_tokens for s in seqs))

    # -- update_from_output(): the step's other half ----------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Take in one forward; an EngineCoreOutput per sequence that got tokens or finished."""
        result, seqs = EngineCoreOutputs(), self.queues.seqs
        starts = scheduler_output.start_positions()
        for seq_id, n in scheduler_output.num_scheduled_tokens.items():
            if n and seq_id in seqs:
                self._computed(*seqs[seq_id], starts[seq_id], n, scheduler_output, runner_output, result)
        for seq_id, parent in scheduler_output.sample_from.items():   # prefill done: the n - 1 others fork
            if seq_id in runner_output.sampled_token_ids and seq_id in seqs and not seqs[seq_id][0].status.is_finished:
                self._fork(seqs[parent][0], seqs[seq_id][0])
        for seq_id, token in runner_output.sampled_token_ids.items():
            if seq_id in seqs:                   # (else aborted while the step ran)
                self._append_tokens(*seqs[seq_id], [token], scheduler_output, runner_output, result)
        self._after_update(scheduler_output, runner_output, starts, result)
        self.queues.remove_finished(scheduler_output.num_scheduled_tokens, result)
        return result

    def _computed(self, seq: Sequence, group: SequenceGroup, start: int, n: int, scheduler_output: SchedulerOutput,
                  runner_output: ModelRunnerOutput, result: EngineCoreOutputs) -> None:
        """Hook: positions [start, start + n) of seq have K/V now: count, name blocks, prompt logprobs."""
        self.num_prompt_tokens_computed += max(0, min(start + n, len(seq.prompt_token_ids)) - start)
        self._count_computed(seq, n)
        if seq.status == SequenceStatus.RUNNING:       # else it holds no device blocks now
            self.block_manager.cache_full_blocks(seq, start, start + n)
        lp = runner_output.prompt_logprobs.get(seq.seq_id)
        if lp is not None and (rows := seq.new_prompt_logprobs(start, lp)) is not None:
            result.outputs.append(EngineCoreOutput(group.request_id, seq.index, [], new_prompt_logprobs=rows,
                                                   num_cached_tokens=group.num_cached_tokens))

    def _count_computed(self, seq: Sequence, n: int) -> None:
        """Hook: n more of seq's tokens are computed."""
        seq.num_computed_tokens += n

    def _append_tokens(self, seq: Sequence, group: SequenceGroup, tokens: list[int], scheduler_output: SchedulerOutput,
                       runner_output: ModelRunnerOutput, result: EngineCoreOutputs) -> None:
        """Hook: append the step's tokens to seq (unless finished meanwhile); a stop drops the rest."""
        if seq.status.is_finished:
            return
        logprobs = runner_output.logprobs.get(seq.seq_id)
        for i, token in enumerate(tokens):
            seq.append_token(token)
            self.num_generated_tokens += 1
            status = self._check_stop(seq, group, token)
            if status is not None:
                self.queues.finish_seq(seq, status)            # its siblings may run on
                tokens = tokens[:i + 1]
                break
        if logprobs is not None and len(logprobs.ranks) > len(tokens):
            logprobs = logprobs[:len(tokens)]
        result.outputs.append(EngineCoreOutput(
            group.request_id, seq.index, tokens, new_logprobs=logprobs,
            finish_reason=FinishReason(seq.status.finish_reason) if seq.status.is_finished else None,
            stop_reason=seq.stop_reason, num_cached_tokens=group.num_cached_tokens))

    def _check_stop(self, seq: Sequence, group: SequenceGroup, token: int) -> SequenceStatus | None:
        """Hook: the finished status seq's new last token gives it (stop_checker.check_stop)."""
        return check_stop(seq, group, self.max_model_len)

    def _after_update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                      starts: dict[int, int], result: EngineCoreOutputs) -> None:
        """Hook: tokens appended, finished requests not yet removed. starts: seq_id -> first position."""

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares parent's blocks (BlockManager.fork) and has computed what it has."""
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
