"""Running a GGUF file's weights as the file stores them: `LLM(model="x.gguf")` (its
path implies quantization="gguf"). vLLM: `model_executor/model_loader/gguf_loader.py`.

Two steps:

- `gguf_model_dir` gives the engine the folder it reads everywhere else: config.json,
  generation_config.json and the tokenizer, read from the file's metadata once (as
  gguf_convert.py does) and cached under its header's hash (gguf_header.py checks the
  header first), plus a marker naming the file. No weights are written: they stay in
  the GGUF. `resolve_gguf_model` turns a `--model` value into that folder (as
  model_loader.resolve_model does for a Hugging Face folder).
- `GGUFQuantizedModel` is the class the engine puts in front of the model's family
  class when config.quant_config.quantization is "gguf" (features.py). Its `load_weights` reads
  the file: the attention and MLP projections keep their blocks (Q8_0, Q4_0/1, Q5_0/1,
  Q4_K, Q5_K, Q6_K) in a GGUFLinearMethod (quantization/gguf.py), which `_linear`
  runs, and so do the embedding and LM head when the file has them in blocks (a
  GGUFEmbedding); everything else (norms, biases, float matrices) is dequantized and
  loaded as from safetensors.
  Q and K rows are un-permuted as gguf_convert.py does, here whole packed rows at a time.
  Under tensor parallelism a rank keeps its rows (column-parallel) or its whole blocks of
  columns (row-parallel: `_shard`); an embedding in blocks is then widened and split. A
  pipeline stage reads only its layers' tensors (and a tied head on a later stage than
  the embedding's is widened).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..layers.parallel import VocabParallelEmbedding
from .gguf import BLOCK_FORMATS, GGUFEmbedding, GGUFLinearMethod, check_type, type_name
from .kernels import join_quant_kernels
from ..utils.files import apply_umask_permissions, move_into_place
from ..utils.paths import cache_dir
from ..model.gguf_families import gguf_family
from ..model.gguf_convert import (_field, _read_family, _write_config, _write_tokenizer, gguf_to_hf_tensor_name, unpermute_qk)
from ..model.gguf_header import GGUFHeader, open_reader, read_header
from ..model import model_loader
from ..model.model_loader import DEFAULT_MODEL, GGUF_MARKER_NAME

logger = logging.getLogger(__name__)

MARKER_NAME = GGUF_MARKER_NAME          # in a prepared folder: which file holds the weights
INDEX_NAME = "gguf_tensors.json"        # in a prepared folder: where each tensor lies in the file
PREPARER_VERSION = 3                    # bump when the prepared folder's contents change

# checkpoint matrix -> the layer that runs it (q, k, v and gate, up are stacked)
PACKED_LAYERS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def resolve_gguf_model(model: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """The folder the engine reads for `model` run as GGUF (quantization="gguf"):
    gguf_model_dir's for the .gguf file `model` names (a file, or a folder holding one:
    find_gguf), or for the default model's file as shipped (model None or DEFAULT_MODEL:
    model_loader.ensure_default_gguf; progress: its download's output).

    Raises:
        as find_gguf, gguf_model_dir and ensure_default_gguf.
    """
    if model is None or model == DEFAULT_MODEL:
        return gguf_model_dir(model_loader.ensure_default_gguf(progress=progress))
    return gguf_model_dir(find_gguf(model))


def find_gguf(model: str | os.PathLike) -> Path:
    """The GGUF file `model` names: a .gguf file, or a folder holding exactly one.

    Raises:
        FileNotFoundError: no such file or folder, or a folder without a .gguf.
        ValueError: a file that is not .gguf, or a folder with several.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            if not found:
                raise FileNotFoundError(f"quantization='gguf': model folder {str(path)!r} holds no .gguf file")
            raise ValueError(f"quantization='gguf': model folder {str(path)!r} holds {len(found)} .gguf files "
                             f"({', '.join(f.name for f in found)}); pass the one to run")
        return found[0]
    if not path.exists():
        raise FileNotFoundError(f"quantization='gguf': model {str(model)!r} does not exist")
    if path.suffix != ".gguf":
        raise ValueError(f"quantization='gguf' runs a .gguf file (or a folder holding one), got {str(model)!r}")
    return path


