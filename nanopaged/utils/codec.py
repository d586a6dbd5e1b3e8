"""A typed, data-only codec for the messages that cross hosts (msgspec's MessagePack).

pickle runs code chosen by whoever wrote the bytes: a message unpickled from a socket
that another host can reach hands that host the process (vLLM's CVE-2025-30165, pickle
over ZeroMQ between nodes). vLLM v1 moved to msgspec for this reason; so do we. Here a
message is plain data (None, bool, int, float, str, bytes, list, dict) plus five kinds
of MessagePack extension, each rebuilt by this module and nothing else:

    OBJECT   a registered dataclass: its name and its fields, each checked against the
             field's annotation (msgspec.convert) and the class's own __post_init__
    TUPLE, SET, FROZENSET   the Python containers MessagePack lacks
    TENSOR   a torch.Tensor as raw bytes with its dtype and shape, the sizes checked
    DTYPE    a torch.dtype, by name

A class that crosses hosts is registered by the module that owns it (`register`); the
codec knows no message and no feature. Anything else (a class not registered, a lambda,
a module) cannot be encoded, and bytes that do not decode to the above raise CodecError:
the receiver drops them with one line that does not echo them.

    data = encode(SchedulerOutput(...))     # bytes
    obj = decode(data)                      # SchedulerOutput, or CodecError
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import msgspec
import torch

OBJECT, TUPLE, SET, FROZENSET, TENSOR, DTYPE = range(1, 7)
MAX_DIMS = 8                       # no message holds a tensor of more dimensions
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool)}


class CodecError(ValueError):
    """Bytes that are not a message this process knows (malformed, or a class not
    registered here). Its text names the problem, never the bytes."""


@dataclasses.dataclass
class _Entry:
    cls: type
    init_fields: tuple[str, ...]       # passed to the constructor (its checks run)
    state_fields: tuple[str, ...]      # init=False fields, set after it, as sent
    typed: bool                        # msgspec can check the fields' annotations
    state_types: dict[str, Any]        # the state fields' annotations, when typed


_REGISTRY: dict[str, _Entry] = {}
_BY_CLASS: dict[type, str] = {}


def register(*classes: type) -> None:
    """Let these dataclasses cross hosts (idempotent). A feature package calls this for
    its own messages; the base calls it in messages.py.

    Raises:
        TypeError: a class that is not a dataclass, or two classes with one name.
    """
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"codec.register: {cls!r} is not a dataclass")
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise TypeError(f"codec.register: another class is registered as {name}")
        fs = dataclasses.fields(cls)
        try:                             # e.g. `str | os.PathLike` is beyond msgspec's types
            msgspec.inspect.type_info(cls)
            typed = True
        except (TypeError, ValueError):
            typed = False
        state = tuple(f.name for f in fs if not f.init)
        hints = typing.get_type_hints(cls) if typed and state else {}
        _REGISTRY[name] = _Entry(cls, tuple(f.name for f in fs if f.init), state, typed,
                                 {f: hints[f] for f in state if f in hints})
        _BY_CLASS[cls] = name


# -- encoding ---------------------------------------------------------------------------------

def _enc_hook(obj: Any) -> Any:
    """What msgspec cannot write itself and _wrap left as it was: tensors and dtypes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"codec: a tensor of dtype {t.dtype} cannot cross hosts")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return msgspec.msgpack.Ext(TENSOR, _ENCODER.encode([name, list(t.shape), raw]))
    if isinstance(obj, torch.dtype):
        return msgspec.msgpack.Ext(DTYPE, _ENCODER.encode(str(obj).removeprefix("torch.")))
    raise TypeError(f"codec: {type(obj).__qualname__} is not registered to cross hosts (codec.register)")


