"""Every model family through the whole engine, float32, on tiny random checkpoints
(tests/conftest.py: tiny_family): greedy ids equal transformers' alone and batched at
block sizes 16, 4 and 1; beam search equals transformers'; and prefix caching, chunked
prefill, swap and recompute preemption, the C++ kernels, structured outputs, LLM.chat
and the tracer run on each. The families differ only in model/; nothing else should
care, and these tests are where that is checked.
"""
import pytest
import torch

from nanopaged import LLM, SamplingParams, StructuredOutputsParams
from nanopaged.beam_search.scheduler import BeamSearchParams
from nanopaged.exercises.tiny_model import TINY_FAMILIES

from logit_bounds import beam_score_bound

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32], list(range(100, 121)), [250, 3, 250, 3, 77]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tied(arch: str) -> bool:
    """Qwen2.5-0.5B and SmolLM2 tie the head to the embedding; Qwen3-1.7B and Mistral-7B do not."""
    return arch in ("LlamaForCausalLM", "Qwen2ForCausalLM")


def hf_greedy(hf, prompt: list[int], max_tokens: int = 12) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_greedy_equals_transformers_alone_and_batched(tiny_family, arch):
    folder, hf = tiny_family(arch, _tied(arch))
    want = [hf_greedy(hf, p) for p in PROMPTS]
    for block_size in (16, 4, 1):
        llm = LLM(str(folder), dtype="float32", block_size=block_size, num_gpu_blocks=512 // block_size,
                  attention_backend="torch")
        assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want, block_size
        assert [ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS] == want, block_size


@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_beam_search_equals_transformers(tiny_family, arch):
    folder, hf = tiny_family(arch, _tied(arch))
    llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks=128)
    prompts = PROMPTS[:2]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10))
    for prompt, out in zip(prompts, outs):
        x = torch.tensor([prompt])
        with torch.no_grad():
            g = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=3, num_return_sequences=3,
                            do_sample=False, length_penalty=1.0, early_stopping=True, max_new_tokens=10,
                            eos_token_id=0, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        for ours, theirs, score in zip(out.sequences, g.sequences, g.sequences_scores):
            assert ours.tokens == theirs.tolist()[:len(ours.tokens)]
            assert all(t == 0 for t in theirs.tolist()[len(ours.tokens):])     # padding after EOS
            # both fp32, other orders: each step's logprob within logit_bounds' bound (K = 128),
            # the mean within their mean (beam_score_bound); measured at most 1.8e-6, 0.003 of it
            err = abs(ours.cum_logprob / (len(ours.tokens) - len(prompt)) - score.item())
            bound = beam_score_bound(hf, ours.tokens, len(prompt), ours.cum_logprob)
            assert err <= bound, (err, bound)
    stats = llm.engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"]


@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_the_engine_machinery_does_not_care_which_family(tiny_family, arch):
    """A shared prefix (prefix caching), long prompts in 8-token chunks (chunked prefill),
    a pool too small for the batch (swap, then recompute preemption), the C++ kernels:
    the same ids as transformers. Then a choice through structured outputs."""
    folder, hf = tiny_family(arch, _tied(arch))
    prefix = list(range(40, 64))
    prompts = [prefix + [7, 8], prefix + [9], prefix + [11, 12, 13]]
    want = [hf_greedy(hf, p, 16) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for mode, cpu_blocks in (("swap", 32), ("recompute", 0)):
        llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks=14, num_cpu_blocks=cpu_blocks,
                  preemption_mode=mode, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4,
                  attention_backend="cpu")
        assert ids(llm.generate(prompts[0], params, use_tqdm=False)) == want[:1]
        assert ids(llm.generate(prompts, params, use_tqdm=False)) == want, mode
        stats = llm.engine.get_stats()
        assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["Paris", "Hello"]))
    (out,) = llm.generate("The capital of France is", choice, use_tqdm=False)
    assert out.outputs[0].text in ("Paris", "Hello")


@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_chat_and_the_tracer_run_on_each_family(tiny_family, arch, capsys):
    from nanopaged.trace import main
    folder, _ = tiny_family(arch, _tied(arch))
    llm = LLM(str(folder), block_size=4, num_gpu_blocks=64)
    (out,) = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4, ignore_eos=True),
                      use_tqdm=False)
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                                           add_generation_prompt=True, return_dict=False)
    assert len(out.outputs[0].token_ids) == 4
    assert main(["--model", str(folder), "--prompt", "Hello", "Paris", "--max-tokens", "3"]) == 0
    assert "3 steps, all requests finished" in capsys.readouterr().out


@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_bf16_rows_do_not_depend_on_their_batch(tiny_family, arch):
    """bfloat16 with the C++ kernels (AMX where the CPU has it, else emulated): a prompt's
    ids and logprobs are the same floats alone, in a batch, and chunked. Qwen2's bias add
    and Qwen3's per-head norms are row-wise, so batch invariance holds for them too."""
    folder, _ = tiny_family(arch, _tied(arch))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)

    def target(llm, prompts):
        out = llm.generate(prompts, params, use_tqdm=False)[prompts.index(PROMPTS[2])].outputs[0]
        return out.token_ids, out.logprobs
    llm = LLM(str(folder), dtype="bfloat16", block_size=4, num_gpu_blocks=128, attention_backend="cpu",
              enable_prefix_caching=False)
    alone = target(llm, [PROMPTS[2]])
    assert target(llm, PROMPTS) == alone
    chunked = LLM(str(folder), dtype="bfloat16", block_size=4, num_gpu_blocks=128, attention_backend="cpu",
                  enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)
    assert target(chunked, PROMPTS) == alone


def test_qwen3_enable_thinking_reaches_its_template(tmp_path):
    """A tiny Qwen3 with a Qwen3-style chat template (tiny_model.QWEN3_CHAT_TEMPLATE):
    chat_template_kwargs={"enable_thinking": False} puts the empty think block in the
    prompt the engine runs, as vLLM passes it."""
    from nanopaged.exercises.tiny_model import QWEN3_CHAT_TEMPLATE, make_tiny_model
    make_tiny_model(tmp_path, "Qwen3ForCausalLM", chat_template=QWEN3_CHAT_TEMPLATE)
    llm = LLM(str(tmp_path), block_size=4, num_gpu_blocks=64)
    tok, messages = llm.get_tokenizer(), [{"role": "user", "content": "Hello"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (thinking,) = llm.chat(messages, params, use_tqdm=False)
    (direct,) = llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(direct.prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(thinking.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert direct.prompt_token_ids == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                              enable_thinking=False, return_dict=False)


@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_speculative_decoding_keeps_each_familys_ids(tiny_family, arch, tmp_path):
    """n-gram drafts and a draft made of the family's own first layer
    (make_layer_draft): greedy ids as without speculation, float32."""
    from nanopaged.spec_decode.draft_model import make_layer_draft
    folder, _ = tiny_family(arch, _tied(arch))
    engine = dict(dtype="float32", block_size=4, num_gpu_blocks=128)
    want = ids(LLM(str(folder), **engine).generate(PROMPTS, GREEDY, use_tqdm=False))
    draft = make_layer_draft(folder, tmp_path / "draft", 1)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
                 {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}):
        llm = LLM(str(folder), speculative_config=spec, **engine)
        assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want, spec["method"]
        assert llm.engine.get_stats()["spec_decode_num_draft_tokens"] > 0
