"""A GGUF file's header, read and checked before gguf.GGUFReader sees it.

The reader believes the file's counts and lengths: a tensor count of 2**62, a string of
2**40 bytes or a tensor of 5 dims sends it reading past the end, and it stops with an
IndexError that names neither the file nor the problem. `read_header` walks the same
layout, checks every count, length, dim and tensor against the file's size, and says
what is wrong. Its hash of the header is the key of the folder gguf_loader prepares:
the config, the tokenizer and the tensor table all come from these bytes.

Layout (ggml's docs/gguf.md): "GGUF", version u32, tensor count u64, kv count u64; the
metadata, kv count times (key: string, value type u32, value); the tensor infos, tensor
count times (name: string, n_dims u32, dims u64 x n_dims, type u32, offset u64); padding
to general.alignment; the tensor data. A string is a u64 length and its bytes.
llama.cpp checks dims, types and where the data lies as it opens a file
(gguf_init_from_file_impl in ggml/src/gguf.cpp); vLLM hands the file to the reader as is.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_DIMS = 4                 # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32       # GGUF_DEFAULT_ALIGNMENT
STRING, ARRAY, UINT32 = 8, 9, 4
# bytes of each scalar value type (GGUFValueType): u8 i8 u16 i16 u32 i32 f32 bool, u64 i64 f64
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# the fewest bytes a string or an array (empty), a kv entry (empty key, type, a u8) and a
# tensor info (empty name, no dims) take
MIN_ITEM_BYTES = {STRING: 8, ARRAY: 4 + 8}
MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


@dataclass(frozen=True)
class GGUFHeader:
    """What read_header found: `size` (the file's bytes), `data_offset` (where the
    tensor data starts, after the header and its padding) and `sha256` (hex, of the
    data_offset bytes before it)."""

    size: int
    data_offset: int
    sha256: str


class _Malformed(Exception):
    """What is wrong with the file, in words; read_header adds the file's path."""


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Walk the header of the GGUF file at `path`, checking it against the file's size.

    Raises:
        ValueError: "<path>: not a readable GGUF file: <what is wrong>": not GGUF (the
            magic), a version other than 2 or 3, a count, string or array longer than the
            file, a tensor of more than 4 dims or a zero dim, of an unknown type, not in
            whole blocks of its type, or whose data runs past the end (a truncated file);
            or the file cannot be opened.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise _Malformed(f"the file is {size} bytes, shorter than a GGUF header (24)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                data_offset = _Walk(buf, size).header()
                return GGUFHeader(size, data_offset, hashlib.sha256(buf[:data_offset]).hexdigest())
    except _Malformed as e:
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from None
    except OSError as e:
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e


def open_reader(path: str | os.PathLike):
    """gguf.GGUFReader of a file read_header has checked.

    Raises:
        ValueError: read_header's, or anything else the reader raises on this file (a
            duplicate key or tensor name, a bad general.alignment, ...), naming the file.
    """
    import gguf

    read_header(path)
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error, OverflowError, MemoryError) as e:
        raise ValueError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e