def _wrap(obj: Any) -> Any:
    """obj with every registered dataclass made an OBJECT extension: msgspec would
    otherwise write a dataclass as a bare map, its class lost."""
    if type(obj) in (int, float, str, bool, bytes) or obj is None:
        return obj
    name = _BY_CLASS.get(type(obj))
    if name is not None:
        entry = _REGISTRY[name]
        values = [_wrap(getattr(obj, f)) for f in (*entry.init_fields, *entry.state_fields)]
        return msgspec.msgpack.Ext(OBJECT, _ENCODER.encode([name, values]))
    if isinstance(obj, list):
        return [_wrap(v) for v in obj]
    if isinstance(obj, dict):
        return {_wrap(k): _wrap(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, set, frozenset)):
        kind = TUPLE if isinstance(obj, tuple) else FROZENSET if isinstance(obj, frozenset) else SET
        return msgspec.msgpack.Ext(kind, _ENCODER.encode([_wrap(v) for v in obj]))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        raise TypeError(f"codec: {type(obj).__qualname__} is not registered to cross hosts (codec.register)")
    return obj


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(obj: Any) -> bytes:
    """obj as bytes. Raises TypeError for anything that is not plain data, a tensor, a
    dtype or a registered dataclass (nothing unknown is sent)."""
    return _ENCODER.encode(_wrap(obj))


# -- decoding ---------------------------------------------------------------------------------

def _dec_hook(type_: type, obj: Any) -> Any:
    """msgspec.convert meets a type it does not know (torch.Tensor): the value was
    already rebuilt by _ext_hook; it must be of that type."""
    if isinstance(type_, type) and isinstance(obj, type_):
        return obj
    raise msgspec.ValidationError(f"expected {getattr(type_, '__name__', type_)}, got {type(obj).__name__}")


def _object(data: memoryview) -> Any:
    name, values = _DECODER.decode(data)
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise CodecError("an object of a class not registered in this process")
    names = (*entry.init_fields, *entry.state_fields)
    if not isinstance(values, list) or len(values) != len(names):
        raise CodecError(f"a {entry.cls.__name__} with {len(values) if isinstance(values, list) else 'no'} "
                         f"fields, not {len(names)}")
    init = dict(zip(entry.init_fields, values))
    try:
        obj = (msgspec.convert(init, entry.cls, dec_hook=_dec_hook, strict=True) if entry.typed
               else entry.cls(**init))                     # the class's own checks run either way
        for f, value in zip(entry.state_fields, values[len(entry.init_fields):]):
            if entry.typed:            # derived state (e.g. SamplingParams' tokenized stop ids), as sent
                value = msgspec.convert(value, entry.state_types[f], dec_hook=_dec_hook, strict=True)
            object.__setattr__(obj, f, value)
    except msgspec.ValidationError as e:       # its text names the type and the path, not the value
        raise CodecError(f"a {entry.cls.__name__} whose fields do not check: {str(e)[:200]}") from None
    except (TypeError, ValueError) as e:       # the class's own checks quote the value: not repeated
        raise CodecError(f"a {entry.cls.__name__} whose fields do not check ({type(e).__name__})") from None
    return obj


def _tensor(data: memoryview) -> torch.Tensor:
    name, shape, raw = _DECODER.decode(data)
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CodecError("a tensor of a dtype that does not cross hosts")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise CodecError(f"a tensor whose shape is not up to {MAX_DIMS} sizes >= 0")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not isinstance(raw, bytes) or math.prod(shape) * itemsize != len(raw):
        raise CodecError("a tensor whose bytes do not match its shape and dtype")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == OBJECT:
        return _object(data)
    if code in (TUPLE, SET, FROZENSET):
        items = _DECODER.decode(data)
        if not isinstance(items, list):
            raise CodecError("a container that is not a list of items")
        return (tuple, set, frozenset)[code - TUPLE](items)
    if code == TENSOR:
        return _tensor(data)
    if code == DTYPE:
        name = _DECODER.decode(data)
        if name not in _DTYPES:
            raise CodecError("a dtype that does not cross hosts")
        return _DTYPES[name]
    raise CodecError(f"an extension of unknown kind {code}")


_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def decode(data: bytes | memoryview, expected: type | tuple[type, ...] | None = None) -> Any:
    """The object encode() wrote. expected: the type (or types) the receiver takes here.

    Raises:
        CodecError: bytes that are not such an object, a class not registered in this
            process, fields that fail their annotation or their class's checks, a tensor
            whose bytes do not match its shape, or not of `expected`. The text never
            quotes the bytes.
    """
    try:
        obj = _DECODER.decode(data)
    except CodecError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError, RecursionError, MemoryError) as e:
        raise CodecError(f"not a message ({type(e).__name__})") from None
    if expected is not None and not isinstance(obj, expected):
        raise CodecError(f"a {type(obj).__name__} where {_names(expected)} was expected")
    return obj


def _names(expected: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))

