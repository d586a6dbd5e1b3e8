"""StructuredOutputModelRunner: the runner's side of structured outputs (chapter 18).

A step with constrained rows (a row it samples is of a sequence whose SamplingParams have
structured_outputs: the runner's record says so, the message need not) is split in two
calls, as in vLLM v1: execute_model runs the forward and returns None; the core makes
the rows' token masks meanwhile (it noted the same rows when it scheduled the step:
scheduler.py here) and calls sample_tokens(GrammarOutput), which samples with them
(sampler.apply_grammar_bitmask). vLLM: `GPUModelRunner.sample_tokens`.
"""
from __future__ import annotations

import torch

from ..messages import ModelRunnerOutput, SchedulerOutput
from ..worker.logits_chunks import compute_logits_rows
from ..worker.model_input import ModelInput
from ..worker.model_runner import ModelRunner
from .messages import GrammarOutput


class StructuredOutputModelRunner(ModelRunner):
    """ModelRunner whose steps with constrained rows wait for their masks."""

    _pending = None      # (so, ModelInput, hidden, output) of a step awaiting sample_tokens
    _masks = None        # (sampled row of each mask row, bitmask [num_masks, words]) while sampling

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """ModelRunner.execute_model; None when the step's constrained rows wait for
        sample_tokens."""
        self._pending = None
        return super().execute_model(so)

    def _sample_step(self, so: SchedulerOutput, inp: ModelInput, hidden: torch.Tensor,
                     out: ModelRunnerOutput) -> ModelRunnerOutput | None:
        seqs = self.input_batch.seqs
        if all(seqs[seq_id].sampling_params.structured_outputs is None for seq_id in inp.sampled_seq_ids):
            return super()._sample_step(so, inp, hidden, out)
        self._pending = (so, inp, hidden, out)
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """Sample the step execute_model left waiting, each constrained row masked.

        Raises:
            RuntimeError: no step is waiting for its masks.
        """
        if self._pending is None:
            raise RuntimeError("sample_tokens: execute_model left no step waiting for its grammar bitmask")
        (so, inp, hidden, out), self._pending = self._pending, None
        rows_of: dict[int, list[int]] = {}       # a verifying sequence has k + 1 rows, in order
        for i, seq_id in enumerate(inp.sampled_seq_ids):
            rows_of.setdefault(seq_id, []).append(i)
        rows = [rows_of[i].pop(0) for i in grammar_output.structured_output_seq_ids]
        self._masks = (rows, grammar_output.grammar_bitmask.to(self.device))
        try:
            return super()._sample_step(so, inp, hidden, out)
        finally:
            self._masks = None

    def _compute_logits(self, hidden: torch.Tensor, inp: ModelInput, rows: list[int]) -> torch.Tensor:
        return compute_logits_rows(self.model, hidden, inp.logits_indices, rows, self._masks)
