"""LoRA adapters as PEFT ships them: a folder with adapter_config.json and
adapter_model.safetensors, read and checked here.

LoRA (Hu et al. 2021) adds a low-rank product to a frozen projection W [out, in]:

    y = x W^T + scaling * (x A^T) B^T        A: [r, in], B: [out, r]

with scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (Kalajdzievski
2023). PEFT stores A and B per layer and projection under names such as
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. The engine serves plain
LoRA on the seven projections of a Llama-style layer; an adapter that asks for anything
else (DoRA, biases, extra trained modules, per-module ranks, the embedding or the head,
...) is refused by name, as is a missing, misshapen, non-finite or unexpected tensor.
The weights are read from safetensors only: a pickled adapter_model.bin is never loaded.
vLLM: `vllm/lora/models.py` (LoRAModel.from_local_checkpoint), `vllm/lora/peft_helper.py`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import torch

from ..utils.checks import is_int, is_real

CONFIG_NAME, WEIGHTS_NAME, PICKLE_NAME = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
# the projections an adapter may target, and the block of the decoder layer each sits in
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# adapter_config.json fields that change the math, and the values under which the adapter
# is plain LoRA (PEFT writes these defaults); anything else is refused with the reason
PLAIN = {
    "peft_type": (("LORA",), "only LoRA adapters are served"),
    "use_dora": ((False, None), "DoRA's magnitude vectors are not served"),
    "bias": (("none", None), "trained biases are not served"),
    "lora_bias": ((False, None), "a bias on lora_B is not served"),
    "fan_in_fan_out": ((False, None), "Llama-style projections store W as [out, in]"),
    "modules_to_save": ((None, []), "fully trained modules beside the adapter are not served"),
    "rank_pattern": (({}, None), "per-module ranks are not served"),
    "alpha_pattern": (({}, None), "per-module alphas are not served"),
    "layers_pattern": ((None, "layers", ["layers"]), "the decoder layers are `model.layers`"),
    "exclude_modules": ((None, []), "excluded modules are not served"),
    "target_parameters": ((None, []), "adapters on raw parameters are not served"),
    "trainable_token_indices": ((None,), "trained embedding rows are not served"),
    "layer_replication": ((None,), "replicated layers are not served"),
    "alora_invocation_tokens": ((None,), "activated LoRA is not served"),
    "use_qalora": ((False, None), "QA-LoRA is not served"),
    "use_bdlora": ((False, None), "block-diagonal LoRA is not served"),
    "arrow_config": ((None,), "Arrow routing is not served"),
}


class LoRAAdapterError(ValueError):
    """An adapter folder the engine cannot serve; the message names the file and the field
    or tensor."""


@dataclass
class LoRAAdapter:
    """One adapter's weights, as stored (float32, bfloat16 or float16).

    Attributes:
        rank: r; scaling: lora_alpha / r (or / sqrt(r) with use_rslora).
        weights: (layer index, projection name) -> (A [r, in], B [out, r]) for every
            projection it targets in the layers read.
    """

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def peft_tensor_name(layer: int, module: str, half: str) -> str:
    """PEFT's name of a target's A or B (half "A" or "B") in adapter_model.safetensors."""
    return f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}.lora_{half}.weight"


def projection_shapes(model_config) -> dict[str, tuple[int, int]]:
    """Projection name -> (in, out) features of the whole model (tensor-parallel rank 1)."""
    c, d = model_config, model_config.head_dim
    return {"q_proj": (c.hidden_size, c.num_attention_heads * d), "k_proj": (c.hidden_size, c.num_key_value_heads * d),
            "v_proj": (c.hidden_size, c.num_key_value_heads * d), "o_proj": (c.num_attention_heads * d, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}


@dataclass(frozen=True)
class AdapterSpec:
    """What adapter_config.json says: rank, scaling, and the (layer, projection) pairs it targets."""

    rank: int
    scaling: float
    targets: frozenset[tuple[int, str]]


def read_adapter_config(folder: Path, num_layers: int, max_lora_rank: int) -> AdapterSpec:
    """The checked adapter_config.json of `folder`.

    Raises:
        LoRAAdapterError: the file is missing or not a JSON object; a field of PLAIN is not
            plain LoRA; r missing, not an int >= 1 or above max_lora_rank; lora_alpha not a
            finite number; use_rslora not a bool; target_modules not a list of TARGET_MODULES
            (or "all-linear"); layers_to_transform outside [0, num_layers).
    """
    path = folder / CONFIG_NAME
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter {str(folder)!r} has no {CONFIG_NAME}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}")

    def bad(field: str, why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{str(path)!r}: {field}={config.get(field)!r}: {why}")

    for field, (allowed, why) in PLAIN.items():
        if config.get(field) not in allowed:
            raise bad(field, why)
    r = config.get("r")
    if not is_int(r) or r < 1:
        raise bad("r", "the rank must be an int >= 1")
    if r > max_lora_rank:
        raise bad("r", f"more than the engine's max_lora_rank={max_lora_rank}")
    alpha, rslora = config.get("lora_alpha", 8), config.get("use_rslora", False)
    if not is_real(alpha):
        raise bad("lora_alpha", "must be a finite number")
    if not isinstance(rslora, bool):
        raise bad("use_rslora", "must be true or false")
    return AdapterSpec(r, alpha / (math.sqrt(r) if rslora else r),
                       frozenset((i, m) for i in _layers(config, num_layers, bad) for m in _modules(config, bad)))


def _modules(config: dict, bad) -> list[str]:
    targets = config.get("target_modules")
    if targets == "all-linear":                      # PEFT's word for every projection but the head
        return list(TARGET_MODULES)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise bad("target_modules", f"must be a list of projection names among {list(TARGET_MODULES)}")
    for t in targets:
        name = t.rsplit(".", 1)[-1]
        if any(part.isdigit() for part in t.split(".")):    # PEFT matches a suffix: this one, some layers only
            raise bad("target_modules", f"{t!r} names some layers' modules by path; give the projection's name "
                      f"and layers_to_transform for the layers")
        if name in ("embed_tokens", "lm_head"):
            raise bad("target_modules", f"{t!r}: adapters on the embedding or the LM head are not served")
        if name not in TARGET_MODULES:
            raise bad("target_modules", f"{t!r} is not one of {list(TARGET_MODULES)}")
    return sorted({t.rsplit(".", 1)[-1] for t in targets})


def _layers(config: dict, num_layers: int, bad) -> list[int]:
    layers = config.get("layers_to_transform")
    if layers is None:
        return list(range(num_layers))
    layers = [layers] if is_int(layers) else layers
    if not isinstance(layers, list) or not all(is_int(i) and 0 <= i < num_layers for i in layers):
        raise bad("layers_to_transform", f"must be layer indices in [0, {num_layers})")
    return sorted(set(layers))


def load_adapter(folder, model_config, max_lora_rank: int, layers: Container[int] | None = None) -> LoRAAdapter:
    """Read and check the PEFT adapter in `folder` for a model of `model_config`; only the
    tensors of `layers` (default: all) are read, but every name in the file is checked.

    Raises:
        LoRAAdapterError: as read_adapter_config; no folder; no adapter_model.safetensors
            (a lone adapter_model.bin is refused: it is a pickle); a file safetensors cannot
            read; a tensor that is missing, unexpected, of the wrong shape or dtype, or not
            finite (named).
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter folder {str(folder)!r} does not exist")
    spec = read_adapter_config(folder, model_config.num_hidden_layers, max_lora_rank)
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        pickled = (folder / PICKLE_NAME).is_file()
        raise LoRAAdapterError(f"LoRA adapter {str(folder)!r} has no {WEIGHTS_NAME}" + (
            f" (its {PICKLE_NAME} is a pickle, which is never loaded: save it with safetensors)" if pickled else ""))
    wanted = range(model_config.num_hidden_layers) if layers is None else layers
    try:
        with safe_open(path, framework="pt") as f:
            weights = _read_tensors(f, str(path), spec, projection_shapes(model_config), wanted)
    except SafetensorError as e:
        raise LoRAAdapterError(f"{str(path)!r} is not a readable safetensors file: {e}") from None
    return LoRAAdapter(spec.rank, spec.scaling, weights)


