"""Shared fixtures of the LoRA tests (a test module imports the ones it uses: a second
conftest.py would shadow tests/conftest.py, which other tests import by name): PEFT
adapters made by peft itself for the tiny Llama (tests/conftest.py's tiny_model_dir),
saved the way PEFT ships them.

- lora_adapters: three adapters with random A and B (init_lora_weights=False), of
  different ranks and target sets, as {name: LoRARequest}:
    "attn"  r=4, alpha 8, q/k/v/o only (attention only)
    "mlp"   r=8, alpha 16, use_rslora, gate/up/down and q
    "all"   r=6, alpha 3, every projection (a rank that pads to max_lora_rank)
- make_adapter(folder, model, **lora_config): one more, for a test's own model.
- bad_adapter(name, edit, after): a copy of "attn", changed.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanopaged import LoRARequest

ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]),
    "all": dict(r=6, lora_alpha=3, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]),
}


def make_adapter(folder, model, seed: int = 0, **lora_config):
    """Save a peft LoRA adapter of `model` (a transformers model, changed in place: give
    a fresh one) in `folder`, its A and B random (init_lora_weights=False: B is not zero,
    so the adapter changes the output). Returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_config))
    peft_model.save_pretrained(folder)
    return peft_model


def fresh_llama(folder):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


_MADE: dict[str, dict[str, LoRARequest]] = {}      # made once per process, whichever module asks


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    if str(tiny_model_dir) not in _MADE:
        adapters = {}
        for i, (name, config) in enumerate(ADAPTERS.items()):
            folder = tmp_path_factory.mktemp(f"lora-{name}")
            make_adapter(folder, fresh_llama(tiny_model_dir), seed=i, **config)
            adapters[name] = LoRARequest(name, i + 1, str(folder))
        _MADE[str(tiny_model_dir)] = adapters
    return _MADE[str(tiny_model_dir)]


@pytest.fixture
def bad_adapter(lora_adapters, tmp_path):
    """bad_adapter(name, edit, after=None) -> the folder of a copy of adapter "attn" in
    which edit(config dict, tensors dict) changed what is written, then after(folder)
    changed the files themselves."""
    from safetensors.torch import load_file, save_file

    def make(name: str, edit=None, after=None) -> str:
        folder = tmp_path / name
        shutil.copytree(lora_adapters["attn"].lora_path, folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(folder / "adapter_model.safetensors")
        if edit is not None:
            edit(config, tensors)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, folder / "adapter_model.safetensors")
        if after is not None:
            after(folder)
        return str(folder)
    return make
