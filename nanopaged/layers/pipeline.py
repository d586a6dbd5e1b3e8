"""Pipeline parallelism (GPipe, Huang et al. 2019): the layers split into `pp_size`
consecutive stages, one per rank, and what passes between them.

Stage `pp_rank` holds layers `get_pp_indices(num_layers, pp_rank, pp_size)`. The first
stage also embeds the tokens; the last also runs the final norm, the LM head and the
sampler. Between two stages travels one message per step, `IntermediateTensors`: the
hidden states and the residual stream of every token of the batch (a Llama layer takes
and returns both: model/llama.py). Unlike tensor parallelism (layers/parallel.py) a
stage talks only to its neighbours, by point-to-point send/recv, once per step.

With tensor parallelism as well, the ranks form a grid of tp_size x pp_size, tp inner
(vLLM's layout): global rank = pp_rank * tp_size + tp_rank. A stage's tp ranks form
one TPGroup; the ranks with the same tp_rank form one pipeline, and rank r of a stage
sends to rank r of the next.

vLLM: `vllm/distributed/utils.py` (get_pp_indices), `vllm/sequence.py`
(IntermediateTensors), `vllm/distributed/parallel_state.py` (send_tensor_dict,
recv_tensor_dict, the group layout in initialize_model_parallel).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..utils.checks import check_int
from .parallel import TPGroup


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of stage pp_rank out of pp_size (vLLM's rule).

    Each stage gets num_layers // pp_size; the remainder goes one layer each to the
    second-to-last stage, then the one before it, and so on: never to the last stage,
    which also runs the norm, the LM head and sampling. E.g. 22 layers over 4 stages
    -> 5, 6, 6, 5; 5 over 3 -> 2, 2, 1; 4 over 3 -> 1, 2, 1.

    Raises:
        ValueError: pp_size > num_layers (a stage would hold no layer), or a rank or
            size that is not an integer in range (the message names both numbers).
    """
    check_int("num_hidden_layers", num_layers, minimum=1, rule="a positive integer")
    check_int("pipeline_parallel_size", pp_size, minimum=1, rule="a positive integer")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's num_hidden_layers={num_layers}: "
                         "every stage needs at least one layer")
    if not (isinstance(pp_rank, int) and 0 <= pp_rank < pp_size):
        raise ValueError(f"pp_rank={pp_rank!r} must be an integer in [0, {pp_size})")
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


@dataclass
class IntermediateTensors:
    """What one stage hands the next for one step (vLLM's name).

    Attributes:
        hidden_states: [num_tokens, hidden_size], the model dtype: the output of the
            stage's last layer (its MLP), not yet added to the residual.
        residual: [num_tokens, hidden_size], the same dtype: the residual stream that
            output adds to (the next layer's fused add + RMSNorm does the add).
    Rows are the step's tokens in the batch's order (ModelRunner.prepare_inputs).
    """

    hidden_states: torch.Tensor
    residual: torch.Tensor


