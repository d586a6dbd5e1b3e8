"""Admission (issue 34): the Processor bounds what one request may cost before the core
does any work for it, and follows vLLM's length rule; `stop_reason` is vLLM's.

- n and beam_width at most max_num_seqs; logprobs and prompt_logprobs at most
  max_logprobs (an EngineConfig field, vLLM's, default 20); a request's rows of fp32
  logits per step (n or beam_width, x vocab_size x 4 B) at most max_logits_bytes. Each
  refusal is a ValueError naming the field, its value and the limit, the engine unchanged
  (field case C82 through the server: tests/entrypoints/test_serve.py).
- prompt_len + max_tokens > max_model_len is vLLM's ValueError ("This model's maximum
  context length is ..."); max_tokens=None means up to the context (field case C75).
- stop_reason is None when an eos ends a sequence, the id when a stop_token_ids id does.
The chat REPL trims its history to leave room for --max-tokens, and refuses a
--max-tokens that leaves none. On the tiny random model (vocab 320, max_model_len 256).
"""
import subprocess
import sys

import pytest

from nanopaged import LLM, SamplingParams, StructuredOutputsParams
from nanopaged.beam_search.scheduler import BeamSearchParams

from conftest import TINY_VOCAB

ROW = TINY_VOCAB * 4                  # bytes of one row of fp32 logits
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64, dtype="float32")


def assert_untouched(llm):
    stats = llm.engine.get_stats()
    assert stats["num_waiting"] == stats["num_running"] == 0 and stats["num_free_gpu_blocks"] == 64


def test_n_past_max_num_seqs_is_refused_naming_field_value_and_limit(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"SamplingParams.n=5 is more than max_num_seqs=4"):
        llm.generate("Hello", SamplingParams(n=5, max_tokens=1))
    with pytest.raises(ValueError, match=r"SamplingParams.n=1000000 is more than max_num_seqs=4"):
        llm.generate("Hello", SamplingParams(n=1_000_000, max_tokens=1))
    assert_untouched(llm)
    out = llm.generate("Hello", SamplingParams(n=4, max_tokens=3, **GREEDY))[0]   # the engine serves on
    assert [len(c.token_ids) for c in out.outputs] == [3, 3, 3, 3]


def test_beam_width_past_max_num_seqs_is_refused(llm):
    with pytest.raises(ValueError, match=r"BeamSearchParams.beam_width=5 is more than max_num_seqs=4"):
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=5, max_tokens=2))
    assert_untouched(llm)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_past_max_logprobs_is_refused(llm, field):
    with pytest.raises(ValueError, match=fr"SamplingParams.{field}=21 is more than max_logprobs=20"):
        llm.generate("Hello", SamplingParams(max_tokens=2, **{field: 21}))
    assert_untouched(llm)
    llm.generate("Hello", SamplingParams(max_tokens=2, **{field: 20}))


def test_max_logprobs_is_an_engine_setting(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_logprobs=30)
    c = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=30, **GREEDY))[0].outputs[0]
    assert all(len(d) >= 30 for d in c.logprobs)
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs=31 is more than max_logprobs=30"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=31))
    with pytest.raises(ValueError, match=r"max_logprobs must be an integer >= 0, got -1"):
        LLM(str(tiny_model_dir), max_logprobs=-1)


def test_the_flags_include_max_logprobs_and_max_logits_bytes():
    from nanopaged.entrypoints.openai.api_server import parse_args
    args = parse_args(["--max-logprobs", "5", "--max-logits-bytes", "1000000"])
    assert (args.max_logprobs, args.max_logits_bytes) == (5, 1_000_000)


def test_a_request_whose_logits_pass_max_logits_bytes_is_refused(tiny_model_dir):
    """n=4 fits max_num_seqs=4, but 4 rows of logits do not fit 3 rows' bytes."""
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_logits_bytes=3 * ROW)
    with pytest.raises(ValueError, match=fr"SamplingParams.n=4 needs 4 rows of fp32 logits a step \(4 x vocab_size "
                                         fr"{TINY_VOCAB} x 4 B = {4 * ROW} B\), more than max_logits_bytes={3 * ROW}"):
        llm.generate("Hello", SamplingParams(n=4, max_tokens=1))
    with pytest.raises(ValueError, match=fr"BeamSearchParams.beam_width=4 needs 4 rows .* max_logits_bytes={3 * ROW}"):
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=4, max_tokens=2))
    assert_untouched(llm)
    assert len(llm.generate("Hello", SamplingParams(n=3, max_tokens=2))[0].outputs) == 3


