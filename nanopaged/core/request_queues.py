"""RequestQueues: the scheduler's books: every request it holds, which queue it is in,
and how it leaves.

A request (a SequenceGroup) sits in one queue until all its sequences finish:

    waiting   not started, or preempted by recompute (arrival order)
    running   has device blocks (arrival order: preemption takes the tail)
    swapped   preempted by swap: its blocks are in the CPU pool

A finished sequence frees its blocks at once, even while its siblings run on; the
request leaves once all have finished. What moves requests between the queues each
step is the Scheduler's (scheduler.py), which holds one of these.
vLLM v1: `vllm/v1/core/sched/request_queue.py`, the add/finish half of its scheduler.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from ..events import Observers, RequestAdded, RequestFinished
from ..messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from ..utils.math_utils import cdiv
from .block_manager import BlockManager
from .runner_view import RunnerView
from .sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


class RequestQueues:
    """The requests and their queues.

    Args:
        on_remove: called with each request that leaves the books (the Scheduler's
            _request_removed), after it left.

    Attributes:
        requests: request_id -> SequenceGroup, for every request not yet removed.
        seqs: seq_id -> (Sequence, SequenceGroup), for the same requests.
        waiting, running, swapped: the three queues.
    """

    def __init__(self, block_manager: BlockManager, runner_view: RunnerView, observers: Observers,
                 on_remove: Callable[[SequenceGroup], None] | None = None) -> None:
        self.block_manager = block_manager
        self.runner_view = runner_view
        self.observers = observers
        self.on_remove = on_remove
        self.requests: dict[str, SequenceGroup] = {}
        self.seqs: dict[int, tuple[Sequence, SequenceGroup]] = {}
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.finished_in_schedule: list[SequenceGroup] = []    # by finish_too_long

    def add(self, request: EngineCoreRequest, make_group: Callable[[EngineCoreRequest], SequenceGroup]) -> None:
        """A new request: make_group(request) joins the tail of waiting.

        Raises:
            ValueError: request_id in use; a prompt needing more blocks than the whole pool.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        bs, pool = self.block_manager.block_size, self.block_manager.num_gpu_blocks
        num_prompt = len(request.prompt_token_ids)
        if cdiv(num_prompt, bs) > pool:
            raise ValueError(f"prompt of {num_prompt} tokens needs {cdiv(num_prompt, bs)} KV blocks of {bs} "
                             f"tokens, but the KV cache holds only {pool} blocks ({pool * bs} tokens)")
        group = make_group(request)
        self.requests[group.request_id] = group
        self.seqs.update((s.seq_id, (s, group)) for s in group.seqs)
        self.waiting.append(group)
        if self.observers:
            self.observers.publish(RequestAdded(request.request_id, tuple(s.seq_id for s in group.seqs), num_prompt))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add_running(self, group: SequenceGroup) -> None:
        """Into running, kept in arrival order (one back from swap or recompute may be older)."""
        if self.running and group.arrival_time < self.running[-1].arrival_time:
            self.running = deque(sorted([*self.running, group], key=lambda g: g.arrival_time))
        else:
            self.running.append(group)

    def abort(self, request_ids) -> None:
        """Finish requests wherever they are and remove them; unknown ids are ignored."""
        for rid in request_ids:
            group = self.requests.get(rid)
            if group is not None:
                for seq in group.seqs:
                    self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
                self.remove(group)

    def stop(self, seqs: list[tuple[str, int]]) -> None:
        """Finish (request_id, index) sequences "stop" (a stop string matched); unknown ones are ignored."""
        for rid, index in seqs:
            group = self.requests.get(rid)
            if group is not None:
                self.finish_seq(group.seqs[index], SequenceStatus.FINISHED_STOPPED)
                if group.is_finished():
                    self.remove(group)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Free seq's blocks (first: its status says which pool), then finish it with status."""
        self.block_manager.free(seq)
        if not seq.status.is_finished:
            seq.status = status
        self.runner_view.finished(seq.seq_id)

    def finish_too_long(self, group: SequenceGroup) -> None:
        """A request that cannot fit even with the pool to itself finishes ("length"),
        rather than block the FCFS queue forever."""
        logger.warning("request %r needs more KV blocks than the whole pool has (%d blocks "
                       "of %d tokens); finishing it with finish_reason='length'",
                       group.request_id, self.block_manager.num_gpu_blocks, self.block_manager.block_size)
        for seq in group.seqs:
            self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
        self.finished_in_schedule.append(group)

    def remove(self, group: SequenceGroup) -> None:
        """A request whose sequences all finished leaves every queue and the books."""
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        del self.requests[group.request_id]
        for seq in group.seqs:
            del self.seqs[seq.seq_id]
        if self.on_remove is not None:
            self.on_remove(group)
        if self.observers:
            self.observers.publish(RequestFinished(group.request_id,
                                                   tuple(s.status.finish_reason for s in group.seqs)))

    def remove_finished(self, seq_ids, result: EngineCoreOutputs) -> None:
        """After a step: the requests finish_too_long finished (an output per sequence), and
        seq_ids' requests whose sequences all finished, leave; their ids go to result."""
        for group in self.finished_in_schedule:
            result.outputs += [EngineCoreOutput(group.request_id, s.index, [], finish_reason=FinishReason.LENGTH)
                               for s in group.seqs]
        self.finished_in_schedule, done = [], self.finished_in_schedule
        for group in done + [self.seqs[i][1] for i in seq_ids if i in self.seqs]:
            if group.request_id in self.requests and group.is_finished():
                self.remove(group)
                result.finished_requests.add(group.request_id)