class PPGroup:
    """This rank's place in its pipeline, and the send/recv to its neighbours.

    Args:
        rank: this rank's stage, pp_rank, 0 <= rank < size.
        size: stages in the pipeline (1: the whole model, nothing is sent).
        process_group: a torch.distributed ProcessGroup of the pipeline's ranks, in
            stage order (its rank i is stage i; gloo on the CPU, NCCL on CUDA); None when
            size is 1.
        prev_rank, next_rank: global ranks of the previous and next stage's rank with
            the same tp_rank (None at the ends); for logs and errors.
        device: where received tensors are put.

    Attributes (for the bench):
        send_seconds: wall time blocked in send, seconds (waiting for the send before
            to complete: the next stage had not taken it yet).
        recv_seconds: wall time blocked in recv, seconds: the time this stage waited
            for the one before it (the pipeline bubble, with the time that stage ran).
        bytes_sent: bytes of IntermediateTensors sent.
        num_hops: messages sent.
    """

    def __init__(self, rank: int = 0, size: int = 1, process_group=None, *, prev_rank: int | None = None,
                 next_rank: int | None = None, device: torch.device | str = "cpu") -> None:
        if size > 1 and process_group is None:
            raise ValueError(f"PPGroup of size {size} needs a process_group")
        self.rank, self.size, self.process_group = rank, size, process_group
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.device = torch.device(device)
        self.send_seconds = self.recv_seconds = 0.0
        self.bytes_sent = self.num_hops = 0
        self._in_transit = None          # (work, tensor) of the last send, until it completes

    @property
    def is_first_rank(self) -> bool:
        """Whether this stage embeds the tokens (it receives nothing)."""
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        """Whether this stage computes logits and samples (it sends nothing)."""
        return self.rank == self.size - 1

    def send(self, tensors: IntermediateTensors) -> None:
        """Send `tensors` to the next stage: one [2, num_tokens, hidden_size] tensor
        (hidden_states, residual stacked), so one hop is one message. Returns once the
        send before it has completed, not this one: the stage goes on to its next batch
        while the next stage is still busy with the one before (vLLM's isend_tensor_dict).

        Raises:
            RuntimeError: this is the last stage, or the transport failed (a peer that
                died: gloo's and NCCL's own errors, after the group's timeout).
        """
        if self.is_last_rank:
            raise RuntimeError(f"stage {self.rank} of {self.size} is the last: it has no next stage to send to")
        start = time.perf_counter()
        message = torch.stack([tensors.hidden_states, tensors.residual])
        self.wait_sent()
        self._in_transit = (self.process_group.send([message], self.rank + 1, 0), message)
        self.send_seconds += time.perf_counter() - start
        self.bytes_sent += message.numel() * message.element_size()
        self.num_hops += 1

    def wait_sent(self) -> None:
        """Wait until the last send has completed (raises its transport error, if any)."""
        if self._in_transit is not None:
            work, self._in_transit = self._in_transit[0], None
            work.wait()

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> IntermediateTensors:
        """Receive the previous stage's IntermediateTensors of num_tokens rows of
        hidden_size, in dtype (both sides know the shape from the step's message).

        Raises:
            RuntimeError: this is the first stage, or the transport failed.
        """
        if self.is_first_rank:
            raise RuntimeError(f"stage 0 of {self.size} is the first: it has no previous stage to receive from")
        start = time.perf_counter()
        message = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=self.device)
        self.process_group.recv([message], self.rank - 1, 0).wait()
        self.recv_seconds += time.perf_counter() - start
        return IntermediateTensors(message[0], message[1])

    def stats(self) -> dict[str, float]:
        """The counters, by name (Worker.get_comm_stats)."""
        return {"pp_send_seconds": self.send_seconds, "pp_recv_seconds": self.recv_seconds,
                "pp_bytes_sent": self.bytes_sent, "pp_num_hops": self.num_hops}


def make_parallel_groups(rank: int, tp_size: int, pp_size: int, world_group=None, *,
                         device: torch.device | str = "cpu") -> tuple[TPGroup, PPGroup]:
    """This rank's TPGroup and PPGroup in a grid of tp_size x pp_size ranks, tp inner.

    Every rank must call it (torch.distributed.new_group is called by all ranks for
    every group, in the same order: torch's rule), after init_process_group. A group
    that is the whole world reuses `world_group`; a group of one rank needs none.

    Args:
        rank: this global rank, pp_rank * tp_size + tp_rank.
        tp_size, pp_size: the grid; the world is tp_size * pp_size ranks.
        world_group: the ProcessGroup of all ranks (None when there is one rank).
        device: where PPGroup.recv puts the tensors.

    Raises:
        ValueError: a size that is not a positive integer, or rank outside the grid.
    """
    check_int("tensor_parallel_size", tp_size, minimum=1, rule="a positive integer")
    check_int("pipeline_parallel_size", pp_size, minimum=1, rule="a positive integer")
    world = tp_size * pp_size
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank={rank!r} must be in [0, {world}) for tensor_parallel_size={tp_size} x "
                         f"pipeline_parallel_size={pp_size}")
    pp_rank, tp_rank = divmod(rank, tp_size)
    stages = [list(range(p * tp_size, (p + 1) * tp_size)) for p in range(pp_size)]     # each stage's tp ranks
    pipelines = [list(range(t, world, tp_size)) for t in range(tp_size)]                 # each tp_rank's stages
    tp_group = _own_group(stages, pp_rank, world, world_group)
    pp_group = _own_group(pipelines, tp_rank, world, world_group)
    tp = TPGroup(tp_rank, tp_size, tp_group)
    pp = PPGroup(pp_rank, pp_size, pp_group, device=device,
                 prev_rank=rank - tp_size if pp_rank > 0 else None,
                 next_rank=rank + tp_size if pp_rank < pp_size - 1 else None)
    return tp, pp


def _own_group(groups: list[list[int]], mine: int, world: int, world_group):
    """The ProcessGroup of groups[mine], after every rank made every group of them."""
    if len(groups[0]) == 1:
        return None
    if len(groups[0]) == world:
        return world_group
    import torch.distributed as dist

    made = [dist.new_group(ranks) for ranks in groups]       # every rank, every group, same order
    return made[mine]
