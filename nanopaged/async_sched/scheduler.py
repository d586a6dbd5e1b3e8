"""AsyncScheduler: the scheduler when schedule() runs while the step before is still in
its forward (async scheduling, chapter 16).

A sequence that samples in a step gets a placeholder for that token (the scheduler's
table `num_output_placeholders`, by seq_id, which the base asks through the hook
`_num_pending_tokens`) and its num_computed_tokens counts the step's positions as soon
as it is scheduled, so the next schedule() can give it its next position before the
token is known; update_from_output reconciles (each token taken in uses up one
placeholder). The runner appends its own samples (AsyncRunnerView). After a step that
forks or advances beams the next schedule() waits for its output (`can_schedule_ahead`).
vLLM v1: `vllm/v1/core/sched/async_scheduler.py`.
"""
from __future__ import annotations

from collections import deque

from ..messages import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from ..core.runner_view import RunnerView
from ..core.scheduler import Scheduler
from ..core.scheduler_output import ScheduledStep
from ..core.sequence import Sequence, SequenceGroup, SequenceStatus


class AsyncRunnerView(RunnerView):
    """The runner appends its own samples, so after a step it also knows the tokens that
    step and the steps in flight sample (num_output_placeholders: the scheduler's table,
    which it gives the view)."""

    runner_appends_samples = True
    num_output_placeholders: dict[int, int]

    def known_after(self, seq: Sequence, sample: bool) -> int:
        return seq.num_tokens + self.num_output_placeholders.get(seq.seq_id, 0) + sample


class AsyncScheduler(Scheduler):
    """Scheduler with placeholders for tokens in flight (see the module doc).

    Attributes:
        num_output_placeholders: seq_id -> tokens that steps in flight will sample for it
            and that are not appended yet (1 or 2; vLLM v1's
            Request.num_output_placeholders); no entry: none. Its num_computed_tokens
            already counts the positions those steps compute. Kept across preemption
            (the token in flight still comes), dropped when the request leaves.
    """

    runner_view_cls = AsyncRunnerView

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_output_placeholders: dict[int, int] = {}
        if isinstance(self.runner_view, AsyncRunnerView):     # (the pipeline's is the base's)
            self.runner_view.num_output_placeholders = self.num_output_placeholders
        self._waits_for_output = False      # the last step decides what the next schedule needs

    def _num_pending_tokens(self, seq: Sequence) -> int:
        return self.num_output_placeholders.get(seq.seq_id, 0)

    def _request_removed(self, group: SequenceGroup) -> None:
        super()._request_removed(group)
        for seq in group.seqs:                  # (a step in flight for it: its token is dropped)
            self.num_output_placeholders.pop(seq.seq_id, None)

    def can_schedule_ahead(self) -> bool:
        """May the next schedule() run before the last scheduled step's output is in? Not
        when that step forks n > 1 samples or advances beams (_needs_output_first)."""
        return not self._waits_for_output

    def _schedulable(self, seq: Sequence, group: SequenceGroup) -> bool:
        return not self._ends_in_flight(seq, group) and super()._schedulable(seq, group)

    def _ends_in_flight(self, seq: Sequence, group: SequenceGroup) -> bool:
        """The token a step in flight samples for seq is surely its last (max_tokens or
        max_model_len), so a step for seq would compute a token only to throw it away.
        False when nothing is in flight for seq."""
        k = self.num_output_placeholders.get(seq.seq_id, 0)
        return k > 0 and (len(seq.output_token_ids) + k >= group.sampling_params.max_tokens
                          or seq.num_tokens + k >= self.max_model_len)

    def _may_fit_later(self, group: SequenceGroup) -> bool:
        # a sibling may stop with the token in flight and free its blocks
        return any(s.seq_id in self.num_output_placeholders for s in group.seqs) or super()._may_fit_later(group)

    def _after_schedule(self, step: ScheduledStep, samples: list[bool], out: SchedulerOutput) -> None:
        """The step's tokens count as computed from now on; each sample gets a placeholder."""
        super()._after_schedule(step, samples, out)
        self._waits_for_output = any(sample and self._needs_output_first(s)
                                     for s, sample in zip(step.scheduled, samples))
        placeholders = self.num_output_placeholders
        for s, sample in zip(step.scheduled, samples):
            s.seq.num_computed_tokens += s.num_new_tokens
            for seq in [s.seq, *s.forks] if sample else []:
                placeholders[seq.seq_id] = placeholders.get(seq.seq_id, 0) + 1

    def _count_computed(self, seq: Sequence, n: int) -> None:
        pass                                 # counted when it was scheduled

    def _append_tokens(self, seq: Sequence, group: SequenceGroup, tokens: list[int], scheduler_output: SchedulerOutput,
                       runner_output: ModelRunnerOutput, result: EngineCoreOutputs) -> None:
        # its token is in: one placeholder fewer (a sequence finished meanwhile discards the token)
        left = self.num_output_placeholders.pop(seq.seq_id, 0) - 1
        if left:
            self.num_output_placeholders[seq.seq_id] = left
        super()._append_tokens(seq, group, tokens, scheduler_output, runner_output, result)

    def reset_after_failure(self, lost: list[SchedulerOutput]) -> None:
        """A forward raised, so the steps in `lost` produced nothing and the runner's record
        of their sequences is stale. Each unfinished request they scheduled goes back to
        waiting as a recompute preemption leaves it (blocks freed, nothing computed, no
        placeholder, sent in full next time); its tokens so far are kept.
        tests/engine/test_engine_v1.py::test_c39_an_interrupted_forward_leaves_no_named_block
        checks this with async scheduling on."""
        seqs = self.queues.seqs
        groups = {seqs[i][1] for so in lost for i in (*so.num_scheduled_tokens, *so.sample_from) if i in seqs}
        for group in groups:
            for queue in (self.running, self.swapped, self.waiting):
                if group in queue:
                    queue.remove(group)
            for seq in group.seqs:
                self.num_output_placeholders.pop(seq.seq_id, None)
                self.runner_view.forget(seq.seq_id)
                if not seq.status.is_finished:
                    self.block_manager.free(seq)
                    seq.num_computed_tokens = 0
                    seq.status = SequenceStatus.WAITING
        self.queues.waiting = deque(sorted([*self.waiting, *groups], key=lambda g: g.arrival_time))
        self._waits_for_output = False
