"""Beam search, the input side: a BeamSearchParams runs as beam_width greedy rows that
return enough top logprobs to rank every candidate (num_candidates)."""
from __future__ import annotations

from ..engine.processor import Processor
from ..sampling_params import BeamSearchParams, SamplingParams
from .scheduler import num_candidates


class BeamSearchProcessor(Processor):
    def _beam_sampling_params(self, beam: BeamSearchParams) -> SamplingParams:
        return SamplingParams(n=beam.beam_width, temperature=0, max_tokens=beam.max_tokens,
                              ignore_eos=beam.ignore_eos,
                              logprobs=num_candidates(beam.beam_width, self.eos_token_ids))
