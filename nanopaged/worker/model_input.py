"""ModelInput: the tensors of one forward pass, built by ModelRunner.prepare_inputs.

vLLM: the inputs `vllm/v1/worker/gpu_model_runner.py` prepares (`_prepare_inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.attention import AttentionMetadata


@dataclass
class ModelInput:
    """The tensors of one forward pass.

    Attributes:
        input_ids: [num_tokens] int64, the new tokens of all sequences, end to end.
        positions: [num_tokens] int64, each token's position in its sequence.
        attn_metadata: slot_mapping, block_tables, seq_lens, query_start_loc.
        logits_indices: [num_sampled] int64, the hidden rows sampled from (a fork's row
            repeats its parent's).
        sampled_seq_ids: seq_id of each of those rows.
        prompt_logprob_rows: seq_id -> (first hidden row, number of rows, first position)
            of the sequences that want prompt logprobs of this step's tokens.
        seq_ids: the scheduled sequences, in the batch's order (decodes first).
    A feature that needs more subclasses it (ModelRunner.model_input_cls).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_seq_ids: list[int]
    prompt_logprob_rows: dict[int, tuple[int, int, int]]
    seq_ids: list[int] = field(default_factory=list)
