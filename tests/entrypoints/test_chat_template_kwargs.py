"""chat_template_kwargs, as vLLM has them: extra variables for the chat template, given to
LLM.chat (here) and to the server's chat completions (test_serve.py, on its running
server). The example is Qwen3's `enable_thinking`: False makes the template write an
empty think block after `<|im_start|>assistant\\n`, so the model answers without
reasoning. The engine tests run a tiny Llama with QWEN3_CHAT_TEMPLATE (the template does
not depend on the weights); the template itself is checked on a tiny Qwen3 checkpoint.
"""
import pytest

from nanopaged import LLM, SamplingParams
from nanopaged.exercises.tiny_model import QWEN3_CHAT_TEMPLATE, make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The capital of France is"}]
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def template_ids(tokenizer, messages, **kwargs) -> list[int]:
    """What transformers' own apply_chat_template gives, generation prompt included."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)["input_ids"])


@pytest.fixture(scope="module")
def qwen3_chat_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-qwen3-template")
    make_tiny_model(folder, "LlamaForCausalLM", chat_template=QWEN3_CHAT_TEMPLATE)
    return LLM(str(folder), num_gpu_blocks=64, block_size=4)


def test_tiny_qwen3_template_honours_enable_thinking_as_qwen3(tmp_path):
    from transformers import AutoTokenizer
    make_tiny_model(tmp_path, "Qwen3ForCausalLM", chat_template=QWEN3_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(tmp_path)

    def render(**kw):
        return tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kw)

    thinking = render()
    assert thinking == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nThe capital of France is"
                        "<|im_end|>\n<|im_start|>assistant\n")          # no think block: the model may think
    assert render(enable_thinking=True) == thinking
    assert render(enable_thinking=False) == thinking.removesuffix("<|im_start|>assistant\n") + EMPTY_THINK


def test_llm_chat_sends_exactly_the_template_ids_with_the_kwargs(qwen3_chat_llm):
    tok = qwen3_chat_llm.get_tokenizer()
    out = qwen3_chat_llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    no_think = template_ids(tok, CHAT, enable_thinking=False)
    assert out.prompt_token_ids == no_think
    assert tok.decode(no_think).endswith(EMPTY_THINK)
    default = qwen3_chat_llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
    assert default.prompt_token_ids == template_ids(tok, CHAT) != no_think
    # a variable the template does not use changes nothing, as in transformers and vLLM
    same = qwen3_chat_llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template_kwargs={"unused_variable": 1})[0]
    assert same.prompt_token_ids == default.prompt_token_ids


def test_one_chat_template_kwargs_for_every_conversation_of_a_batch(qwen3_chat_llm):
    tok = qwen3_chat_llm.get_tokenizer()
    chats = [CHAT, [{"role": "user", "content": "Hello, my name is"}]]
    outs = qwen3_chat_llm.chat(chats, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert [o.prompt_token_ids for o in outs] == [template_ids(tok, c, enable_thinking=False) for c in chats]


@pytest.mark.parametrize("bad, error, words", [
    ([("enable_thinking", False)], TypeError, ["chat_template_kwargs must be a dict", "list"]),
    ('{"enable_thinking": false}', TypeError, ["chat_template_kwargs must be a dict", "str"]),
    ({1: True}, TypeError, ["keys must be str", "1"]),
    ({"enable_thinking": False, "add_generation_prompt": False}, ValueError, ["'add_generation_prompt'"]),
    ({"tokenize": False}, ValueError, ["'tokenize'"]),
    ({"messages": []}, ValueError, ["'messages'"]),
    ({"conversation": []}, ValueError, ["'conversation'"]),
    ({"chat_template": "{{ 1 }}"}, ValueError, ["'chat_template'"]),
    ({"return_tensors": "pt"}, ValueError, ["'return_tensors'"]),
    ({"name": "x\udfff"}, ValueError, ["chat_template_kwargs.name is not valid Unicode"]),
])
def test_bad_chat_template_kwargs_are_refused_and_the_engine_keeps_serving(qwen3_chat_llm, bad, error, words):
    with pytest.raises(error) as e:
        qwen3_chat_llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template_kwargs=bad)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not qwen3_chat_llm.engine.has_unfinished_requests()
    assert len(qwen3_chat_llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_repl_build_prompt_takes_chat_template_kwargs(qwen3_chat_llm):
    from nanopaged.entrypoints.chat import build_prompt
    tok = qwen3_chat_llm.get_tokenizer()
    assert build_prompt(tok, CHAT, 200, {"enable_thinking": False}) == template_ids(tok, CHAT, enable_thinking=False)
    assert build_prompt(tok, CHAT, 200) == template_ids(tok, CHAT)
