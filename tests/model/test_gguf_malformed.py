"""Malformed GGUF files are a ValueError naming the file and what is wrong, and nothing
is cached for them (model/gguf_header.py; gguf_loader.gguf_model_dir's folder is keyed
by the file's header, not by its size and modification time).

Field case C86: an outsider's 18 malformed files. Five gave a bare `IndexError: index 0 is
out of bounds` naming neither the file nor the problem (a tensor of n_dims 5, a tensor
or kv count of 2**62, a string or array length of 2**40); a zero dim and a Q2_K or
IQ2_XXS projection named the tensor but not the file; a file corrupted in place with its
size and mtime kept (`cp -p`), then restored the same way, kept failing from the cache.
Each case here patches the bytes of a valid tiny GGUF (tiny_gguf.write_tiny_gguf).
"""
from __future__ import annotations

import os
import struct

import pytest
from tiny_gguf import write_tiny_gguf

from nanopaged import LLM, SamplingParams
from nanopaged.config import EngineConfig
from nanopaged.engine.arg_utils import create_engine_config
from nanopaged.quantization import gguf_loader
from nanopaged.quantization.gguf_loader import resolve_gguf_model
from nanopaged.model.gguf_convert import convert_gguf_to_hf

Q, UP = "blk.0.attn_q.weight", "blk.1.ffn_up.weight"      # 2-D tensors: [32, 32] and [32, 48], innermost first
Q2_K, IQ2_XXS = 10, 16                                     # GGML type ids; both in blocks of 256


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """gguf_model_dir's folders go to this test's own cache."""
    monkeypatch.setattr(gguf_loader, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "models" / "gguf"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("good") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


def after(raw: bytes, text: str) -> int:
    """The offset just past the first `text` in the file (a metadata key or a tensor's name)."""
    return raw.index(text.encode()) + len(text)


def patch(raw: bytes, *edits: tuple[int, str, int]) -> bytes:
    """raw with each (offset, struct format, value) written over it."""
    out = bytearray(raw)
    for offset, fmt, value in edits:
        struct.pack_into("<" + fmt, out, offset, value)
    return bytes(out)


def blocks_of_256(raw: bytes, type_id: int) -> bytes:
    """UP as a tensor of 48 rows of 256 in `type_id`: its name is followed by n_dims (u32),
    dims (u64 each), type (u32); the new data (48 x 84 or 66 bytes) fits in the old."""
    return patch(raw, (after(raw, UP) + 4, "Q", 256), (after(raw, UP) + 20, "I", type_id))


# case -> (the malformed bytes from the good ones, words the message holds)
CASES = {
    "n_dims_5": (lambda raw: patch(raw, (after(raw, Q), "I", 5)), [f"tensor '{Q}' has n_dims 5"]),
    "tensor_count_2**62": (lambda raw: patch(raw, (8, "Q", 2**62)),
                           ["tensor count 4611686018427387904 is larger than the file"]),
    "kv_count_2**62": (lambda raw: patch(raw, (16, "Q", 2**62)),
                       ["kv count 4611686018427387904 is larger than the file"]),
    "string_length_2**40": (lambda raw: patch(raw, (after(raw, "general.architecture") + 4, "Q", 2**40)),
                            ["metadata 'general.architecture'", "a string of 1099511627776 bytes runs past the end"]),
    "key_length_2**40": (lambda raw: patch(raw, (raw.index(b"general.architecture") - 8, "Q", 2**40)),
                         ["metadata key 0", "a string of 1099511627776 bytes"]),
    "array_length_2**40": (lambda raw: patch(raw, (after(raw, "tokenizer.ggml.tokens") + 8, "Q", 2**40)),
                           ["metadata 'tokenizer.ggml.tokens'", "an array of 1099511627776 items"]),
    "zero_dim": (lambda raw: patch(raw, (after(raw, Q) + 4, "Q", 0)), [f"tensor '{Q}' has a zero dimension"]),
    "unknown_type": (lambda raw: patch(raw, (after(raw, UP) + 20, "I", 1000)),
                     [f"tensor '{UP}' has unknown type 1000"]),
    "rows_not_whole_blocks": (lambda raw: patch(raw, (after(raw, UP) + 20, "I", Q2_K)),
                              [f"tensor '{UP}'", "rows of 32 are not whole Q2_K blocks of 256"]),
    "Q2_K_projection": (lambda raw: blocks_of_256(raw, Q2_K), [f"'{UP}' has type Q2_K", "supported: Q4_0"]),
    "IQ2_XXS_projection": (lambda raw: blocks_of_256(raw, IQ2_XXS), [f"'{UP}' has type IQ2_XXS"]),
    "truncated_data": (lambda raw: raw[:len(raw) // 2], ["the data of tensor", "runs past the end of the file",
                                                         "truncated"]),
    "truncated_header": (lambda raw: raw[:1000], ["runs past the end of the file (1000 bytes)"]),
    "bad_magic": (lambda raw: b"GGML" + raw[4:], ["starts with b'GGML', not the magic b'GGUF'"]),
    "version_1": (lambda raw: patch(raw, (4, "I", 1)), ["GGUF version 1 is not supported"]),
    "empty": (lambda raw: b"", ["0 bytes, shorter than a GGUF header"]),
    "n_dims_0xFFFFFFFF": (lambda raw: patch(raw, (after(raw, Q), "I", 0xFFFFFFFF)),
                          [f"tensor '{Q}' has n_dims 4294967295"]),
    "truncated_99%": (lambda raw: raw[:len(raw) * 99 // 100], ["runs past the end of the file", "truncated"]),
    # Q's info: name, n_dims (u32), 2 dims (u64), type (u32), then its data offset (u64)
    "offset_past_the_end": (lambda raw: patch(raw, (after(raw, Q) + 24, "Q", 2**40)),
                            [f"the data of tensor '{Q}'", "runs past the end of the file"]),
    "shape_of_55_GB": (lambda raw: patch(raw, (after(raw, Q) + 4, "Q", 55 * 2**30 // 128)),
                       [f"the data of tensor '{Q}'", "runs past the end of the file"]),
}
# types a layer does not run: refused before anything is cached; the converter dequantizes them
TYPE_CASES = {"Q2_K_projection", "IQ2_XXS_projection"}


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_file_is_a_value_error_naming_it_and_the_problem(case, good, tmp_path, cache):
    """resolve_gguf_model (what the engine calls on a user's .gguf) and create_engine_config
    (a .gguf model without quantization: is_gguf_file) raise ValueError, never another
    type, naming the file and what is wrong; no prepared folder is left behind."""
    make, words = CASES[case]
    path = tmp_path / "model.gguf"
    path.write_bytes(make(good))
    for load in (lambda: resolve_gguf_model(str(path)),
                 lambda: create_engine_config(EngineConfig(model=str(path), device="cpu"))):
        with pytest.raises(ValueError) as info:
            load()
        message = str(info.value)
        assert message.startswith(f"{path}: ") and all(w in message for w in words), message
    assert not cache.exists() or [p.name for p in cache.iterdir()] == []


@pytest.mark.parametrize("case", sorted(set(CASES) - TYPE_CASES))
def test_the_converter_names_the_file_and_the_problem_too(case, good, tmp_path):
    make, words = CASES[case]
    path = tmp_path / "model.gguf"
    path.write_bytes(make(good))
    with pytest.raises(ValueError) as info:
        convert_gguf_to_hf(path, tmp_path / "out", progress=False)
    assert str(path) in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_file_corrupted_and_restored_in_place_with_its_mtime_loads_again(good, tmp_path, cache):
    """The prepared folder is keyed by the file's header, not its size and mtime: a file
    corrupted in place with both kept (`cp -p`) is refused with the clear error, and once
    restored the same way it loads and gives the same ids as before; the failure left
    nothing in the cache."""
    path = tmp_path / "model.gguf"
    path.write_bytes(good)
    stat = path.stat()
    engine = dict(attention_backend="torch", block_size=4, num_gpu_blocks=32, dtype="float32", seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    llm = LLM(str(path), **engine)
    want = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    prepared = sorted(p.name for p in cache.iterdir())
    assert len(prepared) == 1

    for content, words in ((CASES["zero_dim"][0](good), [f"tensor '{Q}' has a zero dimension"]),
                           (good, None)):
        path.write_bytes(content)                         # in place: the same size, the old mtime
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
        if words is not None:
            with pytest.raises(ValueError) as info:
                LLM(str(path), **engine)
            assert str(path) in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
            assert sorted(p.name for p in cache.iterdir()) == prepared
            continue
        llm = LLM(str(path), **engine)
        assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
        assert llm.engine.config.quant_config.quantization == "gguf"
        llm.shutdown()
    assert sorted(p.name for p in cache.iterdir()) == prepared