def _read_tensors(f, path: str, spec: AdapterSpec, shapes: dict, wanted: Container[int]) -> dict:
    """(layer, projection) -> (A, B) for the targets in `wanted` layers, from the open
    safetensors file `f`; every target's two tensors checked by name and shape, and no
    other tensor allowed."""
    names, weights = set(f.keys()), {}
    for layer, module in sorted(spec.targets):
        n_in, n_out = shapes[module]
        pair = []
        for half, shape in (("A", (spec.rank, n_in)), ("B", (n_out, spec.rank))):
            name = peft_tensor_name(layer, module, half)
            if name not in names:
                raise LoRAAdapterError(f"{path!r} lacks tensor {name!r} (target_modules and r say it is there)")
            names.discard(name)
            got = tuple(f.get_slice(name).get_shape())
            if got != shape:
                raise LoRAAdapterError(f"{path!r}: tensor {name!r} has shape {got}, expected {shape}")
            if layer in wanted:
                pair.append(_checked(f.get_tensor(name), name, path))
        if pair:
            weights[layer, module] = tuple(pair)
    if names:
        raise LoRAAdapterError(f"{path!r}: unexpected tensor {sorted(names)[0]!r} (not a LoRA A or B of the "
                               "targets adapter_config.json names)")
    return weights


def _checked(t: torch.Tensor, name: str, path: str) -> torch.Tensor:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LoRAAdapterError(f"{path!r}: tensor {name!r} is {t.dtype}, not float32, bfloat16 or float16")
    if not torch.isfinite(t).all():
        raise LoRAAdapterError(f"{path!r}: tensor {name!r} holds NaN or infinite values")
    return t
