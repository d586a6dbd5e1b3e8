"""Proposer: what the speculative-decoding runner asks of a drafter (n-gram, draft model).

vLLM keeps its proposers side by side in `vllm/v1/spec_decode/` (ngram_proposer.py,
eagle.py, draft_model.py), each with a `propose`; here they share this interface, so the
runner (spec_model_runner.py) never asks which one it holds.
"""
from __future__ import annotations

from ..messages import SchedulerOutput
from ..layers.backends import TorchOps
from ..worker.input_batch import SeqState
from ..worker.model_input import ModelInput


class Proposer:
    """Drafts the next tokens of the sequences that sampled this step."""

    def propose(self, inp: ModelInput, seqs: list[tuple[SeqState, list[int]]]) -> dict[int, list[int]]:
        """Drafts per seq_id, after the step whose input was `inp`. seqs: (the runner's
        record of a sequence, the tokens this step gave it, not yet in the record)."""
        raise NotImplementedError

    def move_blocks(self, ops: TorchOps, so: SchedulerOutput) -> None:
        """The target's KV blocks move (so.blocks_to_swap_out / _swap_in / _copy): move
        the proposer's own KV the same way. Nothing to move by default."""

    def remove_sequence(self, seq_id: int) -> None:
        """Forget what is kept of `seq_id` (it finished, or is sent in full again)."""
