"""Structured outputs, the input side: a spec that does not compile is a ValueError
before the core does any work for the request (llguidance's message, with the position)."""
from __future__ import annotations

from ..engine.processor import Processor
from .manager import validate


class StructuredOutputProcessor(Processor):
    def _check_structured_outputs(self, spec) -> None:
        validate(spec)        # compiles (a few ms)
