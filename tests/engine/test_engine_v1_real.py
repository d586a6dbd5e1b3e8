"""Field cases of the v1 engine (small inputs that broke real inference engines; each
test is named by its case's id) on the real default model, fp32 unless a case says
otherwise:

C13  which tokens the penalties count: repetition_penalty counts prompt and output tokens
     (ids equal transformers' in fp32), presence and frequency penalties only output ones;
C16  a stop string spanning tokens: the text is cut just before it, finish_reason "stop",
     and no streamed delta ever holds part of it;
C17  several eos ids (generation_config.json lists two): generation stops at the first of
     either, which is not in the text; stop_reason is None for either (issue 34: vLLM's
     stop_reason names a stop string or a stop_token_ids id, never an eos);
C19  one BOS with a chat template: the prompt ids equal the tokenizer's
     apply_chat_template(..., add_generation_prompt=True) exactly;
C24s beam scores: score == cumulative_logprob / generated_len ** length_penalty, best first;
C25  beam search with five eos ids equals transformers' generate(num_beams=3), which keeps
     (1 + number of eos ids) * beam_width candidates;
C39  a forward interrupted by KeyboardInterrupt leaves no block in the prefix cache whose
     K/V were never written: the rerun equals a fresh engine's output;
C40  prompt logprobs with a cache hit: both runs equal each other and transformers'
     log_softmax within fp32's rounding (tests/logit_bounds.py), the first prompt
     token's is None;
C41  a request with repetition_penalty gives the same ids alone, first and second in a
     batch, and so does the request beside it.
"""
import json
import shutil

import pytest
import torch

from nanopaged import LLM, BeamSearchParams, SamplingParams
from nanopaged.entrypoints.chat import build_prompt
from nanopaged.sampling_params import RequestOutputKind

from conftest import interrupt_next_forward
from logit_bounds import transformers_logprob_bounds

