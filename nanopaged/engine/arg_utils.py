"""The engine's configuration, resolved once before anything starts.

`create_engine_config` finds the model (model_loader.resolve_model: a local folder, a hub
id, or the default model converted once), reads its config, fills in what the user left
to the engine (EngineConfig.resolve) and checks that the model splits over
tensor_parallel_size (llama.check_tensor_parallel), before any process or thread starts.
Everything after it takes the frozen result whole: the Processor, the EngineCore (in
this process or its own), the workers. vLLM: `vllm/engine/arg_utils.py`,
EngineArgs.create_engine_config.
"""
from __future__ import annotations

from pathlib import Path

from ..config import EngineConfig
from ..model.llama import LlamaConfig, check_tensor_parallel
from ..model.model_loader import resolve_model


def create_engine_config(config: EngineConfig) -> tuple[EngineConfig, Path, LlamaConfig]:
    """(the resolved config, the model's local folder, its LlamaConfig).

    Raises:
        ValueError: as EngineConfig.resolve, model_loader.resolve_model and
            llama.check_tensor_parallel (a model that does not split over
            tensor_parallel_size).
    """
    model_path = resolve_model(config.model)
    model_config = LlamaConfig.from_pretrained(model_path)
    resolved = config.resolve(model_config.max_position_embeddings)
    check_tensor_parallel(model_config, resolved.tensor_parallel_size)
    return resolved, model_path, model_config