def test_max_logits_bytes_defaults_to_max_num_seqs_rows_and_needs_one_row(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_num_seqs=6)
    assert llm.engine.config.scheduler_config.max_logits_bytes == 6 * ROW
    with pytest.raises(ValueError, match=fr"max_logits_bytes={ROW - 1} is less than one row of fp32 logits "
                                         fr"\(vocab_size {TINY_VOCAB} x 4 B = {ROW} B\)"):
        LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_logits_bytes=ROW - 1)


# -- vLLM's length rule (field case C75) -----------------------------------------------------

def vllm_message(prompt_len, max_tokens, max_model_len=64):
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            f"Please reduce the length of the messages or completion.")


def test_c75_max_tokens_past_the_context_is_vllms_error(llm):
    prompt = list(range(1, 16))                             # 15 tokens, max_model_len 64
    for max_tokens in (1000, 50):
        with pytest.raises(ValueError) as e:
            llm.generate(prompt, SamplingParams(max_tokens=max_tokens))
        assert str(e.value) == vllm_message(15, max_tokens)
    with pytest.raises(ValueError) as e:
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=50))
    assert str(e.value) == vllm_message(15, 50)
    chat = [{"role": "user", "content": "Hello"}]
    chat_len = len(llm.engine.processor.process_inputs("probe", chat, None)[0].prompt_token_ids)
    with pytest.raises(ValueError) as e:
        llm.chat(chat, SamplingParams(max_tokens=1000), use_tqdm=False)
    assert str(e.value) == vllm_message(chat_len, 1000)
    assert_untouched(llm)
    exact = llm.generate(prompt, SamplingParams(max_tokens=49, **GREEDY))[0].outputs[0]
    assert len(exact.token_ids) == 49 and exact.finish_reason == "length"
    up_to = llm.generate(prompt, SamplingParams(max_tokens=None, **GREEDY))[0].outputs[0]
    assert up_to.token_ids == exact.token_ids                   # None: up to the context


# -- stop_reason ---------------------------------------------------------------------------

def test_stop_reason_is_none_on_eos_and_the_id_for_a_stop_token_id(llm):
    """A logit bias of 100 makes the first token the one we want to stop on."""
    (eos,) = llm.engine.eos_token_ids
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100}))[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([eos], "stop", None)
    stop = 7
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logit_bias={stop: 100},
                                             stop_token_ids=[stop]))[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([stop], "stop", stop)
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100},
                                             stop_token_ids=[eos], ignore_eos=True))[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([eos], "stop", eos)   # asked for as a stop id


# -- the chat REPL -------------------------------------------------------------------------

def test_the_repl_leaves_room_for_max_tokens(llm):
    from nanopaged.entrypoints.chat import prompt_budget
    assert prompt_budget(llm.engine, 16) == 64 - 16       # trims its history to this
    with pytest.raises(ValueError, match="--max-tokens 64 leaves no room for a prompt: this model's maximum "
                                         "context length is 64 tokens"):
        prompt_budget(llm.engine, 64)


def test_the_repl_refuses_max_tokens_past_the_context(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "nanopaged.chat", "--model", str(tiny_model_dir),
                        "--max-tokens", "300"], input="Hello\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "--max-tokens 300 leaves no room" in r.stderr, r.stderr


FEATURE_MODULES = {"beam search": ["nanopaged.beam_search"], "structured outputs": ["nanopaged.structured_output"]}


@pytest.mark.parametrize("feature", sorted(FEATURE_MODULES))
def test_a_request_for_a_feature_whose_module_cannot_be_imported_is_refused_by_name(tiny_model_dir, monkeypatch,
                                                                                      feature):
    """features.py: the base engine runs without a per-request feature's package; a
    request that asks for it is a ValueError naming the feature, and the engine serves on."""
    for package in FEATURE_MODULES[feature]:                    # `import` of it now fails
        for module in [m for m in sys.modules if m == package or m.startswith(package + ".")] + [package]:
            monkeypatch.setitem(sys.modules, module, None)
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4)
    with pytest.raises(ValueError, match=f"needs the {feature} feature"):
        if feature == "beam search":
            llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=2))
        else:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[0-9]+")),
                         use_tqdm=False)
    assert_untouched(llm)
    out = llm.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