pytestmark = pytest.mark.slow
SMALL_KV = 64 << 20


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", kv_cache_memory_bytes=SMALL_KV)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def model_copy(src, dst, eos_token_ids):
    """The default model's folder with generation_config.json listing `eos_token_ids`
    (the weights are linked, not copied)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "generation_config.json").read_text())
    cfg["eos_token_id"] = eos_token_ids
    (dst / "generation_config.json").write_text(json.dumps(cfg))
    return dst


def greedy_ids(llm, prompt, n, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, **kw))[0].outputs[0].token_ids


def test_c13_repetition_penalty_counts_prompt_and_output_as_transformers(llm, hf):
    prompt = llm.get_tokenizer()("apple " * 8).input_ids
    ours = greedy_ids(llm, prompt, 8, repetition_penalty=1.5, ignore_eos=True)
    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                          repetition_penalty=1.5, eos_token_id=None)
    assert ours == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_c13_presence_and_frequency_count_output_tokens_only(llm, hf, field):
    prompt = llm.get_tokenizer()("apple " * 8).input_ids
    ours = greedy_ids(llm, prompt, 8, ignore_eos=True, **{field: 1.0})
    ids, out = list(prompt), []
    with torch.no_grad():                       # OpenAI's definition, on the output only
        for _ in range(8):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            logits -= counts if field == "frequency_penalty" else (counts > 0).float()
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    assert ours == out


def test_c16_stop_string_spanning_tokens(llm):
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe Paris in two sentences."}],
                                     tokenize=False, add_generation_prompt=True)
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    stop = tok.decode(base.token_ids[6:9])              # a 3-token substring of the output
    assert len(stop) > 2 and stop in base.text
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    c = llm.generate(prompt, params)[0].outputs[0]
    assert c.text == base.text[:base.text.find(stop)] and c.finish_reason == "stop" and c.stop_reason == stop
    eng = llm.engine
    eng.add_request("stream", prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                     output_kind=RequestOutputKind.DELTA))
    deltas = []
    while eng.has_unfinished_requests():
        deltas += [o.outputs[0].text for o in eng.step() if o.outputs]
    assert "".join(deltas) == c.text
    assert not any(stop[i:j] in d for d in deltas for i in range(len(stop)) for j in range(i + 2, len(stop) + 1)
                   if stop[i:j] not in c.text)
    assert eng.get_stats()["num_free_gpu_blocks"] == eng.get_stats()["num_total_gpu_blocks"]


def test_c17_several_eos_ids_stop_at_the_first(default_model_dir, tmp_path):
    chat = [{"role": "user", "content": "Say hi."}]
    plain = LLM(str(default_model_dir), dtype="float32", kv_cache_memory_bytes=SMALL_KV)
    base = plain.chat(chat, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0].outputs[0].token_ids
    tok = plain.get_tokenizer()
    second = base[2]                                       # a token the answer reaches early
    assert second not in base[:2] and tok.eos_token_id not in base[:3]
    llm = LLM(str(model_copy(default_model_dir, tmp_path / "two-eos", [tok.eos_token_id, second])),
              dtype="float32", kv_cache_memory_bytes=SMALL_KV)
    c = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert c.token_ids == base[:3] and c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == tok.decode(base[:2], skip_special_tokens=True)
    # the chat end of turn (the tokenizer's eos) ends an answer too, not in its text
    d = plain.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert d.token_ids[-1] == tok.eos_token_id and d.stop_reason is None
    assert "<|im_end|>" not in d.text and d.finish_reason == "stop"


def test_c19_one_bos_with_a_chat_template(llm):
    tok = llm.get_tokenizer()
    chat = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello!"}]
    expected = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_token_ids == expected
    assert build_prompt(tok, chat, 1000) == expected
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    assert not any(a == b == bos for a, b in zip(expected, expected[1:]))    # never two BOS in a row


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
def test_c24s_beam_score(llm, length_penalty):
    """Field case C24 (its score half, C24s): score == cum_logprob / len ** penalty, ordered."""
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Name a fruit."}],
                                                     tokenize=False, add_generation_prompt=True)
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty))
    n = len(llm.get_tokenizer()(prompt).input_ids)
    assert len(out.sequences) == 3
    for s in out.sequences:
        assert s.score == pytest.approx(s.cum_logprob / (len(s.tokens) - n) ** length_penalty)
    assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)


def test_c25_beam_search_with_several_eos_ids(default_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    plain_tok = AutoTokenizer.from_pretrained(default_model_dir)
    eos = [plain_tok.eos_token_id] + [plain_tok.encode(s, add_special_tokens=False)[0] for s in [".", ",", "\n", "!"]]
    folder = model_copy(default_model_dir, tmp_path / "five-eos", eos)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=SMALL_KV)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = plain_tok.apply_chat_template([{"role": "user", "content": "Write a short greeting."}],
                                           tokenize=False, add_generation_prompt=True)
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    x = torch.tensor([plain_tok(prompt).input_ids])
    with torch.no_grad():
        g = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=3, num_return_sequences=3, do_sample=False,
                        early_stopping=True, max_new_tokens=6, length_penalty=1.0)
    assert len(out.sequences) == 3
    pad = hf.generation_config.pad_token_id
    for ours, theirs in zip(out.sequences, g.tolist()):
        assert ours.tokens == theirs[:len(ours.tokens)] and all(t == pad for t in theirs[len(ours.tokens):])


def test_c39_an_interrupted_forward_poisons_no_cache_block(default_model_dir, llm):
    prompt = list(range(2000, 2017))                                 # 17 tokens: one full block of 16
    params = SamplingParams(temperature=0, max_tokens=8)
    fresh = LLM(str(default_model_dir), dtype="float32", kv_cache_memory_bytes=SMALL_KV, block_size=16)
    expected = fresh.generate(prompt, params)[0].outputs[0].token_ids
    interrupted = LLM(str(default_model_dir), dtype="float32", kv_cache_memory_bytes=SMALL_KV, block_size=16)
    interrupt_next_forward(interrupted.engine.model_runner.model.layers[15])
    with pytest.raises(KeyboardInterrupt):
        interrupted.generate(prompt, params)
    assert not interrupted.engine.block_manager.cached_blocks
    assert interrupted.generate(prompt, params)[0].outputs[0].token_ids == expected


def test_c40_prompt_logprobs_with_a_cache_hit(llm, hf):
    prompt = list(range(5000, 5040))
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, logprobs=2)
    first, again = (llm.generate(prompt, params)[0] for _ in range(2))
    ids = prompt + first.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    # both fp32, other orders: logit_bounds' bound, K = 1536 (the MLP's width; hidden 576),
    # V = 49152: 0.06 to 0.08 here, the worst case; measured at most 1.8e-5
    bound = transformers_logprob_bounds(hf, ids).tolist()
    for out in (first, again):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 40
        for pos in range(1, 40):
            got = out.prompt_logprobs[pos][prompt[pos]].logprob
            assert abs(got - ref[pos - 1, prompt[pos]].item()) <= bound[pos - 1]
        for j, (t, d) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert abs(d[t].logprob - ref[39 + j, t].item()) <= bound[39 + j]
    assert first.prompt_logprobs == again.prompt_logprobs
    assert first.outputs[0].logprobs == again.outputs[0].logprobs


def test_c41_penalties_independent_of_batch_order(llm):
    tok = llm.get_tokenizer()
    a = tok("The cat sat on the mat. The cat sat on the").input_ids
    b = tok("List three colours:").input_ids
    pen = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=2.0, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone_a, alone_b = greedy_ids(llm, a, 12, repetition_penalty=2.0, ignore_eos=True), greedy_ids(llm, b, 12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate([a, b], [pen, plain])]
    second = [o.outputs[0].token_ids for o in llm.generate([b, a], [plain, pen])]
    assert first == [alone_a, alone_b] and second == [alone_b, alone_a]
