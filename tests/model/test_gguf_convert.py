"""Tests for nanopaged.model.gguf_convert: GGUF -> Hugging Face folder conversion.

The fast tests build a tiny synthetic Llama GGUF (tests/tiny_gguf.py) whose Q/K rows
are permuted exactly as llama.cpp's ``convert_hf_to_gguf.py`` does, and check that
conversion gives back the original tensors bit for bit. The real SmolLM2 conversion
is checked by the ``slow`` tests of test_model_loader.py.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from tiny_gguf import HIDDEN, LAYERS, N_HEAD, N_KV, VOCAB, llama_cpp_permute, write_tiny_gguf

from nanopaged.model import gguf_convert as gc
from nanopaged.model.model_loader import resolve_model

# --------------------------------------------------------------------------- weight mapping


@pytest.mark.parametrize("n_head", [1, 2, 3, 9])
@pytest.mark.parametrize("tail", [(), (5,)])
def test_unpermute_inverts_llama_cpp_permute(n_head, tail):
    w = np.arange(n_head * 64 * int(np.prod(tail)), dtype=np.float32).reshape(n_head * 64, *tail)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gc.unpermute_qk(permuted, n_head), w)


def test_unpermute_rejects_bad_row_count():
    with pytest.raises(ValueError, match="7 rows"):
        gc.unpermute_qk(np.zeros((7, 3), np.float32), 2)


def test_tensor_names_map_to_hf():
    assert gc.gguf_to_hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gc.gguf_to_hf_tensor_name("output.weight") == "lm_head.weight"
    assert gc.gguf_to_hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert gc.gguf_to_hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gc.gguf_to_hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gc.gguf_to_hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gc.gguf_to_hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        gc.gguf_to_hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_state_dict_restores_original_tensors_exactly(tmp_path):
    import gguf

    original = write_tiny_gguf(tmp_path / "tiny.gguf")
    state = gc.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    assert sorted(state) == sorted(original)
    assert "lm_head.weight" not in state  # tied: no output.weight in the GGUF
    for name, expected in original.items():
        got = state[name]
        assert got.dtype.is_floating_point and got.numpy().dtype == np.float32, name
        assert got.is_contiguous(), name
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=name)


def test_untied_output_becomes_lm_head(tmp_path):
    import gguf

    original = write_tiny_gguf(tmp_path / "tiny.gguf", tied=False)
    state = gc.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    np.testing.assert_array_equal(state["lm_head.weight"].numpy(), original["lm_head.weight"])


def test_quantized_tensor_is_dequantized_with_reversed_gguf_shape(tmp_path):
    """A Q8_0 tensor must come back as float32 in HF (rows, cols) order."""
    import gguf
    from gguf.quants import quantize

    w = np.random.default_rng(1).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    q = quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    writer.add_head_count(N_HEAD)
    writer.add_tensor("token_embd.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    state = gc.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "q.gguf"))
    got = state["model.embed_tokens.weight"].numpy()
    assert got.shape == (VOCAB, HIDDEN) and got.dtype == np.float32
    np.testing.assert_allclose(got, w, atol=np.abs(w).max() / 100)  # 8-bit: ~1/127 of the block max


def test_unknown_tensor_is_an_error_not_silently_dropped(tmp_path):
    import gguf

    write_tiny_gguf(tmp_path / "t.gguf", extra_tensors={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        gc.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "t.gguf"))


def test_non_llama_architecture_rejected(tmp_path):
    import gguf

    write_tiny_gguf(tmp_path / "t.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        gc.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "t.gguf"))


# --------------------------------------------------------------------------- full conversion


def test_convert_gguf_to_hf_writes_a_loadable_folder(tmp_path):
    import torch
    import transformers
    from safetensors.torch import load_file

    original = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = gc.convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert out == tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", gc.MARKER_NAME} <= names
    # Nothing half-written is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]

    weights = load_file(out / "model.safetensors")
    assert sorted(weights) == sorted(original)
    for name, expected in original.items():
        assert weights[name].dtype == torch.float32
        np.testing.assert_array_equal(weights[name].numpy(), expected, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (LAYERS, HIDDEN)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (N_HEAD, N_KV)
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5  # not float32's 9.99999974e-06
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "_model_name_or_path" not in config
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    marker = json.loads((out / gc.MARKER_NAME).read_text())
    assert marker["converter_version"] == gc.CONVERTER_VERSION
    assert marker["source_sha256"] == hashlib.sha256((tmp_path / "tiny.gguf").read_bytes()).hexdigest()

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # Independent check of the Q/K un-permutation: transformers' own GGUF loader.
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    ).state_dict()
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)

    assert resolve_model(out) == out
    assert resolve_model(str(out)) == out


def test_convert_refuses_existing_output_unless_overwrite(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match=str(out)):
        gc.convert_gguf_to_hf(tmp_path / "tiny.gguf", out, progress=False)
    gc.convert_gguf_to_hf(tmp_path / "tiny.gguf", out, progress=False, overwrite=True)
    assert not (out / "old.txt").exists() and (out / gc.MARKER_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_failed_conversion_leaves_no_folder(tmp_path):
    write_tiny_gguf(tmp_path / "bad.gguf", extra_tensors={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="mystery"):
        gc.convert_gguf_to_hf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_convert_missing_or_bogus_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gc.convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        gc.convert_gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
