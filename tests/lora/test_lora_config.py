"""The LoRA settings (config.py's LoRAConfig, vLLM's names): defaults, refusals by field
name, the flags, and the feature's place in the composition (features.py)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from nanopaged import EngineConfig
from nanopaged.config import LoRAConfig
from nanopaged.engine.arg_utils import add_cli_args, engine_kwargs
from nanopaged.features import Composition


def test_lora_is_off_by_default_and_vllms_defaults_when_on():
    assert EngineConfig().lora_config is None
    lc = EngineConfig(enable_lora=True).lora_config
    assert (lc.max_lora_rank, lc.max_loras, lc.max_cpu_loras, lc.num_cpu_loras) == (16, 1, None, 1)
    config = EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=5, max_lora_rank=8)
    assert config.lora_config == LoRAConfig(max_lora_rank=8, max_loras=2, max_cpu_loras=5)
    assert dataclasses.replace(config, block_size=8).lora_config == config.lora_config
    assert dataclasses.replace(config, max_loras=3).lora_config.max_loras == 3
    assert dataclasses.replace(config, enable_lora=False).lora_config is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_loras=2), ["max_loras=2", "enable_lora=True"]),
    (dict(enable_lora=1), ["enable_lora must be a bool"]),
    (dict(enable_lora=True, max_loras=0), ["max_loras must be a positive integer"]),
    (dict(enable_lora=True, max_lora_rank=2.5), ["max_lora_rank"]),
    (dict(enable_lora=True, max_loras=3, max_cpu_loras=2), ["max_cpu_loras", "max_loras=3"]),
    (dict(enable_lora=True, tensor_parallel_size=2), ["enable_lora", "tensor_parallel_size=2"]),
    (dict(enable_lora=True, speculative_config={"method": "ngram"}), ["enable_lora", "speculative_config='ngram'"]),
])
def test_bad_settings_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_flags_are_vllms():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4"])
    assert engine_kwargs(args) == dict(model=None, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    assert EngineConfig(**engine_kwargs(args)).lora_config == LoRAConfig(8, 2, 4)


def test_the_feature_joins_five_parts_before_cpu_graphs():
    composition = Composition.of(EngineConfig(enable_lora=True))
    assert composition.features[-2:] == ("LoRA adapters", "CPU graphs")
    assert {part for part, names in composition.parts.items() if any(".lora." in n for n in names)} == {
        "processor", "scheduler", "worker", "model_runner", "model"}
    assert "LoRA adapters" not in Composition.of(EngineConfig()).features
