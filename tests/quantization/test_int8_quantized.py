"""Weight-only int8 (quantization="int8", quantization/int8.py): a Hugging Face
folder's projections quantized at load, per output row, symmetric.

Each tiny random checkpoint of every family (make_tiny_model) is also written as its
"dequantized model": every projection replaced by q * scale, quantized here in numpy
(`reference_quantize`), in transformers' own model. The int8 engine must give that
folder's logits bit for bit (float32, the C++ kernels), transformers' within fp32's
rounding of sums added in other orders (tests/logit_bounds.py), and the same greedy ids
and logprobs through the engine.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import paged_logits
from error_bounds import assert_within
from logit_bounds import logits_bound

from nanopaged import LLM, SamplingParams
from nanopaged.features import Composition
from nanopaged.config import EngineConfig
from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.layers.backends import TorchOps, get_ops
from nanopaged.quantization.int8 import dequantize, int8_linear, quantize
from nanopaged.model.model_loader import load_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = [("LlamaForCausalLM", True), ("MistralForCausalLM", True), ("Qwen2ForCausalLM", True),
         ("Qwen3ForCausalLM", False)]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32], list(range(100, 121))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
KW = dict(block_size=4, num_gpu_blocks=128, attention_backend="cpu")


def reference_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The method's definition in numpy: scale = max|row| / 127 (float32), q = round half
    to even of w / scale, clamped to [-127, 127]."""
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=1) / np.float32(127)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0].removesuffix("ForCausalLM"))
def files(request, tmp_path_factory):
    """(the checkpoint's folder, its dequantized model's folder, that model in transformers,
    {projection's HF name: (q, scale)})."""
    architecture, tie = request.param
    root = tmp_path_factory.mktemp(architecture)
    hf = make_tiny_model(root / "hf", architecture, tie=tie)
    quantized = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.split(".")[-2] in PROJECTIONS and name.endswith(".weight"):
                q, scale = reference_quantize(param.numpy())
                quantized[name] = (q, scale)
                param.copy_(torch.from_numpy(q.astype(np.float32) * scale[:, None]))
    hf.save_pretrained(root / "dequantized")
    for f in (root / "hf").iterdir():
        if not f.name.endswith(".safetensors") and not (root / "dequantized" / f.name).exists():
            shutil.copy(f, root / "dequantized" / f.name)
    return root / "hf", root / "dequantized", hf, quantized


def _model(folder, quantization, backend="cpu"):
    config = EngineConfig(quantization=quantization)
    model = load_model(folder, torch.float32, "cpu", 64,
                       model_class=lambda family: Composition.of(config).build(family, "model"))
    model.set_ops(get_ops(backend, "cpu"))
    return model


def test_weights_are_the_reference_quantization(files):
    folder, _, _, quantized = files
    model = _model(folder, "int8")
    for i, layer in enumerate(model.layers):
        for ours, parts in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            (layer.self_attn.o_proj, ("self_attn.o_proj",)),
                            (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                            (layer.mlp.down_proj, ("mlp.down_proj",))):
            want = [quantized[f"model.layers.{i}.{p}.weight"] for p in parts]
            method = ours.quant_method
            assert ours.weight is None and method.qweight.dtype == torch.int8
            assert np.array_equal(method.qweight.numpy(), np.concatenate([q for q, _ in want]))
            assert np.array_equal(method.scale.numpy(), np.concatenate([s for _, s in want]))
            assert method.nbytes == method.qweight.numel() + 4 * method.scale.numel()
    for vocab in (model.embed_tokens, model.lm_head):       # the embedding and the head stay fp32
        assert vocab is None or (vocab.quant_method is None and vocab.weight.dtype == torch.float32)


