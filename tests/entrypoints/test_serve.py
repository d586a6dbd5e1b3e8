"""python -m nanopaged.serve, tested as a user meets it: a real server process on a free
port, the official `openai` client and raw httpx against it.

One server per model and module: the tiny random Llama (fast tests; its tokenizer has a
chat template, conftest.py) with an API key, and the default SmolLM2 model (slow tests:
greedy outputs and the chat template equal LLM.generate / LLM.chat's). Teardown checks
that the server and its EngineCore child are gone. How a server ends (a dead core,
SIGTERM with streams in flight, Ctrl-C twice): test_serve_lifecycle.py, each on a
server of its own. The timeouts cover a test's setup too, so they leave room
for a server start (~15 s on a quiet 2-core machine, 30 s on a busy one).
"""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

# every test may hang on a server that stopped answering: 120 s each unless marked longer
pytestmark = pytest.mark.timeout(120)

from serve_harness import KEY, PROMPTS, ROOT, TINY_ARGS, TINY_ENGINE, Server, _free_port  # noqa: F401


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    server = Server(tiny_model_dir, "--api-key", KEY, "--health-timeout", "2", *TINY_ARGS)
    try:
        assert len(server.children()) >= 1          # the EngineCore process
        yield server
    finally:
        alive = server.stop()
    assert server.proc.returncode == 0 and not alive, f"exit status {server.proc.returncode}, left behind: {alive}"
    assert server.left_in_tmp == [], f"SIGTERM left {server.left_in_tmp} in the server's TMPDIR"


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from nanopaged import LLM
    return LLM(str(tiny_model_dir), **TINY_ENGINE)


@pytest.fixture(scope="module")
def client(tiny_server):
    from openai import OpenAI
    return OpenAI(base_url=tiny_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as c:
        yield c


def _metrics(http) -> dict[str, float]:
    """name -> value of every unlabelled-bucket nanopaged: sample of GET /metrics."""
    text = http.get("/metrics").text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("nanopaged:") and "_bucket" not in line}


def _greedy(llm, prompt, max_tokens, **kw):
    from nanopaged import SamplingParams
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw))[0].outputs[0]


# ---- the command line ------------------------------------------------------------

def test_every_engine_config_field_is_a_typed_flag():
    from nanopaged.entrypoints.openai.api_server import parse_args
    args = parse_args(["--block-size", "4", "--no-enable-prefix-caching", "--swap-space", "0.5",
                       "--max-model-len", "64", "--dtype", "float32"])
    assert (args.block_size, args.enable_prefix_caching, args.swap_space, args.max_model_len, args.dtype) == \
        (4, False, 0.5, 64, "float32")
    assert not hasattr(parse_args([]), "block_size")       # not given: EngineConfig's default
    for argv, value in ((["--enable-chunked-prefill"], True), (["--enable-chunked-prefill", "false"], False),
                        (["--no-enable-chunked-prefill"], False), (["--enable-chunked-prefill", "on"], True)):
        assert parse_args(argv).enable_chunked_prefill is value
    assert parse_args([]).host == "127.0.0.1"


def test_bad_engine_flag_exits_1_naming_the_field(tiny_model_dir, capsys):
    from nanopaged.entrypoints.openai.api_server import main
    assert main(["--model", str(tiny_model_dir), "--block-size", "0"]) == 1
    assert "block_size" in capsys.readouterr().err


@pytest.mark.parametrize("which, words", [
    ("a file", "quantization='gguf'"),                  # not a folder, and not a .gguf
    ("a broken .gguf", "not a readable GGUF file: the file is 4 bytes"),    # run as GGUF: its own error
    ("missing", "does not exist")])
