"""The engine's configuration, resolved once before anything starts.

`create_engine_config` finds the model (model_loader.resolve_model: a local folder, a hub
id, or the default model converted once), reads its config, fills in what the user left
to the engine (EngineConfig.resolve) and checks that the model splits over
tensor_parallel_size (llama.check_tensor_parallel), and that a speculative draft model
fits the target (check_draft_model), before any process or thread starts.
Everything after it takes the frozen result whole: the Processor, the EngineCore (in
this process or its own), the workers. vLLM: `vllm/engine/arg_utils.py`,
EngineArgs.create_engine_config.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import EngineConfig
from ..model.llama import LlamaConfig, check_tensor_parallel
from ..model.model_loader import check_model_dir, resolve_model


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
    sc = resolved.speculative_config
    if sc is not None and sc.method == "draft_model":
        draft_path = check_draft_model(sc.model, model_path, model_config, resolved.tensor_parallel_size)
        resolved = replace(resolved, speculative_config=replace(sc, model=str(draft_path)))
    return resolved, model_path, model_config


def check_draft_model(draft, model_path: Path, model_config: LlamaConfig, tensor_parallel_size: int) -> Path:
    """The draft model's local folder, once it is known to fit the target: the same
    vocabulary (size and tokens: the target checks the draft's token ids as its own),
    and heads that split over tensor_parallel_size.

    Raises:
        ValueError: naming speculative_config.model and what differs.
    """
    from transformers import AutoTokenizer

    try:
        draft_path = check_model_dir(draft)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    draft_config = LlamaConfig.from_pretrained(draft_path)
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocab_size {draft_config.vocab_size} differs "
                         f"from the target's {model_config.vocab_size} ({draft_path})")
    if AutoTokenizer.from_pretrained(draft_path).get_vocab() != AutoTokenizer.from_pretrained(model_path).get_vocab():
        raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the target's "
                         f"({draft_path} vs {model_path}): its token ids would mean other text")
    try:
        check_tensor_parallel(draft_config, tensor_parallel_size)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    return draft_path
