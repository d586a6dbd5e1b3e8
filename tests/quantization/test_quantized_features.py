"""Everything else on quantized weights (issue 37): prefix caching, preemption, n > 1,
beam search, structured outputs and speculative decoding (a quantized draft too) run on
a GGUF file as shipped and on int8, and give what the same engine gives on the
dequantized model's folder: the same ids, logprobs and beams (float32, the C++ kernels,
where a quantized matmul has the dequantized one's bits).

The checkpoint is a tiny random Llama (make_tiny_model). "gguf": written as llama.cpp
writes a file of several block types (tests/tiny_gguf.py), its reference the
converter's dequantized folder. "int8": the folder itself, its reference the folder with
every projection replaced by q * scale (test_int8_quantized's reference_quantize).
"""
from __future__ import annotations

import re

import gguf
import pytest
import torch
from logit_bounds import head_sums, logprobs_bound
from test_int8_quantized import PROJECTIONS, reference_quantize
from tiny_gguf import write_gguf_from_hf

from nanopaged import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.quantization import gguf_loader
from nanopaged.model.gguf_convert import convert_gguf_to_hf
from nanopaged.model.model_loader import load_model

T = gguf.GGMLQuantizationType
MIXED = {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.Q4_1,
         "ffn_gate": T.Q4_1, "ffn_up": T.Q8_0, "ffn_down": T.Q4_0, "token_embd": T.Q8_0}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32], list(range(100, 121))]
KW = dict(block_size=4, num_gpu_blocks=128, attention_backend="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def _prepared_folders_in_tmp(tmp_path_factory, monkeypatch):
    scratch = tmp_path_factory.getbasetemp() / "gguf-cache"
    monkeypatch.setattr(gguf_loader, "cache_dir", lambda: scratch)


@pytest.fixture(scope="module", params=["gguf", "int8"])
def pair(request, tmp_path_factory):
    """(the quantized model as LLM's `model`, its quantization, the dequantized folder)."""
    root = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(root / "hf", "LlamaForCausalLM", tie=True)
    if request.param == "gguf":
        write_gguf_from_hf(root / "hf", root / "model.gguf", "llama", quant=MIXED)
        return str(root / "model.gguf"), "gguf", str(convert_gguf_to_hf(root / "model.gguf", root / "deq",
                                                                        progress=False))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.split(".")[-2] in PROJECTIONS and name.endswith(".weight"):
                q, scale = reference_quantize(param.numpy())
                param.copy_(torch.from_numpy(q.astype("float32") * scale[:, None]))
    hf.save_pretrained(root / "deq")
    for f in (root / "hf").iterdir():
        if not (root / "deq" / f.name).exists():
            (root / "deq" / f.name).write_bytes(f.read_bytes())
    return str(root / "hf"), "int8", str(root / "deq")


def both(pair, **kw):
    model, quantization, reference = pair
    return LLM(model, quantization=quantization, **{**KW, **kw}), LLM(reference, **{**KW, **kw})


def seqs(outs):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def test_prefix_cache_hits_and_n_2_sampling_give_the_references_outputs(pair):
    shared = list(range(40, 60))                          # 5 blocks of 4 a second request finds cached
    prompts = [shared + [7, 8], shared + [9]]
    params = [SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)]
    quantized, reference = both(pair)
    got = [seqs(quantized.generate([p], s, use_tqdm=False)) for p, s in zip(prompts, params)]
    want = [seqs(reference.generate([p], s, use_tqdm=False)) for p, s in zip(prompts, params)]
    assert got == want
    assert quantized.engine.get_stats()["prefix_cache_hits"] > 0
    assert len({tuple(t) for t, _ in got[0][0]}) == 2         # the two samples differ


