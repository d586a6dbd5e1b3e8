"""Which class runs which model: config.json's `architectures[0]` -> a module of this
folder and the class in it (vLLM: `vllm/model_executor/models/registry.py`).

Each family file holds only what differs from Llama (llama.py):

    MistralForCausalLM  mistral.py  Llama's layers; a sliding window kept out of reach
    Qwen2ForCausalLM    qwen2.py    a bias on q, k and v
    Qwen3ForCausalLM    qwen3.py    RMSNorm on each head of q and k before RoPE

The modules are imported on first use, as vLLM's lazy registry does.
"""
from __future__ import annotations

import importlib

MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def check_architecture(architecture: str) -> None:
    """Raise ValueError naming `architecture` and listing the supported ones unless
    the registry has it."""
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(MODELS)}")


def get_model_class(architecture: str) -> type:
    """The model class for config.json's architecture name.

    Raises:
        ValueError: an architecture not in MODELS (check_architecture).
    """
    check_architecture(architecture)
    module, name = MODELS[architecture]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
