"""Speculative decoding, the scheduler's side: which drafts a step verifies, the slots
they take, and the counts of what was accepted.

The runner proposes drafts after each step (worker/spec_decode/); they come back in the
ModelRunnerOutput and wait on the sequence (Sequence.spec_token_ids). The scheduler's
next schedule() then gives a decoding sequence 1 + k positions instead of 1: its last
token and the k drafts (`take_drafts`), with slots for all of them (and for the draft
model's own K/V of its next proposals: the lookahead), or fewer when the pool is short
(`slot_plans`: drafts are never worth a preemption). After the forward,
update_from_output rolls num_computed_tokens back past the rejected drafts and takes
back the blocks that held only their slots (Scheduler._verified,
BlockManager.free_slots_past_computed).
vLLM v1: the spec-token half of `vllm/v1/core/sched/scheduler.py` (schedule,
update_from_output, update_draft_token_ids) and `vllm/v1/spec_decode/metrics.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence, SequenceGroup


def take_drafts(group: SequenceGroup, work: list[tuple[Sequence, int]], budget: int,
                max_model_len: int) -> list[list[int]]:
    """The drafts each sequence of `group` verifies this step, from its proposals
    (seq.spec_token_ids, used up here). work: (sequence, tokens it computes this step
    without drafts). Only a decode (1 token) verifies drafts, and they are cut so that
    the step stays within `budget` (the tokens left of the token budget), the sequence
    within max_tokens and max_model_len (a verify step gives it up to k + 1 tokens),
    and, with structured outputs, before the first draft its grammar forbids (a
    proposal the grammar forbids is rejected at its position: vLLM v1 does the same)."""
    drafts = []
    for seq, n in work:
        proposed, seq.spec_token_ids = seq.spec_token_ids, []
        room = min(budget, group.sampling_params.max_tokens - len(seq.output_token_ids) - 1,
                   max_model_len - seq.num_tokens - 1)
        d = proposed[:max(room, 0)] if n == 1 and seq.num_uncomputed_tokens == 1 else []
        if d and seq.grammar is not None:
            d = d[:seq.grammar.validate_tokens(d)]
        budget -= len(d)
        drafts.append(d)
    return drafts


def slot_plans(work: list[tuple[Sequence, int]], drafts: list[list[int]],
               num_lookahead_tokens: int) -> list[tuple[list[list[int]], list[int]]]:
    """What to ask the block manager for, best first, as (drafts, slots past its own
    tokens) per sequence: the drafts plus the draft model's lookahead for a sequence
    that samples; the drafts only; nothing (the plan without speculation, always last).
    The scheduler takes the first that fits."""
    lookahead = [num_lookahead_tokens if s.num_computed_tokens + n >= s.num_tokens else 0 for s, n in work]
    plans = [(drafts, [len(d) + x for d, x in zip(drafts, lookahead)]),
             (drafts, [len(d) for d in drafts]),
             ([[] for _ in work], [0] * len(work))]
    return [p for i, p in enumerate(plans) if i == 2 or p[1] not in [q[1] for q in plans[:i]]]


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