def test_a_bad_model_path_exits_1_naming_it(tiny_model_dir, tmp_path, capsys, which, words):
    """A file that is no model, a .gguf that is not GGUF, or a missing path: the error
    naming it, no traceback."""
    from nanopaged.entrypoints.openai.api_server import main
    path = tmp_path / ("model.gguf" if which != "a file" else "model.bin")
    if which != "missing":
        path.write_bytes(b"GGUF")
    assert main(["--model", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err and words in err, err


def test_speculative_decoding_through_the_server(tiny_model_dir):
    """--speculative-config takes vLLM's JSON; greedy completions (plain and streamed) are
    the engine's without speculation, and /metrics counts drafts and accepted tokens
    (the target as its own draft: every draft accepted). A bad config exits 1 naming
    the field."""
    from nanopaged import LLM
    from nanopaged.entrypoints.openai.api_server import main
    assert main(["--model", str(tiny_model_dir), "--speculative-config", '{"method": "ngram", "k": 2}']) == 1
    engine = dict(block_size=4, num_gpu_blocks=256, dtype="float32")
    want = [_greedy(LLM(str(tiny_model_dir), **engine), p, 16, ignore_eos=True).text for p in PROMPTS]
    spec = json.dumps({"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3})
    server = Server(tiny_model_dir, "--block-size", "4", "--num-gpu-blocks", "256", "--dtype", "float32",
                    "--speculative-config", spec)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
            got = [http.post("/v1/completions", json=dict(body, prompt=p)).json()["choices"][0]["text"]
                   for p in PROMPTS]


            async def stream_all():
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                    return [await _stream_text(c, dict(body, prompt=p)) for p in PROMPTS]
            streamed = asyncio.run(stream_all())
            m = _metrics(http)
    finally:
        alive = server.stop()
    assert got == streamed == want
    assert m["nanopaged:spec_decode_num_draft_tokens_total"] > 0 and m["nanopaged:spec_decode_acceptance_rate"] == 1
    assert m["nanopaged:spec_decode_num_accepted_tokens_total"] == m["nanopaged:spec_decode_num_draft_tokens_total"]
    assert server.proc.returncode == 0 and not alive


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_each_model_family_serves(tiny_family, arch):
    """A server on each family's tiny checkpoint (the Llama one is tiny_server): greedy
    completions and a chat completion equal LLM's, streamed text equals the whole, and
    the server leaves nothing behind."""
    from nanopaged import LLM, SamplingParams
    folder, _ = tiny_family(arch, False)
    llm = LLM(str(folder), **TINY_ENGINE)
    want = [_greedy(llm, p, 12, ignore_eos=True).text for p in PROMPTS]
    messages = [{"role": "user", "content": "Hello"}]
    (chat,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    server = Server(folder, *TINY_ARGS)

    async def stream():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await _stream_text(c, dict(body, prompt=PROMPTS[0]))
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            got = [http.post("/v1/completions", json=dict(body, prompt=p)).json()["choices"][0]["text"] for p in PROMPTS]
            answer = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                                             "ignore_eos": True}).json()
            streamed = asyncio.run(stream())
    finally:
        alive = server.stop()
    assert got == want and streamed == want[0]
    assert answer["choices"][0]["message"]["content"] == chat.outputs[0].text
    assert server.proc.returncode == 0 and not alive


# ---- the openai client ------------------------------------------------------------

def test_models_lists_the_served_name(client, tiny_model_dir):
    assert [m.id for m in client.models.list().data] == [str(tiny_model_dir)]


def test_completion_greedy_equals_llm_generate(client, tiny_llm, tiny_model_dir):
    for prompt in PROMPTS:
        want = _greedy(tiny_llm, prompt, 12)
        got = client.completions.create(model=str(tiny_model_dir), prompt=prompt, max_tokens=12, temperature=0)
        assert got.object == "text_completion" and got.id.startswith("cmpl-")
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        stream = client.completions.create(model=str(tiny_model_dir), prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_completion_token_prompt_stop_and_logprobs(client, tiny_llm, tiny_model_dir):
    ids = tiny_llm.get_tokenizer()(PROMPTS[0]).input_ids
    want = _greedy(tiny_llm, ids, 8, logprobs=2)
    got = client.completions.create(model=str(tiny_model_dir), prompt=ids, max_tokens=8, temperature=0, logprobs=2)
    c = got.choices[0]
    assert c.text == want.text and got.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    for t, top, got_lp, got_top in zip(want.token_ids, want.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert got_lp == pytest.approx(top[t].logprob, abs=1e-5)
        # the top 2 and the sampled token, keyed by text (tokens that decode alike share a key)
        assert set(got_top) == {lp_.decoded_token for lp_ in top.values()}
    stop = want.text[3:5]                      # a stop string inside the greedy text
    got = client.completions.create(model=str(tiny_model_dir), prompt=PROMPTS[0], max_tokens=8,
                                    temperature=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop" and want.text.startswith(got.choices[0].text)
    assert stop not in got.choices[0].text


def test_chat_stream_and_not_n2_logprobs(client, tiny_llm, tiny_model_dir):
    from nanopaged import SamplingParams
    messages = [{"role": "user", "content": "Hello, my name is"}]
    want = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0]
    got = client.chat.completions.create(model=str(tiny_model_dir), messages=messages, max_tokens=10,
                                         temperature=0, logprobs=True, top_logprobs=2)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.outputs[0].token_ids) and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)     # greedy: rank 1
    chunks = list(client.chat.completions.create(model=str(tiny_model_dir), messages=messages, max_tokens=10,
                                                 temperature=0, stream=True, max_completion_tokens=10))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason
    two = client.chat.completions.create(model=str(tiny_model_dir), messages=messages, max_tokens=6,
                                         n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in two.choices) and two.usage.completion_tokens <= 12
    assert two.choices[0].message.content != two.choices[1].message.content     # own random streams
    again = client.chat.completions.create(model=str(tiny_model_dir), messages=messages, max_tokens=6,
                                           n=2, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]


# ---- errors, raw httpx ----------------------------------------------------------

def _post(http, path, body, **kw):
    if isinstance(body, (dict, list)):
        return http.post(path, json=body, **kw)
    return http.post(path, content=body, headers={"content-type": "application/json"}, **kw)


def test_chat_template_kwargs_through_extra_body(client, http, tiny_llm, tiny_model_dir):
    """vLLM's chat_template_kwargs: the openai client sends them in extra_body, and the
    prompt is the template's with them (the tiny template honours Qwen3's enable_thinking:
    False adds an empty think block). Bad ones are a 400 naming the field and the key;
    the server keeps serving."""
    from nanopaged import SamplingParams
    messages = [{"role": "user", "content": "Hello, my name is"}]
    no_think = {"enable_thinking": False}
    want = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=6), chat_template_kwargs=no_think)[0]
    ids = tiny_llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    default_ids = tiny_llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert want.prompt_token_ids == ids["input_ids"] != default_ids["input_ids"]
    got = client.chat.completions.create(model=str(tiny_model_dir), messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"chat_template_kwargs": no_think})
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.choices[0].message.content == want.outputs[0].text
    plain = client.chat.completions.create(model=str(tiny_model_dir), messages=messages, max_tokens=1)
    assert plain.usage.prompt_tokens == len(default_ids["input_ids"])
    for bad, words in (([1, 2], ["chat_template_kwargs", "dict"]),
                       ("enable_thinking", ["chat_template_kwargs", "dict"]),
                       ({"tokenize": False}, ["chat_template_kwargs may not set 'tokenize'"]),
                       ({"add_generation_prompt": False}, ["'add_generation_prompt'"])):
        r = http.post("/v1/chat/completions", json={"messages": messages, "chat_template_kwargs": bad})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template_kwargs" and all(w in err["message"] for w in words), err
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                "chat_template_kwargs": no_think})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", b"\x00\xff\x13garbage\xfe", 400, ["body"]),
    ("/v1/completions", b'{"prompt": "hi", ', 400, ["JSON"]),
    ("/v1/completions", {"max_tokens": 3}, 400, ["prompt", "required"]),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, ["messages"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, ["max_tokens"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, ["max_tokens", "-1"]),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, ["temperature", "-0.5"]),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, ["logit_bias"]),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, ["99999"]),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, ["batch"]),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, ["echo"]),
    ("/v1/completions", {"prompt": "Hello " * 300}, 400, ["600", "max_model_len=256"]),
    ("/v1/completions", {"prompt": [7] * 256, "max_tokens": 5}, 400,     # no room for an output token
     ["256 tokens", "max_model_len=256", "at most 255"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     ["logprobs"]),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, ["gpt-4"]),
    # vLLM's fields the engine cannot honour (field case C91, once a 200 that ignored them):
    # a 400 naming the field and its value
    ("/v1/completions", {"prompt": "hi", "best_of": 10**9}, 400, ["best_of=1000000000", "not supported"]),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "use_beam_search": True}, 400, ["best_of=2"]),
    ("/v1/completions", {"prompt": "hi", "best_of": 1, "n": 2}, 400, ["best_of=1 must be at least n=2"]),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "n": 2}, 400, ["best_of=2 is not supported"]),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, 400, ["use_beam_search=true", "LLM.beam_search"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, 400,
     ["use_beam_search=true"]),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1000}, 400, ["prompt_logprobs", "1000"]),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400,
     ["SamplingParams.prompt_logprobs=21 is more than max_logprobs=20"]),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -2}, 400, ["prompt_logprobs", "-2"]),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
     ["prompt_logprobs=1", "stream=true"]),
    # structured outputs: a spec that does not compile is refused before any generation
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, 400,
     ["json does not compile", "objectx"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, ["json_schema.schema"]),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(abc"}, 400, ["regex does not compile", "unclosed"]),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "start: ("}}, 400, ["grammar"]),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a"], "response_format": {"type": "json_object"}},
     400, ["more than once", "guided_choice", "response_format"]),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, 400, ["response_format"]),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regexx": "a"}}, 400, ["regexx"]),
    # a lone surrogate (JSON's "\udfff" escape) is the same 400 in every field that takes text
    ("/v1/completions", rb'{"prompt": "a\udfffb"}', 400, ["prompt is not valid Unicode", "index 1"]),
    ("/v1/completions", rb'{"prompt": "hi", "stop": ["ok", "\udfff"]}', 400, ["stop[1] is not valid Unicode"]),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "x\udfff"}]}', 400,
     ["messages[0].content is not valid Unicode"]),
    ("/v1/completions", rb'{"prompt": "hi", "guided_choice": ["a", "\ud800"]}', 400,
     ["choice[1] is not valid Unicode"]),
    ("/v1/completions", rb'{"prompt": "hi", "bad_words": ["\udfff"]}', 400, ["bad_words[0] is not valid"]),
])
def test_bad_request_is_an_openai_error(http, path, body, status, words):
    r = _post(http, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert all(w in err["message"] for w in words), err["message"]


def test_over_size_body_is_413_declared_or_chunked(http):
    big = json.dumps({"prompt": "a" * (1 << 20)}).encode()
    r = _post(http, "/v1/completions", big)
    assert r.status_code == 413 and "1048576" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                  headers={"content-type": "application/json"})         # no Content-Length
    assert r.status_code == 413


