"""StructuredOutputEngineCore: the engine core with structured outputs (chapter 18).

It holds the StructuredOutputManager (which loads the tokenizer on the first
constrained request: llguidance needs each token's bytes) and gives it to the
scheduler. A step with constrained rows samples in a second call, `sample_tokens`, with
the masks the scheduler fills after the schedule (vLLM v1's split of the step).
vLLM v1: `vllm/v1/engine/core.py` (`step`: `get_grammar_bitmask`, `sample_tokens`).
"""
from __future__ import annotations

import functools
from typing import Callable

from .manager import StructuredOutputManager
from ..messages import ModelRunnerOutput, SchedulerOutput
from ..engine.engine_core import EngineCore


class StructuredOutputEngineCore(EngineCore):
    """EngineCore with a StructuredOutputManager and the masked second sampling call.

    Attributes:
        structured_output_manager: the scheduler's (StructuredOutputScheduler).
    """

    def __init__(self, config, model_path, model_config, *args, **kwargs) -> None:
        super().__init__(config, model_path, model_config, *args, **kwargs)
        self.structured_output_manager = StructuredOutputManager(model_path, model_config.vocab_size)
        self.scheduler.structured_output_manager = self.structured_output_manager

    def _deferred_sampling(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput] | None:
        grammar = self.scheduler.get_grammar_bitmask(scheduler_output)     # the masks as they are now
        if grammar is None:                                                # no constrained row samples
            return super()._deferred_sampling(scheduler_output)
        return functools.partial(self.executor.sample_tokens, grammar)