def test_preemption_gives_the_references_outputs(pair):
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    tight = dict(num_gpu_blocks=14, num_cpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    quantized, _ = both(pair, **tight)
    _, reference = both(pair)
    assert seqs(quantized.generate(PROMPTS, params, use_tqdm=False)) == \
        seqs(reference.generate(PROMPTS, params, use_tqdm=False))
    assert quantized.engine.get_stats()["num_preemptions"] > 0


def test_beam_search_gives_the_references_beams(pair):
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    got, want = ([[(s.tokens, s.cum_logprob) for s in o.sequences] for o in llm.beam_search(PROMPTS[:2], params)]
                 for llm in both(pair))
    assert got == want and len(got[0]) == 3


def test_structured_output_gives_the_references_text(pair):
    pattern = "[0-9]{2}-[a-z]{3}"
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=pattern))
    got, want = ([o.outputs[0].text for o in llm.generate(["Code:", "Hello"], params, use_tqdm=False)]
                 for llm in both(pair))
    assert got == want
    assert all(re.fullmatch(pattern, text) for text in got), got


def test_speculative_decoding_with_a_quantized_draft_keeps_the_ids(pair):
    """n-gram drafts, and the quantized model as its own draft (speculative_config's
    quantization, vLLM's field: every draft accepted), on a quantized target and on the
    fp32 reference: greedy ids as without speculation."""
    model, quantization, reference = pair
    prompts = PROMPTS + [[5, 6, 7, 8] * 4]                 # its last token seen before: n-gram drafts
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(reference, **KW).generate(prompts, greedy, use_tqdm=False)]
    draft = {"method": "draft_model", "model": model, "quantization": quantization, "num_speculative_tokens": 3}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    for target, target_quantization, spec in ((model, quantization, ngram), (model, quantization, draft),
                                              (reference, None, draft)):
        llm = LLM(target, quantization=target_quantization, speculative_config=spec, **KW)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want, spec
        stats = llm.engine.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        if spec is draft and target_quantization is not None:
            assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
        if spec is draft:                                   # the draft's own format is in the weights
            assert quantization.replace("gguf", "Q4_1").upper() in llm.engine.weights.describe().upper()


def test_a_gguf_draft_runs_as_gguf_without_quantization_given(pair):
    """A .gguf file as the draft, no speculative_config.quantization given, runs as GGUF
    as a .gguf model does (arg_utils.is_gguf_file): itself as its draft, every draft accepted."""
    model, quantization, _ = pair
    if quantization != "gguf":
        pytest.skip("a .gguf file only")
    llm = LLM(model, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 2}, **KW)
    assert (llm.engine.config.quant_config.quantization, llm.engine.config.speculative_config.quantization) == ("gguf", "gguf")
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def test_a_bad_draft_quantization_is_named(pair):
    model, quantization, _ = pair
    with pytest.raises(ValueError, match="speculative_config.quantization"):
        LLM(model, quantization=quantization, **KW,
            speculative_config={"method": "draft_model", "model": model, "quantization": "int4"})
    with pytest.raises(ValueError, match="speculative_config.quantization is for method 'draft_model'"):
        LLM(model, quantization=quantization, **KW, speculative_config={"method": "ngram", "quantization": "int8"})


def test_load_lines_name_the_weights_file_and_the_drafts_formats(pair, capsys):
    """The log names the .gguf the weights come from (not the folder prepared beside it),
    and the draft's formats and bytes as the target's line does."""
    model, quantization, _ = pair
    draft = {"method": "draft_model", "model": model, "quantization": quantization, "num_speculative_tokens": 2}
    LLM(model, quantization=quantization, speculative_config=draft, **KW)
    err = capsys.readouterr().err
    assert f"loading weights from {model} (float32" in err, err
    fmt = "Q8_0" if quantization == "gguf" else "int8"
    assert re.search(rf"draft model loaded from {re.escape(model)} \(\d+ layers\): .*{fmt} [\d.]+ MB", err), err


