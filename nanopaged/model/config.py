"""What the engine needs to know about a model, read from its Hugging Face config.json.

One dataclass for every family (model/registry.py lists them): the families differ in a
few layers of code, not in the shape of their configs. `architecture` (config.json's
`architectures[0]`) picks the model class. vLLM keeps the same facts on its
`ModelConfig` (`vllm/config/model.py`: get_head_size, get_num_kv_heads,
get_sliding_window), read from transformers' PretrainedConfig; we parse the JSON
ourselves so that `import nanopaged` stays light.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .registry import check_architecture

# config.json's `model_type` -> the architecture, for configs without `architectures`
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class ModelConfig:
    """The fields of a Hugging Face config.json that the engine needs.

    Attributes:
        head_dim: per-head size (config.json's name; the engine calls it head_size, as
            vLLM does). Qwen3 sets it explicitly (128 with hidden_size 1024 and 16 heads);
            otherwise hidden_size // num_attention_heads.
        rope_scaling: None, or a dict with "rope_type" ("linear", "llama3") and its fields.
        eos_token_id: every id that ends a sequence (config.json's int or list).
        architecture: the class config.json names (`architectures[0]`), a key of
            registry.MODELS.
        sliding_window: the attention window in tokens (Mistral-7B-v0.1: 4096), or None
            for full attention. The engine does not implement windowed attention: it
            keeps max_model_len <= sliding_window, where the window never cuts anything
            (engine/arg_utils.py).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: list[int]
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "ModelConfig":
        """Read `folder/config.json`.

        Raises:
            FileNotFoundError: no config.json (the message names the path).
            ValueError: an architecture the registry does not have (named, with the
                supported ones), or options the families here do not run (named).
        """
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(folder)!r}")
        c = json.loads(path.read_text())
        archs = c.get("architectures") or [_MODEL_TYPES.get(c.get("model_type"))]
        if archs[0] is None:
            raise ValueError(f"{path}: no 'architectures', and model_type={c.get('model_type')!r} is not one of "
                             f"{sorted(_MODEL_TYPES)}")
        try:
            check_architecture(archs[0])
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act={c['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
        for key in ("attention_bias", "mlp_bias"):
            if c.get(key):
                raise ValueError(f"{path}: {key}={c[key]!r} is not supported "
                                 "(Qwen2's q/k/v bias is, by its architecture)")
        # transformers >= 5 keeps rope settings in `rope_parameters`; older ones in
        # `rope_theta` + `rope_scaling`. Accept both.
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            field = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
            raise ValueError(f"{path}: {field}.rope_type={rope_type!r} is not supported "
                             "(supported: default, linear, llama3)")
        heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            architecture=archs[0], sliding_window=_sliding_window(c),
        )


def _sliding_window(c: dict) -> int | None:
    """The window a config really uses: Mistral's `sliding_window` when set; Qwen2/Qwen3
    carry one too but use it only with `use_sliding_window`, and transformers 5's
    `layer_types` says per layer ("sliding_attention" or "full_attention") when present."""
    window = c.get("sliding_window")
    if window is None:
        return None
    if c.get("layer_types"):
        used = "sliding_attention" in c["layer_types"]
    else:
        used = c.get("use_sliding_window", True)
    return int(window) if used else None
