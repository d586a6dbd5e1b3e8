"""PipelineScheduler: the scheduler when up to pipeline_parallel_size batches are in
flight at once (pipeline parallelism, PipelineEngineCore).

The rule: a request (all its sequences, forks and beams) is never in two in-flight
batches. It is scheduled in a batch, then left out of every schedule (running, swapped
or waiting) until that batch's output is taken in, so its tokens and grammar are
current whenever it is scheduled and the outputs of batches in order give the same
tokens as one batch at a time. A batch is a stage's worth of work for other requests
meanwhile (the pipeline's micro-batches). As with async scheduling, nothing is
scheduled behind a batch that forks n > 1 samples or advances beams until its output is
in (`can_schedule_ahead`): a preemption meanwhile would leave its forks nothing to share.

Built on AsyncScheduler (a step's tokens count as computed when it is scheduled), but
with the base RunnerView: only the last stage samples, so the scheduler sends each
sampled token to every stage in the next message (vLLM v1 does the same with PP).
vLLM v1: `vllm/v1/core/sched/scheduler.py` (`use_pp`: new_token_ids sent to the workers
in the cached requests) and `vllm/v1/engine/core.py` (`step_with_batch_queue`).
"""
from __future__ import annotations

from collections import Counter, deque
from contextlib import contextmanager

from ..messages import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from .async_scheduler import AsyncScheduler
from .runner_view import RunnerView
from .scheduler_output import ScheduledStep
from .sequence import Sequence, SequenceGroup


class PipelineScheduler(AsyncScheduler):
    """AsyncScheduler that keeps a request out of two in-flight batches (module doc).

    Attributes:
        in_flight_batches: seq ids of each batch scheduled and not yet taken in, oldest
            first (its scheduled sequences and the forks sampling from them).
    """

    runner_view_cls = RunnerView       # the first stage never sees samples: they are sent

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._batches: dict[int, tuple[tuple[int, ...], tuple[str, ...]]] = {}   # id(out) -> (seq ids, requests)
        self._in_flight: Counter[str] = Counter()       # request_id -> batches in flight (0 or 1)

    @property
    def in_flight_batches(self) -> list[list[int]]:
        return [list(seq_ids) for seq_ids, _ in self._batches.values()]

    def is_in_flight(self, request_id: str) -> bool:
        """Is a batch with this request in flight?"""
        return self._in_flight[request_id] > 0

    def _schedulable(self, seq: Sequence, group: SequenceGroup) -> bool:
        return not self.is_in_flight(group.request_id) and super()._schedulable(seq, group)

    def _schedule_swapped(self, step: ScheduledStep) -> None:
        with self._until_in_flight("swapped"):
            super()._schedule_swapped(step)

    def _schedule_waiting(self, step: ScheduledStep) -> None:
        with self._until_in_flight("waiting"):
            super()._schedule_waiting(step)

    @contextmanager
    def _until_in_flight(self, name: str):
        """The queue `name` cut before its first request in flight (one preempted while
        its batch runs): it and those behind it wait (first come, first served)."""
        queue = getattr(self.queues, name)
        cut = next((i for i, g in enumerate(queue) if self.is_in_flight(g.request_id)), len(queue))
        rest = deque(queue[i] for i in range(cut, len(queue)))
        setattr(self.queues, name, deque(queue[i] for i in range(cut)))
        try:
            yield
        finally:
            getattr(self.queues, name).extend(rest)

    def _after_schedule(self, step: ScheduledStep, samples: list[bool], out: SchedulerOutput) -> None:
        """A batch with sequences is in flight from now on (an empty one is not a batch)."""
        super()._after_schedule(step, samples, out)
        if not step.scheduled:
            return
        requests = tuple(dict.fromkeys(s.seq_group.request_id for s in step.scheduled))
        self._batches[id(out)] = (tuple(out.num_scheduled_tokens), requests)
        self._in_flight.update(requests)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Take in a batch's output (the oldest in flight); its requests may run again."""
        try:
            return super().update_from_output(scheduler_output, runner_output)
        finally:
            self._taken_in(scheduler_output)

    def reset_after_failure(self, lost: list[SchedulerOutput]) -> None:
        """The batches in `lost` produced nothing: their requests go back to waiting
        (AsyncScheduler.reset_after_failure) and are no longer in flight."""
        for so in lost:
            self._taken_in(so)
        super().reset_after_failure(lost)

    def _taken_in(self, scheduler_output: SchedulerOutput) -> None:
        _, requests = self._batches.pop(id(scheduler_output), ((), ()))
        self._in_flight.subtract(requests)
        self._in_flight += Counter()         # drops the zeros
