"""Beam search, the input side: a BeamSearchParams runs as beam_width greedy rows that
return enough top logprobs to rank every candidate (num_candidates), in a
BeamSearchRequest (messages.py here) that carries the BeamSearchParams to the core."""
from __future__ import annotations

import dataclasses

from ..engine.processor import Processor
from ..messages import EngineCoreRequest
from ..sampling_params import BeamSearchParams, SamplingParams
from .messages import BeamSearchRequest
from .scheduler import num_candidates


class BeamSearchProcessor(Processor):
    def process_inputs(self, request_id: str, prompt, params, **kwargs) -> tuple[EngineCoreRequest, str | None]:
        """Processor.process_inputs; a BeamSearchParams' request is a BeamSearchRequest."""
        request, text = super().process_inputs(request_id, prompt, params, **kwargs)
        if isinstance(params, BeamSearchParams):
            fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
            request = BeamSearchRequest(**fields, beam_search=params)
        return request, text

    def _beam_sampling_params(self, beam: BeamSearchParams) -> SamplingParams:
        return SamplingParams(n=beam.beam_width, temperature=0, max_tokens=beam.max_tokens,
                              ignore_eos=beam.ignore_eos,
                              logprobs=num_candidates(beam.beam_width, self.eos_token_ids))
