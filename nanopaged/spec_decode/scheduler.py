"""Speculative decoding, the scheduler's side: SpecDecodeScheduler and its helpers.

The runner proposes drafts after each step (spec_decode/); they wait in the scheduler's
table (SpecDecodeScheduler.spec_token_ids, by seq_id). The next schedule() gives a
decoding sequence 1 + k positions: its last token and the k drafts (`take_drafts`), with
slots for them and for the draft model's lookahead, or fewer when the pool is short
(`slot_plans`: drafts are never worth a preemption); the message is a
SpecDecodeSchedulerOutput (messages.py here). After the forward, update_from_output
rolls num_computed_tokens back past the rejected drafts and takes back the blocks that
held only their slots (`_verified`, `free_slots_past_computed`); the next message tells
the runner how many (SchedulerOutput.num_blocks_taken_back).

Structured outputs meet speculative decoding over the drafts and nowhere else. Going in,
`take_drafts` asks the scheduler hook `_num_tokens_allowed` (core/scheduler.py) how many
of a sequence's proposals its grammar allows and cuts them there
(StructuredOutputScheduler answers it: structured_output/scheduler.py). Coming out, the
drafts a step verifies are its message's scheduled_spec_decode_tokens, set before the
features inside this class build their part of the message, so that structured outputs
give each a mask row (vLLM's grammar bitmask reads the same field).
vLLM v1: the spec-token half of `vllm/v1/core/sched/scheduler.py` and
`vllm/v1/spec_decode/metrics.py`.
"""
from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..events import BlockFreed, DraftsVerified, SequenceScheduled
from ..messages import EngineCoreOutputs
from ..core.block_manager import BlockManager, ComputedBlocks
from ..core.scheduler import Scheduler
from ..core.scheduler_output import ScheduledSequence, ScheduledStep
from ..core.sequence import Sequence, SequenceGroup, SequenceStatus
from .messages import SpecDecodeModelRunnerOutput, SpecDecodeSchedulerOutput


def take_drafts(group: SequenceGroup, work: list[tuple[Sequence, int]], proposals: dict[int, list[int]],
                budget: int, max_model_len: int,
                num_allowed: Callable[[Sequence, list[int]], int]) -> list[list[int]]:
    """The drafts each sequence of `group` verifies this step, from its proposals
    (proposals[seq_id], used up here). work: (sequence, tokens it computes this step
    without drafts). Only a decode (1 token) verifies drafts, and they are cut so that
    the step stays within `budget` (the tokens left of the token budget), the sequence
    within max_tokens and max_model_len (a verify step gives it up to k + 1 tokens),
    and before the first one num_allowed(seq, drafts) does not allow (the scheduler's
    _num_tokens_allowed: with structured outputs, a proposal the grammar forbids is
    rejected at its position; vLLM v1 does the same)."""
    drafts = []
    for seq, n in work:
        proposed = proposals.pop(seq.seq_id, [])
        room = min(budget, group.sampling_params.max_tokens - len(seq.output_token_ids) - 1,
                   max_model_len - seq.num_tokens - 1)
        d = proposed[:max(room, 0)] if n == 1 and seq.num_uncomputed_tokens == 1 else []
        if d:
            d = d[:num_allowed(seq, d)]
        budget -= len(d)
        drafts.append(d)
    return drafts


def free_slots_past_computed(block_manager: BlockManager, seq: Sequence) -> None:
    """The rollback: free the blocks at the end of seq's table that hold only rejected
    draft (or lookahead) slots, down to ceil(num_computed_tokens / block_size). They were
    never named, so they go to the *front* of the free queue. Called from the scheduler
    side (SpecDecodeScheduler._verified): only the scheduler changes blocks."""
    table = seq.block_table
    keep = table.num_blocks_for(seq.num_computed_tokens)
    for block_id in reversed(table.block_ids[keep:]):
        ref_count = block_manager.block_pool.free_block(block_id, front=True)
        if block_manager.observers:
            block_manager.observers.publish(BlockFreed(seq.seq_id, block_id, ref_count))
    del table.block_ids[keep:]


