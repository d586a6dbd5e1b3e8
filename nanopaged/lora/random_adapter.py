"""A random LoRA adapter, written the way PEFT saves one (adapter_config.json and
adapter_model.safetensors), so that the tracer's scenario and the tests that need an
adapter can make one without peft; adapter.py reads it back like any other.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .adapter import CONFIG_NAME, TARGET_MODULES, WEIGHTS_NAME, peft_tensor_name, projection_shapes


def write_random_adapter(folder, model_config, *, rank: int = 4, lora_alpha: float = 8, seed: int = 0,
                         target_modules: tuple[str, ...] = tuple(TARGET_MODULES)) -> Path:
    """Write a rank-`rank` adapter of every layer's `target_modules` into `folder` (made
    if missing), for a model of `model_config`; returns the folder.

    A [r, in] ~ N(0, 1/in) and B [out, r] ~ N(0, 0.01/r) (float32, from `seed`): B is
    not zero, as PEFT's trained adapters' are not, so the adapter changes the output,
    and small, so the output is still the base model's language.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen, shapes, tensors = torch.Generator().manual_seed(seed), projection_shapes(model_config), {}
    for layer in range(model_config.num_hidden_layers):
        for module in target_modules:
            n_in, n_out = shapes[module]
            a = torch.randn(rank, n_in, generator=gen) / math.sqrt(n_in)              # [r, in]
            b = torch.randn(n_out, rank, generator=gen) * 0.1 / math.sqrt(rank)       # [out, r]
            tensors[peft_tensor_name(layer, module, "A")], tensors[peft_tensor_name(layer, module, "B")] = a, b
    save_file(tensors, str(folder / WEIGHTS_NAME))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": lora_alpha,
              "target_modules": list(target_modules), "bias": "none", "use_rslora": False}
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return folder
