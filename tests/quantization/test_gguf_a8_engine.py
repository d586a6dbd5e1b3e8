"""activation_quantization="int8" through the engine (quantization/gguf_a8.py):
the tiny random checkpoints written as quantized GGUF files (tests/tiny_gguf.py),
run with x rounded to int8 blocks in the block formats' matmuls (float tensors exact). It is not exact, so: close to the exact mode, batch-invariant, the PyTorch
reference close to the kernels, and the config refuses it without quantization="gguf".
"""
from __future__ import annotations

import math

import pytest
import torch
from test_gguf_quantized import K_QUANT_CASES, K_QUANT_SIZES, PROMPTS, QUANT
from tiny_gguf import write_gguf_from_hf

from nanopaged import LLM, SamplingParams
from nanopaged.config import EngineConfig
from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.quantization.gguf import GGUFLinearMethod
from nanopaged.quantization.gguf_a8 import A8_TYPES, GGUFA8LinearMethod
from nanopaged.quantization import gguf_loader

pytestmark = pytest.mark.exactness

CASES = [("LlamaForCausalLM", "llama", "Q4_1"), ("LlamaForCausalLM", "llama", "mixed"),
         ("Qwen3ForCausalLM", "qwen3", "Q4_K_M"), ("Qwen2ForCausalLM", "qwen2", "Q5")]   # Q5_0, Q5_1, Q5_K
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
KW = dict(block_size=4, num_gpu_blocks=128, enable_prefix_caching=False)


@pytest.fixture(autouse=True)
def _prepared_folders_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(gguf_loader, "cache_dir", lambda: tmp_path_factory.getbasetemp() / "gguf-cache")


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[1]}-{c[2]}")
def gguf_file(request, tmp_path_factory):
    architecture, arch, quant = request.param
    root = tmp_path_factory.mktemp(f"a8-{arch}-{quant}")
    make_tiny_model(root / "hf", architecture, tie=arch != "qwen3",
                    **(K_QUANT_SIZES if quant in K_QUANT_CASES else {}))
    write_gguf_from_hf(root / "hf", root / "model.gguf", arch, quant=QUANT[quant])
    return str(root / "model.gguf")


def test_each_block_layer_rounds_x_and_the_rest_stays_exact(gguf_file):
    llm = LLM(gguf_file, quantization="gguf", activation_quantization="int8", attention_backend="cpu", **KW)
    methods = [m.quant_method for m in llm.engine.model_runner.model.modules()
               if getattr(m, "quant_method", None) is not None]
    assert methods and all(type(m) is GGUFA8LinearMethod for m in methods)
    types = {s.type_id for m in methods for s in m.segments}
    assert types & A8_TYPES                               # some segments run against int8 x
    exact = LLM(gguf_file, quantization="gguf", attention_backend="cpu", **KW)
    assert all(type(m.quant_method) is GGUFLinearMethod for m in exact.engine.model_runner.model.modules()
               if getattr(m, "quant_method", None) is not None)
    got, want = (e.generate(PROMPTS, GREEDY, use_tqdm=False) for e in (llm, exact))
    diffs, agree, total = [], 0, 0
    for a, b in zip(got, want):
        agree += a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        # the first token's context is the prompt alone in both: compare its top logprobs
        for token, lp in b.outputs[0].logprobs[0].items():
            if token in a.outputs[0].logprobs[0]:
                diffs.append(abs(a.outputs[0].logprobs[0][token].logprob - lp.logprob))
        total += 1
    assert agree == total                                 # the tiny models' margins are wide enough
    assert 0 < max(diffs) < 0.3, diffs     # moved (hidden 64-256: two to eight blocks a row), not much
    assert all(math.isfinite(d) for d in diffs)


def test_engine_is_batch_invariant(gguf_file):
    llm = LLM(gguf_file, quantization="gguf", activation_quantization="int8", attention_backend="cpu",
              max_num_batched_tokens=16, max_num_seqs=8, **KW)

    def target(prompts):
        out = llm.generate(prompts, GREEDY, use_tqdm=False)[prompts.index(PROMPTS[2])].outputs[0]
        return out.token_ids, out.logprobs
    alone = target([PROMPTS[2]])
    assert target(PROMPTS) == alone
    assert target([PROMPTS[0], PROMPTS[2]]) == alone


