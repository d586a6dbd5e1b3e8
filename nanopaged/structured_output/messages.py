"""Structured outputs' message: the token masks of a step's constrained rows.

A step with constrained rows samples in a second call (EngineCore._deferred_sampling):
the core makes the masks after the schedule and hands them to the runner's
sample_tokens as a GrammarOutput, registered here to cross hosts (utils/codec.py).
vLLM v1: `vllm/v1/core/sched/output.py` (GrammarOutput).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..utils import codec


@dataclass
class GrammarOutput:
    """The token masks of one step's constrained rows (vLLM v1's GrammarOutput), made
    by the core after the step's schedule (StructuredOutputManager.grammar_bitmask)
    and handed to the runner's sample_tokens.

    Attributes:
        structured_output_seq_ids: the sequence of each row, in the order the runner
            samples them: each constrained sequence that samples this step, then the
            forks that sample from it; a sequence verifying k drafts has k + 1 rows in
            a row, one per position (speculative decoding: structured_output/scheduler.py).
        grammar_bitmask: [len(seq_ids), ceil(vocab_size / 32)] int32 on the CPU; bit j
            of word w is token 32 * w + j, 1 = allowed.
    """

    structured_output_seq_ids: list[int]
    grammar_bitmask: torch.Tensor


codec.register(GrammarOutput)
