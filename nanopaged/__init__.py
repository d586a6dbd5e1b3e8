"""nanopaged: a small, readable LLM inference engine with vLLM's core ideas.

Start at chapters/00-overview.md. The public API mirrors vLLM's offline one:

    from nanopaged import LLM, SamplingParams
"""
from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
