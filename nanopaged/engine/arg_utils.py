"""The engine's configuration, resolved once before anything starts.

`create_engine_config` finds the model (model_loader.resolve_model: a local folder, a hub
id, or the default model converted once), reads its config, fills in what the user left
to the engine (EngineConfig.resolve) and checks that the model splits over
tensor_parallel_size (llama.check_tensor_parallel), that max_model_len stays inside a
sliding attention window (max_model_len_limit), and that a speculative draft model fits
the target (check_draft_model), before any process or thread starts.
Everything after it takes the frozen result whole: the Processor, the EngineCore (in
this process or its own), the workers. vLLM: `vllm/engine/arg_utils.py`,
EngineArgs.create_engine_config.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from ..config import EngineConfig
from ..model.config import ModelConfig
from ..model.llama import check_tensor_parallel
from ..model.model_loader import check_model_dir, resolve_model

logger = logging.getLogger(__name__)


def create_engine_config(config: EngineConfig) -> tuple[EngineConfig, Path, ModelConfig]:
    """(the resolved config, the model's local folder, its ModelConfig).

    Raises:
        ValueError: as EngineConfig.resolve, model_loader.resolve_model,
            max_model_len_limit and llama.check_tensor_parallel (a model that does not
            split over tensor_parallel_size).
    """
    model_path = resolve_model(config.model)
    model_config = ModelConfig.from_pretrained(model_path)
    resolved = config.resolve(max_model_len_limit(config, model_config), model_config.vocab_size)
    check_tensor_parallel(model_config, resolved.tensor_parallel_size)
    sc = resolved.speculative_config
    if sc is not None and sc.method == "draft_model":
        draft_path = check_draft_model(sc.model, model_path, model_config, resolved.tensor_parallel_size)
        resolved = replace(resolved, speculative_config=replace(sc, model=str(draft_path)))
    return resolved, model_path, model_config


def max_model_len_limit(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest max_model_len this model can serve exactly, in tokens: its
    max_position_embeddings, or its sliding_window when that is shorter. The engine has
    no windowed attention, so it keeps every sequence inside the window, where the
    window masks nothing (vLLM capped max_model_len the same way for attention backends
    without sliding-window support). max_model_len=None is capped with a log line.

    Raises:
        ValueError: max_model_len set above the sliding window (names both).
    """
    limit, window = model_config.max_position_embeddings, model_config.sliding_window
    if window is None or window >= limit:
        return limit
    if config.max_model_len is None:
        logger.info("%s has sliding_window=%d; max_model_len is capped to it (sliding-window attention "
                    "is not implemented, and inside the window it masks nothing)", model_config.architecture, window)
    elif config.max_model_len > window:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's sliding_window={window}: "
                         f"sliding-window attention is not implemented; use max_model_len <= {window}")
    return window


def check_draft_model(draft, model_path: Path, model_config: ModelConfig, tensor_parallel_size: int) -> Path:
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