def test_logits_equal_the_dequantized_models_bit_for_bit(files):
    folder, dequantized, hf, _ = files
    int8, reference = _model(folder, "int8"), _model(dequantized, None)
    tokens = list(range(40, 52))
    with torch.no_grad():
        transformers_logits = hf(torch.tensor([tokens])).logits[0]
    # transformers: both fp32, summed in other orders; logit_bounds' 2 (K + 1) u sum |h||W|,
    # K = 128 (the MLP's width); measured at most 0.09 of it (1.7e-5, Llama)
    bound = logits_bound(hf, tokens)
    for block_size, prefill in ((4, 5), (16, 1)):                   # prefill rows, then decode rows
        got = paged_logits(int8, tokens, block_size, prefill)
        want = paged_logits(reference, tokens, block_size, prefill)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), block_size
        assert_within(got, transformers_logits, bound, f"block_size={block_size}")


def test_engine_gives_the_dequantized_models_ids_and_logprobs(files):
    folder, dequantized, hf, _ = files
    int8 = LLM(str(folder), quantization="int8", **KW)
    assert int8.engine.config.dtype == "float32"                     # "auto" with quantization
    model = int8.engine.model_runner.model                           # what the tracer shows
    methods = [m.quant_method for m in model.modules() if getattr(m, "quant_method", None) is not None]
    assert int8.engine.weights.bytes_by_format["int8"] == sum(m.qweight.numel() for m in methods) > 0
    assert int8.engine.weights.nbytes == sum(m.nbytes for m in methods) + sum(
        p.numel() * 4 for p in model.parameters())
    reference = LLM(str(dequantized), dtype="float32", **KW)
    got, want = (llm.generate(PROMPTS, GREEDY, use_tqdm=False) for llm in (int8, reference))
    for prompt, a, b in zip(PROMPTS, got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert len(set(a.outputs[0].token_ids)) > 1                  # not a degenerate model
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):]
        assert a.outputs[0].token_ids == ids.tolist()                # transformers on the dequantized weights
    # batch invariance: each prompt alone gives the batch's bits
    for prompt, a in zip(PROMPTS, got):
        alone = int8.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == a.outputs[0].token_ids and alone.outputs[0].logprobs == a.outputs[0].logprobs


def test_the_pytorch_reference_runs_it_too(files):
    """attention_backend="torch": each projection dequantized, then F.linear (TorchOps)."""
    folder, dequantized, _, _ = files
    kw = dict(KW, attention_backend="torch")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(str(folder), quantization="int8", **kw).generate(PROMPTS, params, use_tqdm=False)
    want = LLM(str(dequantized), dtype="float32", **kw).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("n,k", [(37, 64), (5, 100), (64, 576), (9, 3)])
def test_kernel_equals_the_fp32_linear_on_the_dequantized_weights(n, k):
    """Bit for bit, for m = 1 (decode), m > 4 (several tiles) and from 16 rows (the
    whole matrix widened once, then the fp32 matmul), k not a multiple of the vector
    width included; each row's bits do not depend on the batch."""
    ops = get_ops("cpu", "cpu")
    g = torch.Generator().manual_seed(n * k)
    q, scale = quantize(torch.randn(n, k, generator=g))
    q[0].zero_()                                                    # negative zero and a zero row's scale
    w = dequantize(q, scale)
    x = torch.randn(40, k, generator=g)
    y = int8_linear(ops, x, q, scale)
    assert torch.equal(y, ops.linear(x, w))
    assert torch.equal(int8_linear(TorchOps(), x, q, scale), torch.nn.functional.linear(x, w))
    for m in (1, 5, 15, 16):
        assert torch.equal(int8_linear(ops, x[:m].contiguous(), q, scale), y[:m]), m


def test_quantize_rules():
    w = torch.tensor([[0.5, -1.27, 0.004, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize(w)
    assert scale.tolist() == [pytest.approx(0.01), 1.0]             # a zero row: scale 1, q 0
    assert q.tolist() == [[50, -127, 0, 0], [0, 0, 0, 0]]
    q, _ = quantize(torch.tensor([[1.0, 3.0]]), absmax=torch.tensor([2.0]))   # a row part, its whole row's max
    assert q.tolist() == [[64, 127]]                                # 3 / (2 / 127) clamped