def slot_plans(work: list[tuple[Sequence, int]], drafts: list[list[int]],
               num_lookahead_tokens: int) -> list[tuple[list[list[int]], list[int]]]:
    """What to ask the block manager for, best first, as (drafts, slots past its own
    tokens) per sequence: the drafts plus the draft model's lookahead for a sequence
    that samples, then the drafts only. A plan that asks for no extra slot is left out:
    the plan without speculation is the base scheduler's, tried last."""
    lookahead = [num_lookahead_tokens if s.num_computed_tokens + n >= s.num_tokens else 0 for s, n in work]
    plans = []
    for extra in ([len(d) + x for d, x in zip(drafts, lookahead)], [len(d) for d in drafts]):
        if any(extra) and extra not in [p[1] for p in plans]:
            plans.append((drafts, extra))
    return plans


@dataclass
class SpecDecodingStats:
    """Counts of speculative decoding so far (vLLM's SpecDecodingStats).

    Attributes:
        num_drafts: verify steps (a sequence checking its drafts in one forward).
        num_draft_tokens: drafts proposed and checked.
        num_accepted_tokens: drafts the model agreed with.
        num_accepted_tokens_per_pos: how often the draft at position i was accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0..1; 0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verify step of one sequence."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_accepted_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_accepted_tokens - len(self.num_accepted_tokens_per_pos))
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1


class SpecDecodeScheduler(Scheduler):
    """The scheduler with speculative decoding's draft slots and rollback (see the module doc).

    Attributes:
        spec_token_ids: seq_id -> the drafts proposed to follow its tokens (vLLM v1's
            Request.spec_token_ids), verified by its next decode step; no entry: none.
            Set from each step's output, used up by take_drafts, dropped when it is
            preempted (they were proposed for a state it loses) and when it leaves.
        scheduled_drafts: seq_id -> the drafts it verifies in the step being scheduled
            (vLLM v1's scheduled_spec_decode_tokens; emptied as each schedule() starts).
        spec_decoding_stats: SpecDecodingStats of every verify step so far.
    """

    scheduler_output_cls = SpecDecodeSchedulerOutput

    def __init__(self, config: EngineConfig, block_manager: BlockManager, **kwargs) -> None:
        super().__init__(config, block_manager, **kwargs)
        self.speculative_config = config.speculative_config
        self.num_lookahead_tokens = config.speculative_config.num_lookahead_tokens
        self.spec_decoding_stats = SpecDecodingStats()
        self.spec_token_ids: dict[int, list[int]] = {}
        self.scheduled_drafts: dict[int, list[int]] = {}
        self._taken_back: dict[int, int] = {}     # seq_id -> blocks rolled back since its last message

    def schedule(self) -> SpecDecodeSchedulerOutput:
        self.scheduled_drafts = {}
        return super().schedule()

    def _request_removed(self, group: SequenceGroup) -> None:
        super()._request_removed(group)
        for seq in group.seqs:
            self.spec_token_ids.pop(seq.seq_id, None)
            self._taken_back.pop(seq.seq_id, None)

    def _append_slots(self, work: list[ScheduledSequence], ends: list[int], step: ScheduledStep) -> list | None:
        """A decode also verifies its drafts (take_drafts), with slots for them and the
        lookahead if they fit (slot_plans); else the base's plan, without them."""
        plain = [(w.seq, w.num_new_tokens) for w in work]
        drafts = take_drafts(work[0].seq_group, plain, self.spec_token_ids, step.budget - sum(n for _, n in plain),
                             self.max_model_len, self._num_tokens_allowed)
        for drafts, extra in slot_plans(plain, drafts, self.num_lookahead_tokens):
            copies = self.block_manager.append_slots([w.seq for w in work], [e + x for e, x in zip(ends, extra)])
            if copies is not None:
                for w, d in zip(work, drafts):
                    w.num_new_tokens += len(d)
                    if d:
                        self.scheduled_drafts[w.seq.seq_id] = d
                return copies
        return super()._append_slots(work, ends, step)

    def _allocate(self, group: SequenceGroup, computed: ComputedBlocks, first_end: int) -> list[int] | None:
        """A prompt that completes also gets the draft model's lookahead slots, if they fit."""
        if self.num_lookahead_tokens and first_end == group.seqs_to_compute()[0].num_tokens:
            starts = self.block_manager.allocate(group, computed, first_end + self.num_lookahead_tokens)
            if starts is not None:
                return starts
        return super()._allocate(group, computed, first_end)

    def _preempt(self, group: SequenceGroup, step: ScheduledStep) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self.spec_token_ids.pop(seq.seq_id, None)       # proposed for a state it loses
        super()._preempt(group, step)

    def _after_schedule(self, step: ScheduledStep, samples: list[bool], out: SpecDecodeSchedulerOutput) -> None:
        """The drafts each sequence verifies, and the blocks rolled back since a sequence's
        last message (num_blocks_taken_back: for cached deltas that append). The drafts
        go in first: the features inside read them (structured outputs' mask rows)."""
        out.scheduled_spec_decode_tokens = {seq_id: list(d) for seq_id, d in self.scheduled_drafts.items()}
        super()._after_schedule(step, samples, out)
        appended = {i for i, replaced in zip(out.scheduled_cached_reqs.seq_ids,
                                             out.scheduled_cached_reqs.block_ids_replaced) if not replaced}
        for s in step.scheduled:
            n = self._taken_back.pop(s.seq.seq_id, 0)
            if n and s.seq.seq_id in appended:
                out.num_blocks_taken_back[s.seq.seq_id] = n

    def _scheduled_event(self, s: ScheduledSequence) -> SequenceScheduled:
        event, drafts = super()._scheduled_event(s), self.scheduled_drafts.get(s.seq.seq_id)
        return dataclasses.replace(event, kind="verify", spec_token_ids=tuple(drafts)) if drafts else event

    def _computed(self, seq: Sequence, group: SequenceGroup, start: int, n: int,
                  scheduler_output: SpecDecodeSchedulerOutput, runner_output: SpecDecodeModelRunnerOutput,
                  result: EngineCoreOutputs) -> None:
        # the positions of rejected drafts are not computed: rolled back here
        rejected = (len(scheduler_output.scheduled_spec_decode_tokens.get(seq.seq_id, ()))
                    - runner_output.num_accepted_tokens.get(seq.seq_id, 0))
        super()._computed(seq, group, start, n - rejected, scheduler_output, runner_output, result)

    def _append_tokens(self, seq: Sequence, group: SequenceGroup, tokens: list[int],
                       scheduler_output: SpecDecodeSchedulerOutput, runner_output: SpecDecodeModelRunnerOutput,
                       result: EngineCoreOutputs) -> None:
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(seq.seq_id, [])
        accepted = drafts[:runner_output.num_accepted_tokens.get(seq.seq_id, 0)]
        super()._append_tokens(seq, group, accepted + tokens, scheduler_output, runner_output, result)

    def _after_update(self, scheduler_output: SpecDecodeSchedulerOutput, runner_output: SpecDecodeModelRunnerOutput,
                      starts: dict[int, int], result: EngineCoreOutputs) -> None:
        """Verify: count drafts, name the accepted tokens' blocks, roll back; keep the new proposals."""
        super()._after_update(scheduler_output, runner_output, starts, result)
        spec, seqs = scheduler_output.scheduled_spec_decode_tokens, self.queues.seqs
        for seq_id in scheduler_output.num_scheduled_tokens:
            if seq_id in seqs and (seq_id in spec or self.num_lookahead_tokens):
                self._verified(*seqs[seq_id], starts[seq_id], spec.get(seq_id, []), runner_output)
        for seq_id, drafts in runner_output.draft_token_ids.items():
            if seq_id in seqs and seqs[seq_id][0].status == SequenceStatus.RUNNING:
                self.spec_token_ids[seq_id] = list(drafts)     # for its next step

    def _verified(self, seq: Sequence, group: SequenceGroup, start: int, drafts: list[int],
                  runner_output: SpecDecodeModelRunnerOutput) -> None:
        """After seq's tokens are appended: count its drafts, name the blocks its accepted
        tokens filled (only now are they known), and take back the blocks that hold only
        rejected slots or lookahead (free_slots_past_computed)."""
        if drafts:
            accepted = runner_output.num_accepted_tokens.get(seq.seq_id, 0)
            self.spec_decoding_stats.observe(len(drafts), accepted)
            if self.observers:
                self.observers.publish(DraftsVerified(group.request_id, seq.seq_id, start, tuple(drafts), accepted,
                                                      seq.num_computed_tokens))
        if seq.status != SequenceStatus.RUNNING:
            return                                # finished: its blocks are freed already
        self.block_manager.cache_full_blocks(seq, start, seq.num_computed_tokens)
        held = len(seq.block_table.block_ids)
        free_slots_past_computed(self.block_manager, seq)
        if held > len(seq.block_table.block_ids):
            self._taken_back[seq.seq_id] = self._taken_back.get(seq.seq_id, 0) + held - len(seq.block_table.block_ids)
