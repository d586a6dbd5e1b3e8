"""PipelineEngineCore: the engine core with up to pipeline_parallel_size batches in
flight (pipeline parallelism).

With pp stages, one batch at a time would leave all but one stage idle. So the core
keeps a queue of batches sent to the workers and not yet taken in (vLLM v1's batch
queue, `max_concurrent_batches` = pp):

    while len(queue) < pp and the scheduler has work:      # fill the pipe
        queue.append(executor.execute_model(scheduler.schedule(), non_blocking=True))
    oldest = queue.popleft()                                # outputs in order
    return scheduler.update_from_output(oldest.scheduler_output, oldest.result())

Each step() returns one batch's outputs. PipelineScheduler keeps a request out of two
batches in flight, so each batch sees its requests' latest tokens and grammar state: a
step with structured outputs builds its masks right after the schedule and sends
`sample_tokens` right behind its `execute_model` (a rank handles its messages in order).
A schedule with no tokens is no batch, but its block moves and finished ids reach the
runners in order all the same. A batch's number is its execute_model's call id, which
each stage also reports while it works on it (stage_progress, for the dashboard).
vLLM v1: `EngineCore.step_with_batch_queue` and `max_concurrent_batches` in
`vllm/v1/engine/core.py`; the executor's `non_blocking` in
`vllm/v1/executor/multiproc_executor.py`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..messages import EngineCoreOutputs, SchedulerOutput
from ..async_sched.engine_core import AsyncEngineCore


@dataclass
class _Batch:
    """A schedule sent to the workers (counts toward the queue unless `is_batch` is False)."""

    scheduler_output: SchedulerOutput
    future: object                   # of execute_model: a ModelRunnerOutput, or None
    sampling: object | None = None   # of sample_tokens, when its rows sample with masks
    is_batch: bool = True            # False: no tokens (block moves or finished ids only)

    def result(self):
        """Wait for the batch's ModelRunnerOutput; raises what its step raised."""
        output = self.future.result()
        return output if output is not None or self.sampling is None else self.sampling.result()


class PipelineEngineCore(AsyncEngineCore):
    """EngineCore with a queue of up to max_concurrent_batches batches in flight (module doc).

    Attributes:
        max_concurrent_batches: config.parallel_config.pipeline_parallel_size.
        batch_queue: the batches sent and not yet taken in, oldest first.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_concurrent_batches = self.config.parallel_config.pipeline_parallel_size
        self.batch_queue: deque[_Batch] = deque()
        self.max_batches_in_flight = 0          # the most seen at once (tests, the bench)

    @property
    def num_batches_in_flight(self) -> int:
        return sum(b.is_batch for b in self.batch_queue)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a batch is in flight."""
        return super().has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        """The outputs of the oldest batch in flight, after filling the queue (empty when
        nothing is in flight). An exception in a batch propagates from here; the requests
        of every batch in flight then go back to waiting (_recover_batches)."""
        try:
            self._fill_queue()
            while self.batch_queue and not self.batch_queue[0].is_batch:
                self.batch_queue[0].result()            # block moves only: done in order
                self.batch_queue.popleft()
            if not self.batch_queue:
                return EngineCoreOutputs()
            oldest = self.batch_queue[0]
            runner_output = oldest.result()
        except BaseException:
            self._recover_batches()
            raise
        self.batch_queue.popleft()
        self.num_steps += 1
        return self.scheduler.update_from_output(oldest.scheduler_output, runner_output)

    def _fill_queue(self) -> None:
        """Schedule and send batches while fewer than max_concurrent_batches are in flight."""
        while (self.num_batches_in_flight < self.max_concurrent_batches and self.scheduler.has_unfinished_requests()
               and (not self.batch_queue or self.scheduler.can_schedule_ahead())):
            so = self.scheduler.schedule()
            if so.total_num_scheduled_tokens == 0:
                if so.blocks_to_copy or so.blocks_to_swap_out or so.blocks_to_swap_in or so.finished_seq_ids:
                    self.batch_queue.append(_Batch(so, self.executor.execute_model(so, non_blocking=True),
                                                   is_batch=False))
                return                                  # every request is in flight (or waits for blocks)
            batch = _Batch(so, self.executor.execute_model(so, non_blocking=True))
            self.batch_queue.append(batch)
            call = self._deferred_sampling(so)          # masks from the grammars as they are now
            if call is not None:
                batch.sampling = call(non_blocking=True)
            self.max_batches_in_flight = max(self.max_batches_in_flight, self.num_batches_in_flight)

    def _recover_batches(self) -> None:
        """A batch raised (or the wait was interrupted): wait for the others, then send the
        requests of every batch in flight back to waiting (AsyncScheduler.reset_after_failure)."""
        lost = []
        while self.batch_queue:
            batch = self.batch_queue.popleft()
            for future in (batch.future, batch.sampling):
                try:
                    if future is not None and getattr(self.executor, "dead_reason", None) is None:
                        future.result()
                except BaseException:
                    pass                    # the batch is lost either way
            if batch.is_batch:
                lost.append(batch.scheduler_output)
        self.scheduler.reset_after_failure(lost)

    def stage_progress(self) -> tuple[list[tuple[int, str] | None], dict[int, tuple[int, ...]]] | None:
        """What each stage reports (MultiprocExecutor.stage_progress: per stage (batch,
        state), or None for one on another host) and the batches in flight by number
        (batch -> seq ids, as PipelineScheduler.in_flight_batches); None when the
        executor keeps no board."""
        read = getattr(self.executor, "stage_progress", None)
        reports = None if read is None else read()
        if reports is None:
            return None
        return reports, {b.future.call_id: tuple(b.scheduler_output.num_scheduled_tokens)
                         for b in self.batch_queue if b.is_batch}

    def get_stats(self) -> dict[str, int | float]:
        """EngineCore.get_stats plus the batch queue: batches in flight now, and the most at once."""
        return {**super().get_stats(), "num_batches_in_flight": self.num_batches_in_flight,
                "max_batches_in_flight": self.max_batches_in_flight}
