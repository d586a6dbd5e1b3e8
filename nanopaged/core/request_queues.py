"""RequestQueues: the requests a scheduler holds, which queue each is in, and how
they come and go.

A request (a SequenceGroup) is in exactly one of three queues until it leaves:

    waiting   not started, or preempted by recompute (FCFS: arrival order)
    running   has blocks in the device pool (kept in arrival order: preemption
              takes the latest arrival, from the tail)
    swapped   preempted by swap: its blocks are in the CPU pool

`add_request` puts a new one at the tail of `waiting`; a sequence leaves by finishing
(`_finish_seq`: its blocks are freed at once, even while its siblings run on), and a
request leaves every queue and these books once all its sequences have finished
(`_remove`), by stop, length, abort (`abort_requests`) or a stop string
(`stop_sequences`). After a failed forward, `reset_after_failure` puts the requests it
held back in `waiting`; `get_grammar_bitmask` reads their grammars for a step. What
moves requests *between* the queues each step (the three phases, preemption) is the
Scheduler's (scheduler.py), built on this class.
vLLM v1: `vllm/v1/core/sched/request_queue.py` and the add/finish half of
`vllm/v1/core/sched/scheduler.py`.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque

from ..events import RequestAdded, RequestFinished
from ..messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, GrammarOutput,
                        SchedulerOutput)
from ..utils.math_utils import cdiv
from .beam_search import BeamState
from .block_manager import BlockManager
from .runner_view import RunnerView
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class RequestQueues:
    """The scheduler's books: every request it holds and its queue (see the module doc).

    Args:
        block_manager: the device pool's BlockManager (frees what finishes).
        async_scheduling: for the RunnerView (runner_view.py).
        structured_output_manager: compiles the matchers of requests with structured
            outputs; None makes such requests a ValueError at add_request.

    Attributes:
        requests: request_id -> SequenceGroup, for every request not yet removed.
        waiting, running, swapped: the three queues.
        runner_view: what the model runner knows of each sequence (runner_view.py).
    """

    def __init__(self, block_manager: BlockManager, async_scheduling: bool,
                 structured_output_manager: StructuredOutputManager | None) -> None:
        self.block_manager = block_manager
        self.observers = block_manager.observers         # one event stream (events.py)
        self.structured_output_manager = structured_output_manager
        self.requests: dict[str, SequenceGroup] = {}
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()    # kept in arrival order
        self.swapped: deque[SequenceGroup] = deque()    # preempted by swap, arrival order
        self._seqs: dict[int, tuple[Sequence, SequenceGroup]] = {}
        self._seq_ids = itertools.count()
        self.runner_view = RunnerView(async_scheduling)  # what the model runner knows
        self._finished_in_schedule: list[SequenceGroup] = []   # by _finish_too_long

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request as a SequenceGroup of n sequences (beam_width for beams).

        Raises:
            ValueError: request_id already in use; a prompt needing more KV blocks than
                the whole pool; structured outputs that do not compile, or with beam
                search. Nothing is queued then.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        bs, pool = self.block_manager.block_size, self.block_manager.num_gpu_blocks
        num_prompt = len(request.prompt_token_ids)
        if cdiv(num_prompt, bs) > pool:
            raise ValueError(f"prompt of {num_prompt} tokens needs {cdiv(num_prompt, bs)} KV blocks of {bs} "
                             f"tokens, but the KV cache holds only {pool} blocks ({pool * bs} tokens)")
        beam = request.beam_search
        n = beam.beam_width if beam is not None else request.sampling_params.n
        seqs = [Sequence(next(self._seq_ids), i, request.prompt_token_ids, bs) for i in range(n)]
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if beam is not None or self.structured_output_manager is None:
                raise ValueError("structured_outputs work with sampling only, not with beam search"
                                 if beam is not None else "this scheduler has no StructuredOutputManager")
            for seq in seqs:       # each its own matcher: the n samples diverge
                seq.grammar = self.structured_output_manager.grammar_for(constraint, request.eos_token_ids)
        group = SequenceGroup(request, seqs)
        group.beam_state = BeamState(beam) if beam is not None else None
        self.requests[request.request_id] = group
        self._seqs.update((s.seq_id, (s, group)) for s in seqs)
        self.waiting.append(group)
        if self.observers:
            self.observers.publish(RequestAdded(request.request_id, tuple(s.seq_id for s in seqs), num_prompt))

    def has_unfinished_requests(self) -> bool:
        """Some request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def abort_requests(self, request_ids) -> None:
        """Remove requests wherever they are and free their blocks; unknown ids are ignored."""
        for rid in request_ids:
            group = self.requests.get(rid)
            if group is not None:
                for seq in group.seqs:
                    self._finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
                self._remove(group)

    def stop_sequences(self, seqs: list[tuple[str, int]]) -> None:
        """Finish (request_id, index) sequences with finish_reason "stop": a stop string
        matched (the OutputProcessor's finding). Unknown or finished ones are ignored."""
        for rid, index in seqs:
            group = self.requests.get(rid)
            if group is not None:
                self._finish_seq(group.seqs[index], SequenceStatus.FINISHED_STOPPED)
                if group.is_finished():
                    self._remove(group)

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finish seq with `status` (unless it is finished already) and free its blocks:
        first, while its status still says which pool they are in (a SWAPPED one's are
        CPU blocks)."""
        self.block_manager.free(seq)
        if not seq.status.is_finished:
            seq.status = status
        self.runner_view.finished(seq.seq_id)

    def _remove(self, group: SequenceGroup) -> None:
        """A request whose sequences are all finished leaves every queue and the books."""
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        del self.requests[group.request_id]
        for seq in group.seqs:
            del self._seqs[seq.seq_id]
        if self.observers:
            self.observers.publish(RequestFinished(group.request_id,
                                                   tuple(s.status.finish_reason for s in group.seqs)))

    def _add_running(self, group: SequenceGroup) -> None:
        """Keep the running queue in arrival order (preemption takes its tail): a request
        coming back from swap or recompute may be older than ones already running."""
        if self.running and group.arrival_time < self.running[-1].arrival_time:
            self.running = deque(sorted([*self.running, group], key=lambda g: g.arrival_time))
        else:
            self.running.append(group)

    def _finish_too_long(self, group: SequenceGroup) -> None:
        """A request that cannot get its blocks even with the pool to itself will never
        fit: finish it with finish_reason "length". Without this it would sit at the
        head of the waiting queue forever, and FCFS would block everyone behind it."""
        logger.warning("request %r needs more KV blocks than the whole pool has (%d blocks "
                       "of %d tokens); finishing it with finish_reason='length'",
                       group.request_id, self.block_manager.num_gpu_blocks, self.block_manager.block_size)
        for seq in group.seqs:
            self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
        self._finished_in_schedule.append(group)

    def _remove_finished(self, seq_ids, result: EngineCoreOutputs) -> None:
        """After a step: the requests _finish_too_long finished in schedule() (an output
        per sequence, finish_reason "length"), and those of seq_ids' requests whose
        sequences have all finished, leave the books; their ids go into
        result.finished_requests."""
        for group in self._finished_in_schedule:
            result.outputs += [EngineCoreOutput(group.request_id, s.index, [], finish_reason=FinishReason.LENGTH)
                               for s in group.seqs]
        self._finished_in_schedule, done = [], self._finished_in_schedule
        for group in done + [self._seqs[i][1] for i in seq_ids if i in self._seqs]:
            if group.request_id in self.requests and group.is_finished():
                self._remove(group)
                result.finished_requests.add(group.request_id)

    def reset_after_failure(self, lost: list[SchedulerOutput]) -> None:
        """Async scheduling: a forward raised, so the steps in `lost` (it and any step
        scheduled after it) produced nothing, and the runner's record of their sequences
        is stale. Each unfinished request they scheduled goes back to the waiting queue
        as a recompute preemption would leave it: blocks freed, num_computed_tokens 0,
        no placeholder, sent to the runner in full when it runs again. Its tokens so far
        are kept, and no block was named (C39), so it goes on as if nothing happened."""
        seq_ids = {i for so in lost for i in (*so.num_scheduled_tokens, *so.sample_from)}
        groups = {self._seqs[i][1] for i in seq_ids if i in self._seqs}
        for group in groups:
            for queue in (self.running, self.swapped, self.waiting):
                if group in queue:
                    queue.remove(group)
            for seq in group.seqs:
                seq.num_output_placeholders = 0
                self.runner_view.forget(seq.seq_id)
                if not seq.status.is_finished:
                    self.block_manager.free(seq)
                    seq.num_computed_tokens = 0
                    seq.status = SequenceStatus.WAITING
        self.waiting = deque(sorted([*self.waiting, *groups], key=lambda g: g.arrival_time))

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput:
        """The token masks of the constrained rows of a scheduled step, from their
        matchers as they are now. Call it once every step before this one has been taken
        in (update_from_output): with async scheduling that is after the forward of
        this step has started, so the mask is filled while the forward runs (vLLM v1)."""
        grammars = {}
        for seq_id in scheduler_output.structured_output_seq_ids:
            seq = self._seqs.get(seq_id, (None,))[0]
            grammars[seq_id] = seq.grammar if seq is not None and not seq.status.is_finished else None
        return self.structured_output_manager.grammar_bitmask(scheduler_output, grammars)
