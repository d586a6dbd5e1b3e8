"""Tensor and pipeline parallelism on quantized weights (quantization="int8" and "gguf").

- tp: a rank holds the tp = 1 model's quantized rows of a column-parallel layer and
  columns of a row-parallel one (int8: the row scales of the whole row; GGUF: whole
  blocks, a split that cuts one is refused by name), and the engine at tp=2 gives tp=1's
  greedy ids, logprobs within fp32's rounding of the split sums (tests/logit_bounds.py's
  tp_logits_bound).
- pp: a stage loads and quantizes only its layers; the engine at pp=2 gives pp=1's ids
  and logprobs to the bit (a stage runs its layers' ops as tp=1 does).

Loading needs no collective, so the ranks' shards are loaded here one after another with
a stand-in process group; the engine tests start real worker processes (gloo).
"""
from __future__ import annotations

import gguf
import pytest
import torch
from logit_bounds import head_sums, logprobs_bound, tp_logits_bound
from tiny_gguf import write_gguf_from_hf

from nanopaged import LLM, SamplingParams
from nanopaged.features import Composition
from nanopaged.config import EngineConfig
from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.layers.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup
from nanopaged.layers.groups import PPGroup
from nanopaged.quantization import gguf as gguf_method
from nanopaged.quantization.int8 import dequantize
from nanopaged.quantization import gguf_loader
from nanopaged.model.model_loader import load_model, resolve_model

pytestmark = pytest.mark.timeout(300)

T = gguf.GGMLQuantizationType
# q, k, v of three types; the tied embedding in blocks (widened and split at tp > 1)
MIXED = {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.Q4_1, "ffn_gate": T.Q8_0,
         "ffn_up": T.Q4_0, "ffn_down": T.Q8_0, "token_embd": T.Q8_0}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32], list(range(100, 121))]


@pytest.fixture(autouse=True)
def _prepared_folders_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(gguf_loader, "cache_dir", lambda: tmp_path_factory.getbasetemp() / "gguf-cache")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"int8": the HF folder, "gguf": the GGUF file of the same tiny Llama}."""
    root = tmp_path_factory.mktemp("tp-quant")
    make_tiny_model(root / "hf", "LlamaForCausalLM", intermediate_size=192)
    write_gguf_from_hf(root / "hf", root / "model.gguf", "llama", quant=MIXED)
    return {"int8": root / "hf", "gguf": root / "model.gguf"}


def _load(path, quantization, rank=0, size=1, pp=None):
    config = EngineConfig(quantization=quantization, pipeline_parallel_size=pp.size if pp else 1,
                          distributed_executor_backend="mp" if pp else None)
    tp = TPGroup(rank, size, object() if size > 1 else None)      # loading calls no collective
    folder = gguf_loader.resolve_gguf_model(str(path)) if quantization == "gguf" else resolve_model(str(path))
    return load_model(folder, torch.float32, "cpu", 64, tp, pp,
                      model_class=lambda family: Composition.of(config).build(family, "model"))


def _dense(layer) -> torch.Tensor:
    """The layer's weight as the fp32 values its quant_method multiplies by."""
    method = layer.quant_method
    if hasattr(method, "scale"):
        return dequantize(method.qweight, method.scale)
    return torch.cat([gguf_method.dequantize(s.weight, s.type_id) if s.type_id else s.weight
                      for s in method.segments])


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_each_rank_holds_the_tp1_models_quantized_slices(models, quantization):
    whole = _load(models[quantization], quantization)
    for rank in range(2):
        shard = _load(models[quantization], quantization, rank, 2)
        for name, layer in shard.named_modules():
            if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                continue
            full, mine = _dense(whole.get_submodule(name)), _dense(layer)
            assert layer.weight is None
            if isinstance(layer, RowParallelLinear):                  # its columns, whole rows' scales
                k = mine.shape[1]
                assert torch.equal(mine, full[:, rank * k:(rank + 1) * k]), name
            else:                                                     # its rows of each stacked matrix
                offsets = whole.get_submodule(name).offsets
                for part, (_, first, n) in layer.parts.items():
                    rows = full[offsets[part] + first:offsets[part] + first + n]
                    assert torch.equal(mine[layer.offsets[part]:layer.offsets[part] + n], rows), (name, part)


def test_a_split_that_cuts_a_gguf_block_is_named(models):
    """tp=4: down_proj's k = 192 columns give each rank 48, a block of 32 and half of one."""
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight': tensor_parallel_size=4 splits its "
                                         r"k=192 columns into 48 per rank, which cuts its Q8_0 blocks of 32"):
        _load(models["gguf"], "gguf", 0, 4)


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_a_pipeline_stage_holds_only_its_layers_quantized(models, quantization):
    whole = _load(models[quantization], quantization)
    for stage in range(2):
        model = _load(models[quantization], quantization, pp=PPGroup(stage, 2, object()))
        held = [i for i, layer in enumerate(model.layers) if hasattr(layer, "self_attn")]
        assert held == [stage]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            layer = model.layers[stage].get_submodule(name)
            assert layer.weight is None and torch.equal(_dense(layer), _dense(whole.layers[stage].get_submodule(name)))


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
@pytest.mark.parametrize("grid", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_engine_on_two_ranks_equals_one(models, quantization, grid):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    kw = dict(quantization=quantization, dtype="float32", block_size=4, num_gpu_blocks=64,
              attention_backend="cpu")
    want = LLM(str(models[quantization]), **kw).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(models[quantization]), **grid, **kw)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    whole = _load(models[quantization], quantization)
    for ours, ref in zip(got, want):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(set(ours.outputs[0].token_ids)) > 1                 # not a degenerate model
        if "pipeline_parallel_size" in grid:                           # the same ops in the same order
            assert [{t: d[t].logprob for t in d} for d in ours.outputs[0].logprobs] == \
                   [{t: d[t].logprob for t in d} for d in ref.outputs[0].logprobs]
            continue
        # tp=2 splits o_proj's and down_proj's sums (K = 192, the MLP's width, the longest):
        # tp_logits_bound, (gamma_192 + gamma_97) S on the head's sums; a logprob at most
        # twice that, plus each side's log_softmax roundings (logprobs_bound); measured at
        # most 5.7e-6 apart, 0.01 of the bound
        tokens = ref.prompt_token_ids + ref.outputs[0].token_ids[:-1]
        head = whole.embed_tokens if whole.lm_head is None else whole.lm_head
        sums, logits = head_sums(whole, tokens, head.weight if head.quant_method is None else _dense(head))
        rows = slice(len(ref.prompt_token_ids) - 1, None)
        bound = logprobs_bound(tp_logits_bound(sums[rows], 192, 2), logits[rows])[:, 0].tolist()
        for a, b, limit in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs, bound):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= limit for t in a)
    llm.shutdown()
