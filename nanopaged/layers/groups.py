"""The ranks' grid: tp_size x pp_size ranks, tp inner (vLLM's layout), global rank =
pp_rank * tp_size + tp_rank. A stage's tp ranks form one TPGroup (layers/parallel.py);
the ranks with the same tp_rank form one pipeline of pp_size stages, and rank r of a
stage passes its hidden states to rank r of the next.

Stage `pp_rank` holds layers `get_pp_indices(num_layers, pp_rank, pp_size)`: the first
stage also embeds the tokens, the last also runs the final norm, the LM head and the
sampler. `PPGroup` is a rank's place in its pipeline; with one stage (pp_size 1, the
base engine) it holds the whole model and nothing passes between ranks. What a stage
sends the next, and how, is pipeline parallelism's (chapter 20).

vLLM: `vllm/distributed/utils.py` (get_pp_indices), `vllm/distributed/parallel_state.py`
(the group layout in initialize_model_parallel).
"""
from __future__ import annotations

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


class PPGroup:
    """This rank's place in its pipeline, and the counters of what it sent and waited for.

    Args:
        rank: this rank's stage, pp_rank, 0 <= rank < size.
        size: stages in the pipeline (1: the whole model, nothing is sent).
        process_group: a torch.distributed ProcessGroup of the pipeline's ranks, in
            stage order (its rank i is stage i; gloo on the CPU, NCCL on CUDA); None when
            size is 1.
        prev_rank, next_rank: global ranks of the previous and next stage's rank with
            the same tp_rank (None at the ends); for logs and errors.
        device: where received tensors are put.

    Attributes (the bench's; `stats` reports them):
        send_seconds: wall time blocked in sends, seconds.
        recv_seconds: wall time blocked in receives, seconds: the time this stage waited
            for the one before it.
        bytes_sent: bytes sent to the next stage.
        num_hops: messages sent.
        in_transit: the last send still on its way (its work handle and tensor), or None.
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
        self.in_transit = None

    @property
    def is_first_rank(self) -> bool:
        """Whether this stage embeds the tokens (it receives nothing)."""
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        """Whether this stage computes logits and samples (it sends nothing)."""
        return self.rank == self.size - 1

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
        device: where the PPGroup's received tensors are put.

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