def test_bfloat16_activations_are_batch_invariant(pair):
    """dtype="bfloat16" on quantized weights (emulated on a CPU without bf16 units): a
    prompt's greedy ids and logprobs alone, in a batch with chunked prefills, and alone
    again are the same floats."""
    model, quantization, _ = pair
    llm = LLM(model, quantization=quantization, **{**KW, "dtype": "bfloat16"}, max_num_batched_tokens=16,
              max_num_seqs=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def target(prompts):
        out = llm.generate(prompts, params, use_tqdm=False)[prompts.index(PROMPTS[2])].outputs[0]
        return out.token_ids, out.logprobs
    alone = target([PROMPTS[2]])
    assert target(PROMPTS) == alone
    assert target([PROMPTS[0], PROMPTS[2]]) == alone
    assert target([PROMPTS[2]]) == alone


def test_bfloat16_activations_widen_then_sum_in_float32(pair):
    """A quantized layer given bf16 rows widens them (exact), runs the float32 matmul, and
    rounds y once: its bf16 output is the float32 path's output rounded. The whole engine
    in bf16, and the dequantized model's, give prompt logprobs within bf16's rounding of
    their float32 selves'."""
    model, quantization, _ = pair
    llm = LLM(model, quantization=quantization, **{**KW, "dtype": "bfloat16"})
    net = llm.engine.engine_core.executor.driver_worker.model
    layers = [m for m in net.modules() if getattr(m, "quant_method", None) is not None]
    assert layers and net.norm.weight.dtype == torch.bfloat16
    for layer in layers:
        method = layer.quant_method
        k = method.input_size if quantization == "gguf" else method.qweight.shape[1]
        x = torch.randn(5, k).to(torch.bfloat16)
        got = method.apply(layer, x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, method.apply(layer, x.float()).to(torch.bfloat16))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    # bf16 sums in fp32 but stores every tensor in bf16 (8 significant bits: a rounding
    # moves a value by at most u = 2^-8 of it). A term of the head's sum carries the
    # weights' rounding, per layer those of the residual add and the norm (fused, 2),
    # qkv_proj, RoPE's tables and output (2), attention, o_proj, the second add and norm
    # (2), gate_up_proj, SiLU-and-mul and down_proj: 12, and the final add and norm's
    # (2): 12 L + 3 = 27 (L = 2). Charged at the head's S = sum |h||W|, every error of one
    # sign (logit_bounds' worst case, which covers what the layers' roundings become on
    # the way), a logit is within 27 2^-8 S of the float32 engine's, which is within
    # (K + 1) 2^-24 S (K = 128) of exact; a logprob within twice the row's largest plus
    # each side's log_softmax roundings (logprobs_bound). Measured at most 0.074 of it
    # (int8; gguf 0.026), the dequantized folders 0.053.
    fp32 = load_model(pair[2], torch.float32, "cpu", 64)      # the weights' values, for S
    bounds = [logprobs_bound((27 * 2.0 ** -8 + 129 * 2.0 ** -24) * sums, logits)[:, 0]
              for sums, logits in (head_sums(fp32, p) for p in PROMPTS)]

    def assert_bf16_within_bound(folder, quantization=None):
        runs = [LLM(folder, quantization=quantization, **{**KW, "dtype": dt}).generate(PROMPTS, params, use_tqdm=False)
                for dt in ("float32", "bfloat16")]
        err = 0.0
        for a, b, bound in zip(*runs, bounds):
            for pos in range(1, len(a.prompt_token_ids)):             # logprob of token pos, from row pos - 1
                diff = abs(next(iter(a.prompt_logprobs[pos].values())).logprob
                           - next(iter(b.prompt_logprobs[pos].values())).logprob)
                assert diff <= bound[pos - 1], (folder, pos, diff, bound[pos - 1].item())
                err = max(err, diff)
        assert err > 0                                                # bf16 did run
    assert_bf16_within_bound(model, quantization)
    assert_bf16_within_bound(pair[2])
