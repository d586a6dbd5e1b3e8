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

The cap: requests that arrive together would otherwise share one batch for good (the
next schedule finds them all in flight), leaving one batch in flight and pp - 1 stages
idle. So a step schedules at most ceil(demand / pp) sequences, demand being the
sequences that want a token (running, in flight or not, swapped, and the waiting ones
max_num_seqs lets in); the demand then spreads over pp batches. A request counts all its
sequences (n > 1, beams) and is never split; one over the cap runs in a batch of its own;
the token budget still chunks prompts. (vLLM v1 forms its groups the same implicit way;
vllm issues #27462 and #41682.)

Built on AsyncScheduler (a step's tokens count as computed when it is scheduled), but
with the base RunnerView: only the last stage samples, so the scheduler sends each
sampled token to every stage in the next message (vLLM v1 does the same with PP).
vLLM v1: `vllm/v1/core/sched/scheduler.py` (`use_pp`: new_token_ids sent to the workers
in the cached requests) and `vllm/v1/engine/core.py` (`step_with_batch_queue`).
"""
from __future__ import annotations

import itertools
from collections import Counter, deque

from ..messages import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from ..async_sched.scheduler import AsyncScheduler
from ..core.runner_view import RunnerView
from ..core.scheduler_output import ScheduledStep
from ..core.sequence import Sequence, SequenceGroup, SequenceStatus


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
        self._step, self._cap, self._counted = None, 1, (0, 0)   # the step being built, its cap, _used

    @property
    def in_flight_batches(self) -> list[list[int]]:
        return [list(seq_ids) for seq_ids, _ in self._batches.values()]

    def is_in_flight(self, request_id: str) -> bool:
        """Is a batch with this request in flight?"""
        return self._in_flight[request_id] > 0

    def batch_cap(self) -> int:
        """The most sequences one step schedules: ceil(demand / pp), at least 1 (module doc)."""
        running = sum(not self._ends_in_flight(s, g) for g in self.running for s in g.get_seqs(SequenceStatus.RUNNING))
        swapped = sum(len(g.get_seqs(SequenceStatus.SWAPPED)) for g in self.swapped)
        room = max(0, self.config.scheduler_config.max_num_seqs - len(self.running) - len(self.swapped))
        waiting = sum(len(g.get_seqs(SequenceStatus.WAITING)) for g in itertools.islice(self.waiting, room))
        return max(1, -(-(running + swapped + waiting) // self.config.parallel_config.pipeline_parallel_size))

    def _schedule_running(self, step: ScheduledStep) -> None:
        self._step, self._cap, self._counted = step, self.batch_cap(), (0, 0)
        super()._schedule_running(step)

    def _schedulable(self, seq: Sequence, group: SequenceGroup) -> bool:
        return (not self.is_in_flight(group.request_id) and super()._schedulable(seq, group)
                and self._fits_cap(len(group.get_seqs(SequenceStatus.RUNNING))))

    def _fits_cap(self, num_seqs: int) -> bool:
        """May a request of num_seqs sequences join this step's batch? (alone, always)"""
        used = self._used(self._step)
        return used == 0 or used + num_seqs <= self._cap

    def _used(self, step: ScheduledStep) -> int:
        """Sequences in the step's batch so far, forks included (counted once each)."""
        n, used = self._counted
        used += sum(1 + len(s.forks) for s in step.scheduled[n:])
        self._counted = (len(step.scheduled), used)
        return used

    def _schedule_waiting(self, step: ScheduledStep) -> None:
        """Waiting requests join (FCFS) while the cap allows, up to the first one still in
        flight: preempted by recompute while its batch runs, it waits for that batch's
        token (and those behind it wait too). A request swapped out in flight may come
        back in: its blocks move behind its batch on every rank, and _schedulable holds it."""
        rest, ready, used = self.queues.waiting, deque(), self._used(step)
        while rest and not self.is_in_flight(rest[0].request_id):     # O(joining): rest is not walked
            num_seqs = len(rest[0].get_seqs(SequenceStatus.WAITING))
            if used and used + num_seqs > self._cap:
                break
            used += num_seqs
            ready.append(rest.popleft())
        self.queues.waiting = ready
        try:
            super()._schedule_waiting(step)
        finally:
            rest.extendleft(reversed(self.queues.waiting))
            self.queues.waiting = rest

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