def gguf_model_dir(gguf_path: str | os.PathLike) -> Path:
    """The folder the engine reads for this GGUF file: its config.json, tokenizer and a
    marker naming the file, written once into <cache>/models/gguf/<name>-<key>/ (the key
    is the file's absolute path, size and the hash of its header: gguf_header.py). A
    file changed in place gets a folder of its own, whatever its modification time says;
    a file that fails leaves nothing behind, so once mended it loads.

    Raises:
        ValueError: naming the file: not a readable GGUF (gguf_header.read_header says
            what is wrong), not of a supported family, a tensor it needs missing
            (gguf_convert's checks), or a projection of a type no layer runs.
    """
    src = Path(gguf_path).expanduser().resolve()
    header = read_header(src)
    dst = cache_dir() / "models" / "gguf" / f"{src.stem}-{_source_key(src, header)}"
    marker = {"source": str(src), "source_bytes": header.size, "header_sha256": header.sha256,
              "version": PREPARER_VERSION}
    try:
        if json.loads((dst / MARKER_NAME).read_text()) == marker:
            return dst
    except (OSError, ValueError):
        pass
    logger.info("reading %s's config and tokenizer (once, 15-40 s; the weights stay in the file; "
                "cached in %s)", src.name, dst)
    start = time.perf_counter()
    reader = open_reader(src)
    family, head_size = _read_family(reader, src)
    # the shapes _write_config checks, without reading a tensor's data
    shapes = {gguf_to_hf_tensor_name(t.name, family.gguf_arch): torch.empty(tuple(reversed(t.shape.tolist())),
                                                                             device="meta")
              for t in reader.tensors if t.name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight")}
    pre_tokenizer = _field(reader, "tokenizer.ggml.pre")
    index = TensorIndex.from_reader(reader, src, header)
    del reader
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        config = _write_config(src, family, head_size, shapes, tmp)
        _write_tokenizer(src, pre_tokenizer, config, tmp)
        (tmp / INDEX_NAME).write_text(json.dumps(index.to_json()) + "\n")
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        apply_umask_permissions(tmp)
        move_into_place(tmp, dst, overwrite=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune_stale(dst.parent)
    logger.info("read %s's config and tokenizer in %.1f s", src.name, time.perf_counter() - start)
    return dst


def _source_key(src: Path, header: GGUFHeader) -> str:
    """A prepared folder's key: its file's path, size and header hash (12 hex)."""
    return hashlib.sha256(f"{src}\n{header.size}\n{header.sha256}".encode()).hexdigest()[:12]


def _prune_stale(parent: Path) -> None:
    """Remove the prepared folders whose file is gone, unreadable or changed since (its
    key is no longer theirs), so the cache holds one folder per file that still exists."""
    for folder in parent.iterdir():
        marker = folder / MARKER_NAME
        if folder.name.startswith(".") or not marker.is_file():     # another's partial folder
            continue
        try:
            source = Path(json.loads(marker.read_text())["source"])
        except (OSError, ValueError, KeyError):
            continue
        try:
            stale = not folder.name.endswith(f"-{_source_key(source, read_header(source))}")
        except ValueError:                                          # gone or no longer GGUF
            stale = True
        if stale:
            logger.info("removing %s: the GGUF file it was prepared from is gone or changed", folder)
            shutil.rmtree(folder, ignore_errors=True)


def gguf_source(folder: str | os.PathLike) -> Path:
    """The GGUF file whose weights a prepared folder (gguf_model_dir) stands for.

    Raises:
        FileNotFoundError: the folder has no marker (not prepared from a GGUF), or the
            file it names is gone.
    """
    try:
        source = Path(json.loads((Path(folder) / MARKER_NAME).read_text())["source"])
    except (OSError, ValueError, KeyError) as e:
        raise FileNotFoundError(f"{str(folder)!r} is not a folder prepared from a GGUF file "
                                f"(quantization='gguf' takes a .gguf file): {e}") from None
    if not source.is_file():
        raise FileNotFoundError(f"the GGUF file {str(source)!r} (of {str(folder)!r}) no longer exists")
    return source


@dataclass(frozen=True)
class IndexedTensor:
    """A GGUF tensor as gguf.GGUFReader gives it: `name`, `tensor_type`
    (gguf.GGMLQuantizationType), `shape` (GGUF's order, innermost first) and `data`, a
    read-only view of the file: float16/float32/... [reversed shape] for plain types, uint8
    [rows, row bytes] for block types (gguf.quants.quant_shape_to_byte_shape)."""

    name: str
    tensor_type: object
    shape: "np.ndarray"
    data: "np.ndarray"


class TensorIndex:
    """Where a GGUF file's tensors lie (name, type, shape, byte offset), and the three
    numbers of its metadata the weights need (architecture, head counts): read once with
    gguf.GGUFReader when gguf_model_dir prepares the folder, and kept there (INDEX_NAME).
    The reader parses every metadata field on each open, seconds for SmolLM2's file, nearly
    all of it the 49,152-entry vocabulary the tokenizer folder already holds; a start reads
    the index and maps the file instead (the same bytes, as the tests check).
    vLLM's GGUF loader re-reads the file with the reader each time.
    """

    def __init__(self, src: Path, meta: dict, entries: list[list], reader=None) -> None:
        self.src, self.meta, self.entries, self.reader = src, meta, entries, reader
        self.arch, self.head_count, self.head_count_kv = meta["arch"], meta["head_count"], meta["head_count_kv"]

    @classmethod
    def from_reader(cls, reader, src: Path, header: GGUFHeader) -> "TensorIndex":
        """The index of an open GGUFReader's file (src, whose header read_header gave).
        Raises ValueError naming the file and the tensor: a projection of a type no layer
        runs (quantization/gguf.py's check_type), or a tensor the family lacks."""
        family, _ = _read_family(reader, src)
        arch = family.gguf_arch
        n_head = _field(reader, f"{arch}.attention.head_count")
        meta = {"arch": arch, "head_count": n_head,
                "head_count_kv": _field(reader, f"{arch}.attention.head_count_kv", n_head),
                "source_bytes": header.size, "header_sha256": header.sha256, "byte_order": reader.byte_order}
        entries = [[t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes)]
                   for t in reader.tensors]
        try:
            for name, type_id, *_ in entries:                 # refused here, before anything is cached
                hf_name = gguf_to_hf_tensor_name(name, arch)
                if hf_name is not None and _is_projection(hf_name):
                    check_type(name, type_id)
        except ValueError as e:
            raise ValueError(f"{src}: {e}") from None
        return cls(src, meta, entries, reader)

    def to_json(self) -> dict:
        return {"meta": self.meta, "tensors": self.entries}

    @classmethod
    def read(cls, folder: str | os.PathLike, src: Path) -> "TensorIndex":
        """The folder's index of src, or a new one from the reader when the folder has none
        or src has changed since (its size or header hash) or is byte-swapped. Raises
        ValueError as read_header and from_reader, naming the file."""
        header = read_header(src)
        try:
            saved = json.loads((Path(folder) / INDEX_NAME).read_text())
            meta = saved["meta"]
            if (meta["source_bytes"], meta["header_sha256"], meta["byte_order"]) == (header.size, header.sha256, "I"):
                return cls(src, meta, saved["tensors"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return cls.from_reader(open_reader(src), src, header)

    def tensors(self) -> list[IndexedTensor]:
        """Every tensor, its data a view of the file mapped read-only (as the reader's; the
        reader's own tensors when the index was made from one: a byte-swapped file too)."""
        if self.reader is not None:
            return list(self.reader.tensors)
        import gguf
        import numpy as np
        from gguf.quants import quant_shape_to_byte_shape

        T = gguf.GGMLQuantizationType
        plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
                 T.I32: np.int32, T.I64: np.int64}            # the reader's; other types are bytes
        mapped = np.memmap(self.src, mode="r")
        out = []
        for name, type_id, dims, offset, n_bytes in self.entries:
            qtype = gguf.GGMLQuantizationType(type_id)
            np_dims = tuple(reversed(dims))
            item = plain.get(qtype)
            if item is None:
                item, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, qtype)
            data = mapped[offset:offset + n_bytes].view(item).reshape(np_dims)
            out.append(IndexedTensor(name, qtype, np.array(dims, dtype=np.uint64), data))
        return out


class GGUFQuantizedModel:
    """A model family class with its weights read from a GGUF file, the attention and MLP
    projections (and an embedding or LM head in blocks) kept in their block formats (the
    feature "GGUF weights", features.py).

    load_weights(folder): folder as gguf_model_dir made it.

    Raises:
        ValueError: naming the file: a projection of an unsupported type (naming the
            tensor and the type), a tensor of the wrong shape, or one missing.
        FileNotFoundError: the folder's GGUF file is gone.
    """

    def set_ops(self, ops) -> None:
        join_quant_kernels(ops)         # at load, before any CPU graph is captured (kernels.py)
        super().set_ops(ops)

    def load_weights(self, folder: str | os.PathLike) -> None:
        src = gguf_source(folder)
        try:
            self._read_tensors(TensorIndex.read(folder, src), src)
        except ValueError as e:                   # a tensor of the wrong shape, say: name the file too
            if str(src) in str(e):
                raise
            raise ValueError(f"{src}: {e}") from None

    def _read_tensors(self, index: TensorIndex, src: Path) -> None:
        import numpy as np
        from gguf.quants import dequantize

        arch, n_head, n_kv = index.arch, index.head_count, index.head_count_kv
        permute_qk = gguf_family(arch, src).permute_qk
        methods: dict[str, GGUFLinearMethod] = {}
        loaded: set[str] = set()
        for t in index.tensors():
            hf_name = gguf_to_hf_tensor_name(t.name, arch)
            if hf_name is None or not self._holds(hf_name):
                continue
            type_id, shape = int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist()))
            target = self._packed_layer(hf_name, type_id)     # its type checked by TensorIndex.from_reader
            if target is not None and type_id in BLOCK_FORMATS:
                data = np.asarray(t.data)                    # uint8 [rows, k / 32 * block bytes]
            else:
                try:
                    data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
                except (NotImplementedError, ValueError) as e:       # a norm in Q8_K, say
                    raise ValueError(f"tensor {t.name!r} of type {type_name(type_id)}: {e}") from None
            if permute_qk and (".attn_q." in t.name or ".attn_k." in t.name):
                data = unpermute_qk(data, n_head if ".attn_q." in t.name else n_kv)
            data = torch.from_numpy(np.array(data, order="C", copy=True))
            if target is None:
                key = self._load_one(hf_name, data, src)
            else:
                layer_name, matrix = target
                layer = self.get_submodule(layer_name)
                if layer_name not in methods:
                    methods[layer_name] = GGUFLinearMethod(*layer.weight.shape)
                start = layer.offsets[matrix] if hasattr(layer, "offsets") else 0
                data = _shard(t.name, layer, matrix, data, type_id if type_id in BLOCK_FORMATS else 0)
                methods[layer_name].add(t.name, start, type_id if type_id in BLOCK_FORMATS else 0, data)
                key = f"{layer_name}.weight" + (f"#{matrix}" if hasattr(layer, "offsets") else "")
            if key:
                loaded.add(key)
        for layer_name, method in methods.items():
            method.finalize(layer_name)
            layer = self.get_submodule(layer_name)
            dtype = layer.weight.dtype
            layer.weight, layer.quant_method = None, method     # the fp32 weight is freed
            if isinstance(layer, VocabParallelEmbedding):
                GGUFEmbedding.from_layer(layer, dtype)           # lookups widen their rows
        self._check_loaded(loaded, src)

    def _holds(self, hf_name: str) -> bool:
        """False for a tensor of a layer another pipeline stage holds (a stage holds layers
        [start_layer, end_layer): pipeline/stage_model.py); such a tensor is not read."""
        kind, _, rest = hf_name.removeprefix("model.").partition(".")
        if kind != "layers":
            return True
        index = int(rest.partition(".")[0])
        return getattr(self, "start_layer", 0) <= index < getattr(self, "end_layer", len(self.layers))

    def _packed_layer(self, hf_name: str, type_id: int) -> tuple[str, str] | None:
        """(our layer's name, the checkpoint matrix) for a projection's weight, or for the
        embedding or an untied LM head in a block format; else None."""
        *path, matrix, leaf = hf_name.removeprefix("model.").split(".")
        if matrix in ("embed_tokens", "lm_head") and leaf == "weight" and type_id in BLOCK_FORMATS:
            # at tp > 1 widened and split (VocabParallelEmbedding.load); on a pipeline stage
            # without it (a PPMissingLayer) or with the tied head, _load_one decides
            vocab = getattr(self, matrix)
            return (matrix, matrix) if isinstance(vocab, VocabParallelEmbedding) and vocab.tp.size == 1 else None
        if not _is_projection(hf_name):
            return None
        return ".".join([*path, PACKED_LAYERS[matrix]]), matrix