def test_api_key_needed_on_v1_only(tiny_server):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert KEY not in r.text
    assert httpx.get(tiny_server.url + "/v1/models").status_code == 401
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    assert httpx.get(tiny_server.url + "/metrics").status_code == 200


def test_unknown_fields_are_ignored(http):
    r = _post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of_everything": 3, "user": "u"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_prompt_logprobs_are_vllms_per_prompt_token(http, tiny_llm):
    """vLLM's prompt_logprobs, in a completion's choices and atop a chat response: per
    prompt token None for the first (nothing predicts it), then token id -> {logprob, rank,
    decoded_token} for the prompt token and the top k, the engine's own numbers. Left out
    unless asked for; best_of=1 with n=1 (all vLLM's V1 engine takes) is accepted."""
    from nanopaged import SamplingParams
    ids = [5, 6, 7, 8, 9, 10]
    (want,) = tiny_llm.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0, "n": 2,
                                           "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = [c["prompt_logprobs"] for c in r.json()["choices"]]
    assert got[0] == got[1] and len(got[0]) == len(ids) and got[0][0] is None
    for token, g, w in zip(ids[1:], got[0][1:], want.prompt_logprobs[1:]):
        assert str(token) in g and set(g) == {str(t) for t in w} and len(g) <= 3
        for t, lp in w.items():
            assert g[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert (g[str(t)]["rank"], g[str(t)]["decoded_token"]) == (lp.rank, lp.decoded_token)
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}],
                                                   "max_tokens": 1, "prompt_logprobs": 0}).json()
    prompt = chat["prompt_logprobs"]
    assert len(prompt) == chat["usage"]["prompt_tokens"] and prompt[0] is None and all(len(p) == 1 for p in prompt[1:])
    plain = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "best_of": 1})
    assert plain.status_code == 200 and "prompt_logprobs" not in plain.json()["choices"][0], plain.text
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}],
                                                   "max_tokens": 1}).json()["prompt_logprobs"] is None


