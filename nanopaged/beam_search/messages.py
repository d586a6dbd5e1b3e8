"""Beam search's messages: a beam-search request, and a finished hypothesis.

Both are base messages (messages.py) with beam search's fields added. The Processor
sends a BeamSearchRequest (processor.py here); when the search is done the scheduler
sends each kept hypothesis, whole, as a BeamSearchHypothesis (scheduler.py here), which
BeamSearchOutputProcessor turns into the request's completions (output_processor.py
here). They go between the front end and the core only (pickled with the rest of the
core's messages), never to a worker on another host.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..messages import EngineCoreOutput, EngineCoreRequest
from ..sampling_params import BeamSearchParams


@dataclass
class BeamSearchRequest(EngineCoreRequest):
    """EngineCoreRequest of a beam search: its sampling_params are the greedy rows that
    return enough top logprobs to rank every candidate (BeamSearchProcessor).

    Attributes:
        beam_search: the user's BeamSearchParams (beam_width, length_penalty, ...).
    """

    beam_search: BeamSearchParams


@dataclass
class BeamSearchHypothesis(EngineCoreOutput):
    """One finished hypothesis of a beam search, sent whole once the search is done:
    index is its rank (best first), new_token_ids all of its generated tokens.

    Attributes:
        cumulative_logprob: the sum of its tokens' logprobs.
        score: cumulative_logprob / generated_len ** length_penalty.
    """

    cumulative_logprob: float | None = None
    score: float | None = None
