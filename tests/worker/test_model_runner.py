"""ModelRunner: the base runner and the features composed in front of it.

The base file names no later feature; each feature is a subclass built by
Composition.build (features.py); the runner drops exactly the blocks a message says were taken
back (SchedulerOutput.num_blocks_taken_back), not a number it derives itself.
"""
from __future__ import annotations

import sys

import re
from pathlib import Path

import torch

from nanopaged import SamplingParams
from nanopaged.features import Composition
from nanopaged.config import EngineConfig, SpeculativeConfig
from nanopaged.messages import CachedRequestData, NewRequestData, SchedulerOutput
from nanopaged.model.config import ModelConfig
from nanopaged.model.llama import LlamaForCausalLM
from nanopaged.async_sched.model_runner import AsyncModelRunner
from nanopaged.cpu_graph.model_runner import CPUGraphModelRunner
from nanopaged.worker.model_runner import ModelRunner
from nanopaged.spec_decode.model_runner import SpecDecodeModelRunner
from nanopaged.structured_output.model_runner import StructuredOutputModelRunner

BASE = Path(__file__).resolve().parents[2] / "nanopaged" / "worker" / "model_runner.py"


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                         rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                         tie_word_embeddings=True, eos_token_id=[0])
    model = LlamaForCausalLM(config)
    model.init_rope(64)
    return model


def delta(seq_id, blocks, computed, replaced=False, taken_back=None) -> SchedulerOutput:
    """A step that computes nothing: only the record's update."""
    c = CachedRequestData([seq_id], [[]], [list(blocks)], [replaced], [computed])
    return SchedulerOutput(scheduled_cached_reqs=c,
                           num_blocks_taken_back={} if taken_back is None else {seq_id: taken_back})


def test_the_runner_drops_the_blocks_the_message_says_were_taken_back():
    runner = ModelRunner(EngineConfig(block_size=4), tiny_model(), num_gpu_blocks=16)
    new = NewRequestData(0, 0, list(range(1, 11)), [], SamplingParams(), [0, 1, 2, 3], 0)
    runner.execute_model(SchedulerOutput(scheduled_new_reqs=[new]))
    record = runner.input_batch.seqs[0]
    # 5 computed tokens fill 2 blocks of 4, but the message says 1 block was taken back:
    # the message decides, not the runner (which would drop 2)
    runner.execute_model(delta(0, [9], computed=5, taken_back=1))
    assert record.block_ids == [0, 1, 2, 9]
    runner.execute_model(delta(0, [10], computed=6, taken_back=0))
    assert record.block_ids == [0, 1, 2, 9, 10]
    runner.execute_model(delta(0, [4, 5], computed=6, replaced=True, taken_back=1))   # a whole new table
    assert record.block_ids == [4, 5]


def test_the_base_runner_names_no_later_feature():
    source = BASE.read_text()
    named = re.findall(r"draft|spec_|speculative|placeholder|grammar|beam|async|propos|isinstance", source, re.I)
    assert named == []


def test_the_runner_class_is_the_base_with_the_configs_features():
    def mro(**kwargs):
        cls = Composition.of(EngineConfig(**kwargs)).build(ModelRunner, "model_runner")
        # the classes of the packages, not the one build() made (it is in no module)
        return [c for c in cls.__mro__[:-1] if getattr(sys.modules[c.__module__], c.__name__, None) is c]

    assert mro() == [StructuredOutputModelRunner, CPUGraphModelRunner, ModelRunner]
    assert mro(enforce_eager=True) == mro(attention_backend="torch") == [StructuredOutputModelRunner, ModelRunner]
    assert mro(async_scheduling=True, enforce_eager=True) == [AsyncModelRunner, StructuredOutputModelRunner, ModelRunner]
    assert mro(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                                                    prompt_lookup_max=2)) == [
        SpecDecodeModelRunner, StructuredOutputModelRunner, CPUGraphModelRunner, ModelRunner]
