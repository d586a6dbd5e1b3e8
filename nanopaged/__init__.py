"""nanopaged: a small, readable LLM inference engine with vLLM's core ideas.

Start at chapters/00-overview.md. The public API mirrors vLLM's offline one:

    from nanopaged import LLM, SamplingParams
"""
from .utils.log import configure_logging

configure_logging()           # progress lines on stderr, as vLLM's (utils/log.py)

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from .lora_request import LoRARequest
from .entrypoints.llm import LLM

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest"]
__version__ = "0.1.0"
