"""GGUF -> Hugging Face conversion for each family llama.cpp writes: llama, qwen2, qwen3.

For every family, tied and untied: a tiny random transformers checkpoint
(``make_tiny_model``) is written as a GGUF the way llama.cpp's ``convert_hf_to_gguf.py``
writes that family (tests/tiny_gguf.py: Q/K rows permuted for llama only), then
converted back with ``convert_gguf_to_hf``. The converted folder must hold the original
tensors bit for bit, name its architecture, and generate the original's greedy ids in
transformers and in the engine.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from tiny_gguf import write_gguf_from_hf, write_tiny_gguf

from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.model import gguf_convert as gc
from nanopaged.model import gguf_families

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]
NEW_TOKENS = 16


def _randomize_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises RMSNorm weights to 1 and biases to 0, so a swapped
    q_norm/k_norm or an un-permuted bias would go unseen; make every one distinct."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _tiny_checkpoint_and_gguf(root, arch: str, tie: bool) -> torch.nn.Module:
    """Save a tiny ``arch`` checkpoint in root/hf and its llama.cpp-style GGUF as
    root/model.gguf; return the transformers model."""
    model = make_tiny_model(root / "hf", FAMILIES[arch], tie=tie)
    _randomize_norms_and_biases(model, seed=len(arch) + tie)
    model.save_pretrained(root / "hf")
    write_gguf_from_hf(root / "hf", root / "model.gguf", arch)
    return model


@pytest.fixture(scope="module", params=[(a, t) for a in FAMILIES for t in (True, False)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def converted(request, tmp_path_factory):
    """(arch, tie, original transformers model, its HF folder, the converted folder)."""
    arch, tie = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{tie}")
    model = _tiny_checkpoint_and_gguf(root, arch, tie)
    out = gc.convert_gguf_to_hf(root / "model.gguf", root / "converted", progress=False)
    return arch, tie, model, root / "hf", out


def _greedy_transformers(model: torch.nn.Module) -> list[int]:
    ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return ids[0, len(PROMPT):].tolist()


def test_converted_tensors_equal_the_original_bit_for_bit(converted):
    from safetensors.numpy import load_file

    arch, tie, _, hf, out = converted
    original, got = load_file(str(hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(original)
    assert ("lm_head.weight" in got) == (not tie)
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in got
    if arch == "qwen3":
        assert "model.layers.1.self_attn.q_norm.weight" in got
    for name, expected in original.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_converted_config_names_the_architecture(converted):
    arch, tie, model, _, out = converted
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[arch]] and config["model_type"] == arch
    assert config["tie_word_embeddings"] is tie
    # Qwen3's head_dim (32) is not hidden_size / heads (16): it comes from attention.key_length.
    assert config["head_dim"] == model.config.head_dim
    assert config["rms_norm_eps"] == model.config.rms_norm_eps
    assert config["rope_parameters"]["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)


def test_transformers_generates_the_original_ids_from_the_converted_folder(converted):
    import transformers

    _, _, model, _, out = converted
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded) is type(model)
    assert _greedy_transformers(reloaded) == _greedy_transformers(model)


def test_engine_generates_the_original_ids_from_the_converted_folder(converted):
    from nanopaged import LLM, SamplingParams

    arch, _, model, _, out = converted
    if arch != "llama":
        registry = pytest.importorskip("nanopaged.model.registry", reason="the engine has only Llama yet")
        if FAMILIES[arch] not in registry.MODELS:
            pytest.skip(f"the engine's registry has no {FAMILIES[arch]} yet")
    llm = LLM(str(out), dtype="float32", block_size=4, num_gpu_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == _greedy_transformers(model)


def test_llamas_row_permutation_would_break_a_qwen2_gguf(tmp_path, monkeypatch):
    """The generation check above can see a wrong permutation rule: un-permuting a
    qwen2 GGUF's Q/K rows (right only for llama) changes the greedy ids."""
    import transformers

    model = _tiny_checkpoint_and_gguf(tmp_path, "qwen2", tie=True)
    wrong = dataclasses.replace(gguf_families.GGUF_FAMILIES["qwen2"], permute_qk=True)
    monkeypatch.setitem(gguf_families.GGUF_FAMILIES, "qwen2", wrong)
    out = gc.convert_gguf_to_hf(tmp_path / "model.gguf", tmp_path / "out", progress=False)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert _greedy_transformers(reloaded) != _greedy_transformers(model)


def test_family_tensor_names_map_to_hf():
    assert gc.gguf_to_hf_tensor_name("blk.2.attn_q_norm.weight", "qwen3") == "model.layers.2.self_attn.q_norm.weight"
    assert gc.gguf_to_hf_tensor_name("blk.0.attn_k_norm.weight", "qwen3") == "model.layers.0.self_attn.k_norm.weight"
    assert gc.gguf_to_hf_tensor_name("blk.1.attn_v.bias", "qwen2") == "model.layers.1.self_attn.v_proj.bias"
    with pytest.raises(ValueError, match="attn_q_norm.*'llama'"):
        gc.gguf_to_hf_tensor_name("blk.0.attn_q_norm.weight", "llama")


def test_unknown_architecture_is_refused_by_name(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"'gpt2'.*\['llama', 'qwen2', 'qwen3'\]"):
        gc.convert_gguf_to_hf(tmp_path / "t.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_qwen2_gguf_without_its_q_bias_is_refused(tmp_path):
    """transformers would initialise a missing bias at random and load without a word."""
    make_tiny_model(tmp_path / "hf", "Qwen2ForCausalLM")
    write_gguf_from_hf(tmp_path / "hf", tmp_path / "q.gguf", "qwen2", drop=("blk.1.attn_q.bias",))
    with pytest.raises(ValueError, match="'blk.1.attn_q.bias'"):
        gc.convert_gguf_to_hf(tmp_path / "q.gguf", tmp_path / "out", progress=False)
