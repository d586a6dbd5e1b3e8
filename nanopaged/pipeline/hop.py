"""The hop between two pipeline stages: what stage r hands stage r + 1 for one step, and
the point-to-point send / recv that carries it (GPipe, Huang et al. 2019).

Between two stages travels one message per step, `IntermediateTensors`: the hidden
states and the residual stream of every token of the batch (a Llama layer takes and
returns both: model/llama.py). Unlike tensor parallelism (layers/parallel.py) a stage
talks only to its neighbours, once per step, over its pipeline's process group
(the PPGroup of layers/groups.py, whose counters `send` and `recv` keep).

vLLM: `vllm/sequence.py` (IntermediateTensors), `vllm/distributed/parallel_state.py`
(send_tensor_dict, recv_tensor_dict).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..layers.groups import PPGroup


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


def send(pp: PPGroup, tensors: IntermediateTensors) -> None:
    """Send `tensors` to the next stage: one [2, num_tokens, hidden_size] tensor
    (hidden_states, residual stacked), so one hop is one message. Returns once the send
    before it has completed, not this one: the stage goes on to its next batch while the
    next stage is still busy with the one before (vLLM's isend_tensor_dict). Counts the
    time blocked, the bytes and the hop on `pp`.

    Raises:
        RuntimeError: this is the last stage, or the transport failed (a peer that died:
            gloo's and NCCL's own errors, after the group's timeout).
    """
    if pp.is_last_rank:
        raise RuntimeError(f"stage {pp.rank} of {pp.size} is the last: it has no next stage to send to")
    start = time.perf_counter()
    message = torch.stack([tensors.hidden_states, tensors.residual])
    wait_sent(pp)
    pp.in_transit = (pp.process_group.send([message], pp.rank + 1, 0), message)
    pp.send_seconds += time.perf_counter() - start
    pp.bytes_sent += message.numel() * message.element_size()
    pp.num_hops += 1


def wait_sent(pp: PPGroup) -> None:
    """Wait until the last send has completed (raises its transport error, if any)."""
    if pp.in_transit is not None:
        work, pp.in_transit = pp.in_transit[0], None
        work.wait()


def recv(pp: PPGroup, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> IntermediateTensors:
    """Receive the previous stage's IntermediateTensors of num_tokens rows of
    hidden_size, in dtype (both sides know the shape from the step's message). Counts
    the time blocked on `pp`.

    Raises:
        RuntimeError: this is the first stage, or the transport failed.
    """
    if pp.is_first_rank:
        raise RuntimeError(f"stage 0 of {pp.size} is the first: it has no previous stage to receive from")
    start = time.perf_counter()
    message = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=pp.device)
    pp.process_group.recv([message], pp.rank - 1, 0).wait()
    pp.recv_seconds += time.perf_counter() - start
    return IntermediateTensors(message[0], message[1])
