"""ScheduledSequence and ScheduledStep: the scheduler's own record of the step it builds.

`Scheduler.schedule()` fills a ScheduledStep phase by phase (running, swapped, waiting):
one ScheduledSequence per sequence in the batch, with the tokens it computes and what
changed in its block table, plus the step's block copies and swaps. Nothing here is
sent: RunnerView.message (runner_view.py) turns the finished step into the
SchedulerOutput message (messages.py), and the tracer gets each ScheduledSequence as a
SequenceScheduled event. Reads sequences, writes none of them.
vLLM v1: the per-step bookkeeping of `vllm/v1/core/sched/scheduler.py` (`schedule`),
whose message is `vllm/v1/core/sched/output.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..events import SequenceScheduled
from .sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSequence:
    """One sequence in this step's batch: the scheduler's own record (never sent).

    Attributes:
        seq, seq_group: the sequence and its request.
        num_new_tokens: tokens computed for it this step, from seq.num_computed_tokens.
        forks: sequences that sample from seq's last row this step (the other n - 1
            samples of a fresh request); they fork seq's blocks once it is done.
        num_blocks_before: blocks it held before this step's slots were added.
        table_replaced: copy-on-write replaced its last block this step.
    """

    seq: Sequence
    seq_group: SequenceGroup
    num_new_tokens: int
    forks: list[Sequence] = field(default_factory=list)
    num_blocks_before: int = 0
    table_replaced: bool = False

    def samples(self, num_pending: int = 0) -> bool:
        """Whether the step samples a token for seq: it computes seq's last position (a
        prompt's last chunk, or a decode), counting the num_pending tokens that steps
        scheduled before will sample (Scheduler._num_pending_tokens). Asked before the
        step's tokens are counted as computed."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens >= seq.num_tokens + num_pending

    def event(self) -> SequenceScheduled:
        """This record as the tracer's SequenceScheduled event (taken before the step
        runs, while num_computed_tokens is still the sequence's start)."""
        seq, start = self.seq, self.seq.num_computed_tokens
        decode = self.num_new_tokens == 1 and seq.output_token_ids and start == seq.num_tokens - 1
        return SequenceScheduled(self.seq_group.request_id, seq.seq_id, "decode" if decode else "prefill", start,
                                 self.num_new_tokens, tuple(f.seq_id for f in self.forks))


@dataclass
class ScheduledStep:
    """What schedule() has decided so far this step: the token budget left, the batch,
    and the block copies and swaps the runner must do before the forward.

    Attributes:
        budget: tokens the step may still compute (max_num_batched_tokens at first; can
            go negative once a request that alone exceeds it runs in a step of its own).
        scheduled: the batch, in the order the phases added it.
        preempted: someone was preempted this step (then nobody is admitted or
            swapped in).
        blocks_to_copy, blocks_to_swap_out, blocks_to_swap_in: (src, dst) block pairs.
    """

    budget: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: bool = False
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    def add(self, s: ScheduledSequence) -> None:
        """Put s in the batch; its tokens come out of the budget."""
        self.scheduled.append(s)
        self.budget -= s.num_new_tokens
