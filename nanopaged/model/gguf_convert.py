"""Convert a GGUF file (llama.cpp's format) into a Hugging Face folder.

The engine reads only Hugging Face folders (``config.json``, safetensors,
tokenizer files), but the default model reaches us as a Q4_1 GGUF (see
``model_loader.py``). This module dequantizes every tensor to float32, renames
it to its HF name, undoes llama.cpp's Q/K row permutation where the family has
one (``llama``; ``qwen2`` and ``qwen3`` have none, see ``gguf_families.py``) and
writes config, tokenizer and weights. Q4_1 is lossy, so the result is not
bit-identical to the original bf16 checkpoint; it is identical to what
``transformers`` itself loads from the same GGUF, which is what the tests check.

References:
  * GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
  * llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``, tensor names):
    https://github.com/ggml-org/llama.cpp/blob/master/convert_hf_to_gguf.py
  * transformers' own GGUF loader, ``modeling_gguf_pytorch_utils.py``
    (``LlamaTensorProcessor._reverse_permute_weights``).
  * ``gguf_families.py``: the families (``llama``, ``qwen2``, ``qwen3``) and their sources.

Heavy libraries (torch, transformers, gguf, rich) are imported inside the
functions that need them so ``import nanopaged`` stays fast.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanopaged.model.gguf_families import GGUFFamily, gguf_family
from nanopaged.model.gguf_header import open_reader
from nanopaged.utils.files import apply_umask_permissions, move_into_place, sha256_file

if TYPE_CHECKING:  # pragma: no cover - typing only
    import gguf
    import numpy as np
    import torch

__all__ = [
    "CONVERTER_VERSION", "MARKER_NAME", "convert_gguf_to_hf", "gguf_tensors_to_hf_state_dict",
    "gguf_to_hf_tensor_name", "unpermute_qk", "sha256_file",
]  # fmt: skip

logger = logging.getLogger(__name__)

# Bump whenever the converter's output changes, so cached folders written by an
# older converter are rebuilt instead of silently reused.
CONVERTER_VERSION = 1
# Written last into a converted folder: its presence means the folder is complete.
MARKER_NAME = "nanopaged-converted.json"

# ``rope_freqs`` holds llama.cpp's precomputed Llama-3.1 RoPE scaling factors;
# HF recomputes them from ``config.rope_scaling``, so it is safe to drop.
_IGNORED_GGUF_TENSORS = {"rope_freqs.weight"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_tensor_name(name: str, arch: str = "llama") -> str | None:
    """Map a llama.cpp tensor name to its HF name in family ``arch`` (``general.architecture``).

    Returns ``None`` for tensors with no HF counterpart (``rope_freqs.weight``).

    Raises:
        ValueError: the name is not a known tensor of that family (e.g. a MoE
            tensor, or ``attn_q_norm`` in a llama GGUF), rather than silently
            dropping it; or an unsupported ``arch``.
    """
    family = gguf_family(arch)
    if name in _IGNORED_GGUF_TENSORS:
        return None
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in family.block_names:
        layer, part, kind = m.groups()
        return f"model.layers.{int(layer)}.{family.block_names[part]}.{kind}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {name!r} has no known Hugging Face counterpart in family {arch!r}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (weight or bias).

    HF Llama applies RoPE "rotate-half" style: within a head, dimension ``i``
    pairs with ``i + head_size/2``. llama.cpp's kernels pair adjacent dims
    ``(2i, 2i+1)``, so its converter reorders each head's output rows with
    ``w.reshape(n_head, 2, head_size//2, *rest).swapaxes(1, 2).reshape(w.shape)``
    (``LlamaModel.permute``). The inverse swaps the same two axes back.

    Args:
        w: array of shape ``(n_head * head_size, ...)`` (rows = output features).
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
    """Metadata `key`'s value, or `default`. Raises ValueError naming the file and key."""
    field = reader.fields.get(key)
    try:
        return default if field is None else field.contents()
    except (ValueError, IndexError, TypeError) as e:        # a string that is not UTF-8, say
        raise ValueError(f"{reader.data.filename}: metadata {key!r} cannot be read: {e}") from None


def _read_with_transformers(auto_class: Any, src: Path) -> Any:
    """``auto_class.from_pretrained`` of the GGUF file (transformers reads its metadata).
    Raises ValueError naming the file, whatever transformers raised on its metadata."""
    try:
        return auto_class.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # noqa: BLE001 - a bad file makes transformers raise OSError, KeyError, ...
        raise ValueError(f"{src}: transformers cannot read its metadata: {type(e).__name__}: {e}") from e


