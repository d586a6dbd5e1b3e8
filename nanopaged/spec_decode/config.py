"""Speculative decoding, at start: a draft model is checked against the target once,
when the engine's config is resolved (engine/arg_utils.create_engine_config calls
`resolve_draft` through features.py), and its folder found."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import EngineConfig
from ..engine.arg_utils import find_model, is_gguf_file
from ..model.config import ModelConfig
from ..model.llama import check_tensor_parallel
from ..model.model_loader import check_model_dir


def resolve_draft(config: EngineConfig, model_path: Path, model_config: ModelConfig) -> EngineConfig:
    """config with speculative_config.model the draft's local folder (method
    "draft_model"; n-gram lookup: config itself). A .gguf draft runs as GGUF, as the model
    would (is_gguf_file).

    Raises:
        ValueError: naming speculative_config.model and what differs (check_draft_model).
    """
    sc = config.speculative_config
    if sc.method != "draft_model":
        return config
    if sc.quantization is None and is_gguf_file(sc.model):
        sc = replace(sc, quantization="gguf")
    draft_path = check_draft_model(sc.model, model_path, model_config, config.parallel_config.tensor_parallel_size, sc.quantization)
    return replace(config, speculative_config=replace(sc, model=str(draft_path)))


def check_draft_model(draft, model_path: Path, model_config: ModelConfig, tensor_parallel_size: int,
                      quantization: str | None = None) -> Path:
    """The draft model's local folder, once it fits the target: the same vocabulary
    (the target checks the draft's ids as its own) and heads that split over
    tensor_parallel_size. With quantization="gguf" (speculative_config.quantization),
    `draft` is a .gguf file or a folder holding one, and the folder returned is
    gguf_loader.gguf_model_dir's for it.

    Raises:
        ValueError: naming speculative_config.model and what differs.
    """
    from transformers import AutoTokenizer

    try:
        draft_path = (find_model(draft, EngineConfig(quantization="gguf")) if quantization == "gguf"
                      else check_model_dir(draft))
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    draft_config = ModelConfig.from_pretrained(draft_path)
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