# Compared where the two paths meet, not ten layers later. Rounding x to int8 is a step
# function: the reference's x (norm and attention in other code, a few ulps away from the
# kernels') can put one value of qx on the other side of a rounding boundary, and a tiny
# random model amplifies that one step to 0.01-0.03 in the last layer's logprobs (measured
# on the Q5 and Q4_K_M models), which no derivable tolerance covers. So every int8 matmul
# the kernels' engine runs is recomputed by the PyTorch reference on the very x the kernel
# got, and each must be the exact product of x's rounded values within its own fp32 error;
# the reference engine is then only run end to end.
@pytest.mark.parametrize("gguf_file", CASES, indirect=True, ids=lambda c: f"{c[1]}-{c[2]}")
def test_the_pytorch_reference_agrees_on_the_kernels_own_inputs(gguf_file, monkeypatch):
    """attention_backend="torch": gguf_linear_a8's reference (x's rounded values times the
    dequantized weights) on each x of the kernels' engine (eager, so every call is seen)
    agrees with the kernel's result, both within fp32 error of the exact product; the
    reference's own engine serves the same prompts."""
    from gguf_blocks import assert_both_near_the_exact_product

    from nanopaged.layers.backends import TorchOps
    from nanopaged.quantization import gguf_a8

    kernels = LLM(gguf_file, quantization="gguf", activation_quantization="int8", attention_backend="cpu",
                  enforce_eager=True, **KW)
    layers = [m for m in kernels.engine.model_runner.model.modules()
              if type(getattr(m, "quant_method", None)) is GGUFA8LinearMethod]
    calls, run = [], gguf_a8.gguf_linear_a8

    def record(ops, out, x, qweight, type_id):
        run(ops, out, x, qweight, type_id)
        calls.append((x.clone(), qweight, type_id, out.clone()))
    monkeypatch.setattr(gguf_a8, "gguf_linear_a8", record)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    kernels.generate(PROMPTS, params, use_tqdm=False)
    assert {t for _, _, t, _ in calls} == {s.type_id for m in layers for s in m.quant_method.segments} & A8_TYPES
    for x, qweight, type_id, got in calls:
        want = torch.empty_like(got)
        run(TorchOps(), want, x, qweight, type_id)
        assert_both_near_the_exact_product(got, want, x, qweight, type_id)
    reference = LLM(gguf_file, quantization="gguf", activation_quantization="int8", attention_backend="torch", **KW)
    outs = reference.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 and all(math.isfinite(lp.logprob) for row in o.outputs[0].logprobs
                                                         for lp in row.values()) for o in outs)


def test_config_names_the_field_and_the_value():
    with pytest.raises(ValueError, match=r"activation_quantization.*quantization is 'int8'\), got 'int8'"):
        EngineConfig(quantization="int8", activation_quantization="int8")
    with pytest.raises(ValueError, match=r"activation_quantization.*got 'fp8'"):
        EngineConfig(quantization="gguf", activation_quantization="fp8")
    assert EngineConfig(quantization="gguf", activation_quantization="int8").quant_config.activation_quantization == "int8"


def test_int8_activations_alone_run_the_default_models_file():
    """activation_quantization="int8" with no quantization: the default model in float32
    on the CPU runs its GGUF file (default_model_weights), so it is accepted; any other
    model, or the default one in bfloat16 (which runs its folder), is refused by name."""
    from nanopaged.engine.arg_utils import default_model_weights
    cpu = dict(device="cpu", activation_quantization="int8")
    config = default_model_weights(EngineConfig(dtype="float32", **cpu))
    assert (config.quant_config.quantization, config.quant_config.activation_quantization) == ("gguf", "int8")
    with pytest.raises(ValueError, match=r"activation_quantization='int8' multiplies GGUF blocks: give "
                                         r"quantization='gguf'.*here quantization=None, model='some/folder', "
                                         r"dtype float32, device cpu"):
        default_model_weights(EngineConfig(model="some/folder", dtype="float32", **cpu))
    with pytest.raises(ValueError, match=r"quantization=None, model=None, dtype bfloat16"):
        default_model_weights(EngineConfig(dtype="bfloat16", **cpu))