class _Walk:
    """One pass over the header of `buf` (the mapped file of `size` bytes)."""

    def __init__(self, buf, size: int) -> None:
        self.buf, self.size, self.pos, self.order = buf, size, 0, "<"

    def header(self) -> int:
        """Check the whole header; return where the tensor data starts."""
        if self.buf[:4] != b"GGUF":
            raise _Malformed(f"it starts with {bytes(self.buf[:4])!r}, not the magic b'GGUF'")
        version = struct.unpack_from("<I", self.buf, 4)[0]
        if version & 0xFFFF == 0:                # written on a host of the other byte order (as the reader tells)
            self.order, version = ">", struct.unpack_from(">I", self.buf, 4)[0]
        if version not in (2, 3):
            raise _Malformed(f"GGUF version {version} is not supported (2 or 3)")
        self.pos = 8
        n_tensors, n_kv = self.u64(), self.u64()
        self.fits(n_kv, MIN_KV_BYTES, f"kv count {n_kv}")
        self.fits(n_tensors, MIN_TENSOR_INFO_BYTES, f"tensor count {n_tensors}")
        alignment = DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = self.string(f"metadata key {i}")
            value_type = self.u32(f"the value type of metadata {key!r}")
            if key == "general.alignment" and value_type == UINT32:
                alignment = struct.unpack_from(self.order + "I", self.buf, self.pos)[0]
                if alignment == 0 or alignment & (alignment - 1):
                    raise _Malformed(f"general.alignment {alignment} is not a power of two")
            self.value(value_type, f"metadata {key!r}")
        infos = [self.tensor_info(i) for i in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment
        for name, dims, type_id, offset in infos:
            self.check_tensor(name, dims, type_id, data_offset + offset)
        return data_offset

    def fits(self, count: int, item_bytes: int, what: str) -> None:
        if count * item_bytes > self.size - self.pos:
            raise _Malformed(f"{what} is larger than the file ({self.size} bytes) can hold")

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise _Malformed(f"the header ends early: {what} at byte {self.pos} lies past the end "
                             f"of the file ({self.size} bytes)")
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def u32(self, what: str = "a u32") -> int:
        return self.unpack("I", what)

    def u64(self, what: str = "a u64") -> int:
        return self.unpack("Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if n > self.size - self.pos:
            raise _Malformed(f"{what}: a string of {n} bytes runs past the end of the file ({self.size} bytes)")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, value_type: int, what: str) -> None:
        """Step over one metadata value of `value_type`."""
        if value_type in SCALAR_BYTES:
            self.pos += SCALAR_BYTES[value_type]
        elif value_type == STRING:
            self.string(what)
        elif value_type == ARRAY:
            item_type, count = self.u32(f"the item type of {what}"), self.u64(f"the length of {what}")
            item_bytes = SCALAR_BYTES.get(item_type) or MIN_ITEM_BYTES.get(item_type)
            if item_bytes is None:
                raise _Malformed(f"{what}: an array of unknown value type {item_type}")
            if count * item_bytes > self.size - self.pos:
                raise _Malformed(f"{what}: an array of {count} items runs past the end of the file "
                                 f"({self.size} bytes)")
            if item_type in SCALAR_BYTES:
                self.pos += count * item_bytes
            elif item_type == STRING:
                self.strings(count, what)
            else:
                for _ in range(count):
                    self.value(ARRAY, f"{what} (an array in it)")
        else:
            raise _Malformed(f"{what} has unknown value type {value_type}")
        if self.pos > self.size:
            raise _Malformed(f"{what} runs past the end of the file ({self.size} bytes)")

    def strings(self, count: int, what: str) -> None:
        """Step over `count` strings (a vocabulary: the one loop here that must be quick)."""
        buf, pos, size, fmt = self.buf, self.pos, self.size, self.order + "Q"
        for i in range(count):
            if pos + 8 > size:
                raise _Malformed(f"{what}: item {i} of {count} lies past the end of the file ({size} bytes)")
            pos += 8 + struct.unpack_from(fmt, buf, pos)[0]
            if pos > size:
                raise _Malformed(f"{what}: item {i} of {count} runs past the end of the file ({size} bytes)")
        self.pos = pos

    def tensor_info(self, i: int) -> tuple[str, list[int], int, int]:
        name = self.string(f"the name of tensor {i}")
        n_dims = self.u32(f"the n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise _Malformed(f"tensor {name!r} has n_dims {n_dims}; a GGML tensor has at most {MAX_DIMS}")
        dims = [self.u64(f"the dims of tensor {name!r}") for _ in range(n_dims)]
        return name, dims, self.u32(f"the type of tensor {name!r}"), self.u64(f"the offset of tensor {name!r}")

    def check_tensor(self, name: str, dims: list[int], type_id: int, start: int) -> None:
        """The tensor's dims and type make sense and its data lies inside the file."""
        import gguf

        if 0 in dims:
            raise _Malformed(f"tensor {name!r} has a zero dimension (dims {dims}, innermost first)")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise _Malformed(f"tensor {name!r} has unknown type {type_id}") from None
        if dims and dims[0] % block:
            raise _Malformed(f"tensor {name!r}: rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
        n_elements = 1
        for d in dims:
            n_elements *= d
        end = start + n_elements // block * block_bytes
        if end > self.size:
            raise _Malformed(f"the data of tensor {name!r} (bytes {start} to {end}) runs past the end of the "
                             f"file ({self.size} bytes): is it truncated?")