def gguf_tensors_to_hf_state_dict(
    reader: gguf.GGUFReader, *, progress: bool = False, description: str = "Converting GGUF tensors"
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a llama/qwen2/qwen3 GGUF into an HF-named float32 state dict.

    Head counts come from the GGUF metadata (``{arch}.attention.head_count`` and
    ``head_count_kv``, the latter defaulting to the former as in llama.cpp); in a
    ``llama`` GGUF, Q and K rows are un-permuted (:func:`unpermute_qk`). There is no
    ``lm_head.weight`` when the GGUF has no ``output.weight`` (tied embeddings).

    Raises:
        ValueError: an unsupported ``general.architecture``, missing head count, an
            unknown tensor, or a tensor whose data does not fit its declared shape.
    """
    import numpy as np
    import torch
    from gguf.quants import dequantize

    family = gguf_family(_field(reader, "general.architecture"), reader.data.filename)
    arch = family.gguf_arch
    n_head = _field(reader, f"{arch}.attention.head_count")
    if n_head is None:
        raise ValueError(f"{reader.data.filename}: metadata '{arch}.attention.head_count' is missing")
    n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)

    state: dict[str, torch.Tensor] = {}
    with _progress_bar(progress) as bar:
        for t in bar.track(reader.tensors, description=description):
            hf_name = gguf_to_hf_tensor_name(t.name, arch)
            if hf_name is None:
                continue
            # GGUF lists dims fastest-first (ne[0] = columns); numpy wants slowest-first.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            try:
                arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            except (ValueError, NotImplementedError) as e:
                raise ValueError(f"{reader.data.filename}: GGUF tensor {t.name!r} ({t.tensor_type.name}) cannot "
                                 f"be read as shape {shape}: {e}") from e
            if family.permute_qk and (".attn_q." in t.name or ".attn_k." in t.name):
                arr = unpermute_qk(arr, n_head if ".attn_q." in t.name else n_kv)
            # Copy: the reader's arrays are read-only views of a memmap, and
            # safetensors needs contiguous, independently owned storage.
            state[hf_name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return state


def _read_family(reader: gguf.GGUFReader, src: Path) -> tuple[GGUFFamily, int | None]:
    """The GGUF's family and its ``attention.key_length`` (None if absent).

    Refuses a GGUF that lacks a tensor its family needs (e.g. Qwen2's ``attn_q.bias``),
    which transformers would silently initialise at random.

    Raises:
        ValueError: an unsupported architecture; a missing tensor or block count;
            ``key_length`` differing from ``value_length`` (HF has one ``head_dim``).
    """
    family = gguf_family(_field(reader, "general.architecture"), src)
    arch = family.gguf_arch
    n_layers = _field(reader, f"{arch}.block_count")
    if n_layers is None:
        raise ValueError(f"{src}: metadata '{arch}.block_count' is missing")
    present = {t.name for t in reader.tensors}
    for name in family.required_tensor_names(n_layers):
        if name not in present:
            raise ValueError(f"{src}: a {arch!r} GGUF needs tensor {name!r}, which is missing")
    key = _field(reader, f"{arch}.attention.key_length")
    value = _field(reader, f"{arch}.attention.value_length", key)
    if key != value:
        raise ValueError(f"{src}: {arch}.attention.key_length={key} differs from value_length={value}")
    return family, key


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
    """Convert a llama, qwen2 or qwen3 GGUF file into a Hugging Face folder with float32 weights.

    Writes ``model.safetensors`` (every tensor dequantized), ``config.json``,
    ``generation_config.json``, the tokenizer files (with the chat template)
    and, last, :data:`MARKER_NAME` with the source's SHA-256 and the converter
    version. Everything is written into a temporary folder beside ``out_dir``
    and renamed into place at the end, so an interrupted conversion never leaves
    a folder that looks complete. ``progress`` shows a bar on stderr;
    ``overwrite`` replaces an existing ``out_dir``. Returns ``out_dir``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
        ValueError: the file is not a readable GGUF of a supported family (the
            message names the architecture and the supported ones), or lacks a
            tensor its family needs.
    """
    src = Path(gguf_path).expanduser()
    dst = Path(out_dir).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
    if dst.exists() and not overwrite:
        raise FileExistsError(f"output folder {str(dst)!r} already exists (pass overwrite=True to replace it)")

    import numpy as np
    import transformers
    from safetensors.torch import save_file

    reader = open_reader(src)     # ValueError naming the file and what is wrong (gguf_header.py)

    dst.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: that makes the folder 0700, which would survive the
    # rename and hide a shared cache from other users; os.mkdir honours the umask.
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        family, head_size = _read_family(reader, src)
        state = gguf_tensors_to_hf_state_dict(reader, progress=progress)
        pre_tokenizer = _field(reader, "tokenizer.ggml.pre")
        del reader  # drop the memmap before the big write
        if progress:
            mb = sum(t.numel() for t in state.values()) * 4 / 1e6
            logger.info("writing model.safetensors (%.0f MB)", mb)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = _write_config(src, family, head_size, state, tmp)
        del state
        _write_tokenizer(src, pre_tokenizer, config, tmp)
        marker = {
            "converter": "nanopaged.model.gguf_convert.convert_gguf_to_hf",
            "converter_version": CONVERTER_VERSION,
            "source_file": src.name,
            "source_sha256": sha256_file(src),
            "source_bytes": src.stat().st_size,
            "dtype": "float32",
            "numpy": np.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "transformers": transformers.__version__,
        }
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        apply_umask_permissions(tmp)
        move_into_place(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        logger.info("converted %s -> %s", src.name, dst)
    return dst


def _write_config(src: Path, family: GGUFFamily, head_size: int | None, state: dict[str, torch.Tensor], out: Path) -> Any:
    """Write ``config.json`` and ``generation_config.json`` into ``out``; return the config.

    ``head_size`` is the GGUF's ``attention.key_length`` or None (:func:`_set_head_dim`).
    """
    import transformers

    # transformers' GGUF metadata reader does the {arch}.* -> config mapping
    # (context_length -> max_position_embeddings, freq_base -> rope_theta, ...).
    config = _read_with_transformers(transformers.AutoConfig, src)
    if config.model_type != family.model_type:
        raise ValueError(f"{src}: transformers reads model_type {config.model_type!r}, expected {family.model_type!r}")
    config.architectures = [family.hf_architecture]
    # Decide tying from what we actually wrote, not from metadata guesses.
    config.tie_word_embeddings = "lm_head.weight" not in state
    config.dtype = "float32"
    config.rms_norm_eps = _shortest_float32(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        rope["rope_theta"] = _shortest_float32(rope["rope_theta"])
    elif getattr(config, "rope_theta", None) is not None:  # transformers 4.x layout
        config.rope_theta = _shortest_float32(config.rope_theta)
    embed = state.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError(f"{src}: no 'token_embd.weight' tensor; not a complete GGUF")
    if config.vocab_size != embed.shape[0] or config.hidden_size != embed.shape[1]:
        raise ValueError(
            f"{src}: config says vocab_size={config.vocab_size}, hidden_size={config.hidden_size} but "
            f"token_embd has shape {tuple(embed.shape)}"
        )
    _set_head_dim(config, family, head_size, state.get("model.layers.0.self_attn.q_proj.weight"), src)
    # transformers stores the GGUF's title ("Smollm2 135M 8k ...") as a
    # pseudo model path; it is not one, so keep it out of config.json.
    config.__dict__.pop("_model_name_or_path", None)
    config.save_pretrained(out)
    transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    ).save_pretrained(out)
    return config


def _set_head_dim(config: Any, family: GGUFFamily, head_size: int | None, q: Any, src: Path) -> None:
    """Set ``config.head_dim`` as llama.cpp reads it; check it against ``q`` (attn_q, or None).

    llama.cpp takes ``attention.key_length`` (``head_size``) if present, else
    ``hidden_size / heads``. transformers' reader maps ``key_length`` for none of our
    families and so leaves Qwen3 at its class default (128) whatever the file says;
    a llama GGUF without ``key_length`` keeps the ``rope.dimension_count`` it read.

    Raises:
        ValueError: attn_q's rows are not ``num_attention_heads * head_dim``.
    """
    if head_size is None and family.gguf_arch != "llama":
        head_size = config.hidden_size // config.num_attention_heads
    if head_size is not None:
        config.head_dim = head_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if q is not None and q.shape[0] != config.num_attention_heads * head_dim:
        raise ValueError(
            f"{src}: attn_q has {q.shape[0]} rows but num_attention_heads={config.num_attention_heads} x "
            f"head_dim={head_dim} = {config.num_attention_heads * head_dim}"
        )


def _write_tokenizer(src: Path, pre_tokenizer: str | None, config: Any, out: Path) -> None:
    """Write the tokenizer files (with the chat template) read from the GGUF into ``out``."""
    import transformers
    from tokenizers import pre_tokenizers

    tokenizer = _read_with_transformers(transformers.AutoTokenizer, src)
    # GGUF stores only a pre-tokenizer *name*, and transformers maps every gpt2
    # vocab to a plain ByteLevel step. SmolLM2's original tokenizer.json (like
    # llama.cpp's "smollm"/"starcoder") first splits digits one by one: put it back.
    if pre_tokenizer in ("smollm", "starcoder"):
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])  # fmt: skip
    if tokenizer.eos_token_id != config.eos_token_id:
        raise ValueError(
            f"{src}: tokenizer eos {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) differs from "
            f"config eos_token_id {config.eos_token_id}"
        )
    # Otherwise transformers saves an "unlimited" 1e30 length.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)


def _console() -> Any:
    # stderr: progress chatter must not mix with generated text on stdout.
    from rich.console import Console

    return Console(stderr=True)


def _progress_bar(enabled: bool) -> Any:
    """A rich progress bar on stderr; ``enabled=False`` tracks silently."""
    from rich import progress as p

    columns = (p.TextColumn("{task.description}"), p.BarColumn(), p.MofNCompleteColumn(), p.TimeElapsedColumn())
    return p.Progress(*columns, console=_console(), disable=not enabled)