def _is_projection(hf_name: str) -> bool:
    """An attention or MLP projection's weight (q_proj ... down_proj: kept in its blocks)."""
    *_, matrix, leaf = hf_name.split(".")
    return leaf == "weight" and matrix in PACKED_LAYERS


def _shard(name: str, layer, matrix: str, data: torch.Tensor, type_id: int) -> torch.Tensor:
    """This rank's share of a projection's matrix `data` (packed bytes uint8 [rows, row
    bytes] of block type `type_id`, or floats [rows, k] for type 0): its rows of a
    column-parallel layer, its columns of a row-parallel one, as ColumnParallelLinear /
    RowParallelLinear.load take them; the row scales and mins of a block stay with it.

    Raises:
        ValueError: a row-parallel split that cuts a block (naming the tensor, k, the
            tensor_parallel_size and the block size).
    """
    tp = layer.tp
    if tp.size == 1:
        return data
    if hasattr(layer, "parts"):                                   # column-parallel: whole rows
        _, first, n = layer.parts[matrix]
        return data[first:first + n]
    k = layer.input_size
    per_rank = k // tp.size
    if type_id == 0:
        return data[:, tp.rank * per_rank:(tp.rank + 1) * per_rank]
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    if per_rank % block:
        raise ValueError(f"GGUF tensor {name!r}: tensor_parallel_size={tp.size} splits its k={k} columns into "
                         f"{per_rank} per rank, which cuts its {type_name(type_id)} blocks of {block}; "
                         f"choose a tensor_parallel_size that leaves each rank whole blocks")
    row_bytes = per_rank // block * block_bytes
    return data[:, tp.rank * row_bytes:(tp.rank + 1) * row_bytes]