def test_structured_outputs_through_every_request_field(client, tiny_model_dir):
    """response_format (json_schema, json_object), vLLM's structured_outputs and its
    guided_* fields all constrain the output (the tiny random model's)."""
    import re
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "kind": {"enum": ["block", "slot"]}},
              "required": ["id", "kind"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(
        model=str(tiny_model_dir), messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}})
    item = json.loads(chat.choices[0].message.content)
    assert set(item) == {"id", "kind"} and item["kind"] in ("block", "slot") and chat.choices[0].finish_reason == "stop"
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    for extra in ({"structured_outputs": {"regex": date}}, {"guided_regex": date}):
        got = client.completions.create(model=str(tiny_model_dir), prompt="Today is", max_tokens=20,
                                        temperature=1.0, seed=3, n=3, extra_body=extra)
        assert all(re.fullmatch(date, c.text) and c.finish_reason == "stop" for c in got.choices)
    stream = client.chat.completions.create(model=str(tiny_model_dir), messages=messages, max_tokens=20,
                                            stream=True, extra_body={"guided_choice": ["yes", "no"]})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no")


# ---- concurrency, metrics, disconnect ----------------------------------------------

async def _stream_text(client: httpx.AsyncClient, body: dict) -> str:
    text = ""
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_a_prompt_of_max_model_len_is_refused_and_one_less_gives_one_token(http):
    """Field case C58, at the tiny model's max_model_len of 256: a prompt of exactly 256
    token ids with max_tokens 5 is a 400 naming max_model_len and both lengths, streamed
    or not (it once ran to 257 tokens in all); 255 ids give exactly one token, ended by
    length, streamed or not, with max_tokens 1 or none (255 ids and max_tokens 5 are
    vLLM's 400 since issue 34: test_c75_...)."""
    for stream in (False, True):
        r = http.post("/v1/completions", json={"prompt": [7] * 256, "max_tokens": 5, "stream": stream})
        assert r.status_code == 400, (stream, r.text)
        assert all(w in r.json()["error"]["message"] for w in ("256 tokens", "max_model_len=256")), r.text
    for max_tokens in (1, None):
        body = {"prompt": [7] * 255, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        whole = http.post("/v1/completions", json=body).json()
        assert whole["usage"]["completion_tokens"] == 1 and whole["choices"][0]["finish_reason"] == "length"
        chunks = [json.loads(line[6:]) for line in
                  http.post("/v1/completions", json=dict(body, stream=True)).text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_c82_n_of_a_million_is_a_400_and_the_engine_keeps_serving(http):
    """Field case C82 (issue 34): n = 10**6 once killed the EngineCore allocating 196 GB of
    logits. Now the Processor refuses it, a 400 naming n, its value and the limit,
    streamed or not, completions and chat; the next requests are served."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 129})   # one past the limit
    assert r.status_code == 400 and "SamplingParams.n=129 is more than max_num_seqs=128" in r.text, r.text
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            start = time.monotonic()
            r = http.post(path, json=dict(body, max_tokens=1, n=1_000_000, stream=stream))
            assert r.status_code == 400 and time.monotonic() - start < 5, (path, stream, r.text)
            assert "SamplingParams.n=1000000 is more than max_num_seqs=128" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 21})
    assert r.status_code == 400 and "SamplingParams.logprobs=21 is more than max_logprobs=20" in r.text


def test_c75_max_tokens_past_the_context_is_vllms_400(http):
    """Field case C75 (issue 34) at max_model_len 256: a 15-token prompt with max_tokens
    1000 is a 400 with vLLM's message, for completions and for chat's max_tokens and
    max_completion_tokens, streamed and not; max_tokens that fit exactly is a 200 with
    that many tokens; a chat without max_tokens runs up to the context."""
    def message(prompt_len, max_tokens):
        return (f"This model's maximum context length is 256 tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.")

    messages = [{"role": "user", "content": "Hello"}]
    chat_len = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    cases = [("/v1/completions", {"prompt": [7] * 15}, 15, "max_tokens"),
             ("/v1/chat/completions", {"messages": messages}, chat_len, "max_tokens"),
             ("/v1/chat/completions", {"messages": messages}, chat_len, "max_completion_tokens")]
    for path, body, prompt_len, field in cases:
        for stream in (False, True):
            r = http.post(path, json=dict(body, stream=stream, **{field: 1000}))
            assert r.status_code == 400, (path, field, stream, r.text)
            assert r.json()["error"]["message"] == message(prompt_len, 1000)
        fits = dict(body, temperature=0, ignore_eos=True, **{field: 256 - prompt_len})
        r = http.post(path, json=fits)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256 - prompt_len, r.text
    r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256 - chat_len


def test_stop_reason_is_null_on_eos_and_the_id_for_a_stop_token_id(http, tiny_model_dir):
    """Issue 34: stop_reason is null when the eos ends a completion (it was the eos id),
    the id when a stop_token_ids id does, streamed or not, completions and chat. A logit
    bias of 100 makes the first token the one to stop on."""
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    stop = 7
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        for extra, want in (({"logit_bias": {str(eos): 100}}, None),
                            ({"logit_bias": {str(stop): 100}, "stop_token_ids": [stop]}, stop)):
            req = dict(body, max_tokens=5, temperature=0, **extra)
            choice = http.post(path, json=req).json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", want), (path, extra, choice)
            last = _sse_events(http.post(path, json=dict(req, stream=True)).text)[-1]["choices"][0]
            assert (last["finish_reason"], last["stop_reason"]) == ("stop", want), (path, extra, last)


def test_32_concurrent_streams_equal_their_solo_outputs(tiny_server, http):
    bodies = [{"prompt": PROMPTS[i % 3] + " " * (i // 3 % 2), "max_tokens": 4 + i % 9, "temperature": 0,
               "ignore_eos": True} for i in range(32)]
    solo = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    bad = [{"prompt": "hi", "temperature": -1}, {"prompt": "Hello " * 300}, {"prompt": []}]

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=64)) as c:
            good = asyncio.gather(*[_stream_text(c, b) for b in bodies])
            errors = asyncio.gather(*[c.post("/v1/completions", json=b) for b in bad])
            return await asyncio.gather(good, errors)

    texts, errors = asyncio.run(main())
    assert texts == solo
    assert [r.status_code for r in errors] == [400, 400, 400]
    m = _metrics(http)
    assert m["nanopaged:num_requests_running"] == 0 and m["nanopaged:num_requests_waiting"] == 0
    assert m["nanopaged:kv_cache_blocks_used"] == 0 and m["nanopaged:kv_cache_blocks_total"] == 256
    assert m["nanopaged:generation_tokens_total"] >= 2 * sum(b["max_tokens"] for b in bodies)
    assert m["nanopaged:time_to_first_token_seconds_count"] >= 64
    assert m["nanopaged:e2e_request_latency_seconds_count"] >= 64
    assert m["nanopaged:prefix_cache_hits_total"] > 0 and 0 < m["nanopaged:prefix_cache_hit_rate"] < 1
    assert m["nanopaged:prompt_tokens_total"] > 0 and m["nanopaged:inter_token_latency_seconds_count"] > 0
    assert m["nanopaged:num_preemptions_total"] >= 0


def test_c23_disconnect_mid_stream_aborts(tiny_server, http):
    """C23 through the server: close the stream after two chunks."""
    after = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    before_text = http.post("/v1/completions", json=after).json()["choices"][0]["text"]
    used0 = _metrics(http)["nanopaged:kv_cache_blocks_used"]
    with httpx.Client(base_url=tiny_server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True,
                                                        "temperature": 0, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break
    deadline = time.monotonic() + 5
    while True:
        m = _metrics(http)
        if m["nanopaged:num_requests_running"] == 0 and m["nanopaged:kv_cache_blocks_used"] == used0:
            break
        assert time.monotonic() < deadline, f"not aborted: {m}"
        time.sleep(0.05)
    assert http.post("/v1/completions", json=after).json()["choices"][0]["text"] == before_text


def test_disconnect_before_a_whole_response_aborts(tiny_server, http):
    """A non-streamed request whose client gives up is aborted too (vLLM's with_cancellation)."""
    generated = _metrics(http)["nanopaged:generation_tokens_total"]
    # 0.05 s: the tiny model makes its 240 tokens in ~0.5 s on a quiet 2-core machine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/v1/completions", timeout=httpx.Timeout(5, read=0.05), headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True})
    deadline = time.monotonic() + 5
    while (m := _metrics(http))["nanopaged:num_requests_running"] or m["nanopaged:kv_cache_blocks_used"]:
        assert time.monotonic() < deadline, f"not aborted: {m}"
        time.sleep(0.05)
    assert m["nanopaged:generation_tokens_total"] - generated < 240


@pytest.mark.timeout(240)
def test_sigterm_with_streams_in_flight_stops_the_core_and_exits_0(tiny_model_dir):
    """Field case C67. SIGTERM (how systemd, Docker and Kubernetes stop a service) while 8
    streams are being served: the server exits with status 0, its EngineCore process is
    gone, and so is the core's ipc folder; every client sees its stream end or an error,
    none hangs. uvicorn raises the signal again after its graceful end; with the default
    action the process died there (status -15) before shutting the core down. (SIGTERM
    to an idle server: every test's Server.stop.)"""
    server = Server(tiny_model_dir, *TINY_ARGS, "--log-level", "info")
    try:
        ready = f"ready on http://127.0.0.1:{server.port}"
        deadline = time.monotonic() + 10
        while True:                      # progress from both processes, "ready" once it listens
            server.log.seek(0)
            said = server.log.read()
            if ready in said or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "KV cache: 256 blocks of 4 tokens" in said and "attention: the PyTorch reference" in said, said
        assert ready in said and said.index("KV cache:") < said.index(ready), said
        children = server.children()
        assert children, "no EngineCore process"
        assert [p for p in os.listdir(server.tmpdir) if p.startswith("nanopaged-")], "no ipc folder"
        body = {"model": str(tiny_model_dir), "prompt": "Hello", "max_tokens": 200, "stream": True,
                "ignore_eos": True, "temperature": 0}
        streaming, ended = threading.Barrier(9, timeout=60), []

        def client():
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                    lines = response.iter_lines()
                    assert next(line for line in lines if line.startswith("data:"))     # it is streaming
                    streaming.wait()
                    for _ in lines:                   # the stream ends: finished or cut off
                        pass
            ended.append(True)
        clients = [threading.Thread(target=client, daemon=True) for _ in range(8)]
        for c in clients:
            c.start()
        streaming.wait()                              # all 8 streaming
        server.proc.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(timeout=60)
        assert len(ended) == 8, f"{8 - len(ended)} clients hung"
        assert server.proc.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {alive}"
        assert os.listdir(server.tmpdir) == [], "the core's ipc folder was left behind"
    finally:
        server.stop()


def _timed_health(url: str) -> tuple[int, float]:
    """(status of GET /health, seconds it took to answer)."""
    t0 = time.monotonic()
    status = httpx.get(url + "/health", timeout=10).status_code
    return status, time.monotonic() - t0


@pytest.mark.timeout(60)
def test_health_answers_at_once_frozen_503_busy_200(tiny_server, http):
    """Field case C57 (C57h in CASES.md: health answers at once). /health never waits (a Kubernetes probe gives up after 1 s): it reads the age of
    the core's last sign of life. A core stopped by SIGSTOP (alive, but its loop does not
    turn) is a 503 answered within 1 s once it has been silent for --health-timeout (2 s
    here; the probe used to wait those 2 s for a ping), a 200 again once it runs; a core
    busy with streams is a 200 within 1 s all along (each step's outputs count)."""
    assert _timed_health(tiny_server.url)[0] == 200
    core = tiny_server.children()[0]
    core.suspend()
    try:
        time.sleep(2.5)                                   # silent for longer than --health-timeout
        status, took = _timed_health(tiny_server.url)
        assert status == 503 and took < 1.0, (status, took)
    finally:
        core.resume()
    deadline = time.monotonic() + 10
    while _timed_health(tiny_server.url)[0] != 200:
        assert time.monotonic() < deadline, "not healthy again after SIGCONT"
        time.sleep(0.1)
    body = {"prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True, "stream": True}
    probes = []
    with httpx.Client(base_url=tiny_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for i, line in enumerate(r.iter_lines()):
                if i % 40 == 1:                           # between chunks: the request runs
                    probes.append(_timed_health(tiny_server.url))
    assert len(probes) >= 3 and all(status == 200 and took < 1.0 for status, took in probes), probes
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- the default model (slow) ----------------------------------------------------

# float32 named on both sides: the server's outputs are compared with LLM's, and the
# structured-output replies must end inside max_tokens on every CPU ("auto" is bf16 on some)
DEFAULT_ARGS = ["--max-model-len", "512", "--num-gpu-blocks", "128", "--preemption-mode", "recompute",
                "--num-cpu-blocks", "0", "--dtype", "float32"]
DEFAULT_ENGINE = dict(max_model_len=512, num_gpu_blocks=128, preemption_mode="recompute", num_cpu_blocks=0,
                      dtype="float32")


@pytest.fixture(scope="module")
def default_server(default_model_dir):
    server = Server(default_model_dir, "--served-model-name", "smol", *DEFAULT_ARGS)
    try:
        yield server
    finally:
        alive = server.stop()
    assert server.proc.returncode == 0 and not alive, f"exit status {server.proc.returncode}, left behind: {alive}"
    assert server.left_in_tmp == [], f"SIGTERM left {server.left_in_tmp} in the server's TMPDIR"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_greedy_and_chat_equal_llm(default_server, default_model_dir):
    from openai import OpenAI
    from nanopaged import LLM, SamplingParams
    llm = LLM(str(default_model_dir), **DEFAULT_ENGINE)
    client = OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    params = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate(PROMPTS[:2], params)
    for prompt, w in zip(PROMPTS[:2], want):
        got = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == w.outputs[0].text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, params)[0]
    got = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.outputs[0].text
    ids = want.prompt_token_ids                     # the template's ids: no second BOS added
    assert got.usage.prompt_tokens == len(ids)
    assert ids[:2] != [llm.get_tokenizer().bos_token_id] * 2
    chunks = list(client.chat.completions.create(model="smol", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_seeded_request_twice_gives_one_answer(default_server):
    """A seeded request through the server: sent twice (the second a prefix-cache hit) and
    once among other requests, it gets the same two samples each time. (In float32, as the
    server here runs; the same claim in bf16, where oneDNN's matmul once added a shorter
    hit batch's terms in another order, is test_real_model's seeded-chat test.)"""
    from openai import OpenAI
    client = OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    body = dict(model="smol", messages=[{"role": "user", "content": "Invent a name for a cat."}],
                n=2, temperature=1.0, seed=1234, max_tokens=16)

    def answers():
        return [c.message.content for c in client.chat.completions.create(**body).choices]

    first, second = answers(), answers()
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.completions.create, model="smol", prompt=p, max_tokens=24, temperature=0)
                  for p in PROMPTS]
        third = answers()
        [f.result() for f in others]
    assert first == second == third


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_response_format_json_schema(default_server):
    """The openai client's own structured-output helper (a pydantic model as
    response_format) against SmolLM2: the reply parses into the model."""
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: float
        kind: Literal["capital", "town", "village"]

    client = OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    for seed in range(3):
        reply = client.chat.completions.parse(model="smol", messages=messages, response_format=City,
                                              temperature=1.0, seed=seed, max_tokens=100)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(reply.choices[0].message.parsed, City)
    got = client.chat.completions.create(model="smol", messages=messages, max_tokens=100, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(got.choices[0].message.content), dict)
