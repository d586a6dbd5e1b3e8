"""AsyncEngineCore: the engine core with async scheduling (chapter 16).

The forward runs in a worker thread, and `step()` schedules the next step while it does
(torch releases the GIL in its ops, so the two really run at once):

    ahead = self.scheduler.schedule()               # step t+1, while t's forward runs
    runner_output = <wait for step t's forward>
    <start step t+1's forward>
    return self.scheduler.update_from_output(<step t>, runner_output)   # t+1 runs meanwhile

so step() returns the outputs of the step before (nothing on the first call). When step
t decides something step t+1's schedule depends on (AsyncScheduler.can_schedule_ahead),
t+1 is scheduled after t's output instead.
vLLM v1: `EngineCore.step_with_batch_queue` in `vllm/v1/engine/core.py`.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ..messages import EngineCoreOutputs, SchedulerOutput
from ..engine.engine_core import EngineCore


@dataclass
class _InFlight:
    """A step whose forward was handed to the worker thread."""

    scheduler_output: SchedulerOutput
    future: Future                   # of execute_model: a ModelRunnerOutput, or None
    sampling: Future | None = None   # of the deferred sampling call, if the step has one

    def result(self):
        """Wait for the step's ModelRunnerOutput; raises what its forward raised."""
        output = self.future.result()
        return output if output is not None else self.sampling.result()


class AsyncEngineCore(EngineCore):
    """EngineCore whose forwards run in a worker thread, one step ahead (module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # one worker thread runs the forwards, in the order given
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="nanopaged-forward")
        self._in_flight: _InFlight | None = None

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a forward is in flight."""
        return super().has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """The outputs of the forward before (empty on the first call). An exception in a
        forward propagates from here, and the engine stays usable (_recover)."""
        prev, self._in_flight = self._in_flight, None
        ahead = None
        try:
            if (prev is None or self.scheduler.can_schedule_ahead()) and self.scheduler.has_unfinished_requests():
                ahead = self.scheduler.schedule()      # overlaps prev's forward
            if prev is None:
                self._in_flight = self._submit(ahead)
                self._submit_sampling(self._in_flight)
                return EngineCoreOutputs()
            runner_output = prev.result()
        except BaseException:                          # the forward raised, or Ctrl-C here
            if prev is not None:
                self._recover(prev, ahead)
            raise
        if ahead is not None and ahead.is_empty and not (ahead.blocks_to_copy or ahead.blocks_to_swap_out
                                                         or ahead.blocks_to_swap_in):
            # nothing to compute (every sequence is getting its last token now): the
            # runner forgets what finished here, and no empty forward is left in flight
            self.executor.execute_model(ahead)
            ahead = None
        # ahead's forward starts before prev's output is taken in, so the update and the
        # caller's detokenizing overlap it; only now: its decodes need prev's tokens
        self._in_flight = self._submit(ahead)
        try:
            outputs = self.scheduler.update_from_output(prev.scheduler_output, runner_output)
        finally:
            # ahead's deferred sampling (masks) needs prev's tokens, just read: queued
            # behind ahead's forward (vLLM v1 does the same)
            self._submit_sampling(self._in_flight)
        self.num_steps += 1
        if ahead is None and self.scheduler.has_unfinished_requests():
            # prev decided what this step depends on: scheduled after its output; its
            # forward still overlaps the caller's work on these outputs
            self._in_flight = self._submit(self.scheduler.schedule())
            self._submit_sampling(self._in_flight)
        return outputs

    def shutdown(self) -> None:
        """Let the forward thread finish what it was given, then stop the workers. A step
        may still be in flight when the caller is done (LLM.generate returns once its own
        requests finished), and closing the executor's sockets under the thread's send
        aborted the process (a zmq socket is not thread-safe; seen in CI at tp=2)."""
        self._forward_thread.shutdown(wait=True)
        super().shutdown()

    def _submit(self, scheduler_output: SchedulerOutput | None) -> _InFlight | None:
        if scheduler_output is None:
            return None
        return _InFlight(scheduler_output, self._forward_thread.submit(self.executor.execute_model, scheduler_output))

    def _submit_sampling(self, step: _InFlight | None) -> None:
        """Queue a step's deferred sampling call (EngineCore._deferred_sampling), built now;
        the forward thread runs it after the step's forward."""
        if step is None or step.sampling is not None:
            return
        try:
            call = self._deferred_sampling(step.scheduler_output)
        except BaseException as e:         # the step then fails as a forward would
            step.sampling = Future()
            step.sampling.set_exception(e)
            return
        if call is not None:
            step.sampling = self._forward_thread.submit(call)

    def _recover(self, failed: _InFlight, ahead: SchedulerOutput | None) -> None:
        """The forward of `failed` raised (or the wait was interrupted): wait until the
        worker is idle, carry out what `ahead` (never run) asked besides its forward
        (copies, swaps, finished sequences), then send the requests of both steps back
        to waiting (AsyncScheduler.reset_after_failure)."""
        wait([f for f in (failed.future, failed.sampling) if f is not None])
        if ahead is not None and getattr(self.executor, "dead_reason", None) is None:
            self.executor.execute_model(SchedulerOutput(
                blocks_to_copy=ahead.blocks_to_copy, blocks_to_swap_out=ahead.blocks_to_swap_out,
                blocks_to_swap_in=ahead.blocks_to_swap_in, finished_seq_ids=ahead.finished_seq_ids))
        self.scheduler.reset_after_failure([failed.scheduler_output] + ([ahead] if ahead else []))
