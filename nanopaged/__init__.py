"""nanopaged: a small, readable LLM inference engine with vLLM's core ideas.

Start at chapters/00-overview.md. The public API mirrors vLLM's offline one:

    from nanopaged import LLM, SamplingParams
"""
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
