"""LoRA adapters in `python -m nanopaged.serve` (nanopaged/lora/serving.py), as a user
meets them: one server process on the tiny Llama with two peft adapters
(`--enable-lora --lora-modules a=... b=...`), the official `openai` client and raw httpx.

Equal: each adapter's greedy text, picked by the OpenAI `model` field (completions and
chat, plain and streamed), is what `LLM.generate` / `LLM.chat` gives with that
LoRARequest in the same dtype and backend; the base model's name gives the base model.
An unknown name is vLLM's 404. /v1/models lists the adapters under the base model.
Adapters load and unload at run time (--allow-runtime-lora-updating) behind the API key;
a bad folder is a 400 naming its file and field, and the server serves on. At the start,
a bad folder or --lora-modules without --enable-lora exit 1 with the error.
"""
from __future__ import annotations

import math

import httpx
import pytest
from peft_adapters import bad_adapter, lora_adapters  # noqa: F401 (fixtures)
from serve_harness import KEY, TINY_ARGS, TINY_ENGINE, _free_port, running_server

from nanopaged import LLM, SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPT = list(range(5, 14))
CHAT = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 8
LONG = 96                     # a stream still running when its adapter is unloaded


@pytest.fixture(scope="module")
def server(tiny_model_dir, lora_adapters):
    a, b = lora_adapters["attn"].lora_path, lora_adapters["mlp"].lora_path
    with running_server(tiny_model_dir, "--api-key", KEY, *TINY_ARGS, "--enable-lora", "--max-loras", "2",
                        "--lora-modules", f"a={a}", f'{{"name": "b", "path": "{b}"}}',
                        "--allow-runtime-lora-updating") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def want(tiny_model_dir, lora_adapters):
    """(completion text, chat text) per model name, from LLM with the same engine flags;
    "all" is the adapter the runtime test loads; ("all", LONG): its longer completion."""
    llm = LLM(str(tiny_model_dir), **TINY_ENGINE, enable_lora=True, max_loras=2)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = {"a": lora_adapters["attn"], "b": lora_adapters["mlp"], "all": lora_adapters["all"], "base": None}
    texts = {name: (llm.generate([PROMPT], greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text,
                    llm.chat(CHAT, greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text)
             for name, lora in loras.items()}
    longer = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    texts["all", LONG] = llm.generate([PROMPT], longer, use_tqdm=False, lora_request=loras["all"])[0].outputs[0].text
    llm.shutdown()
    return texts


def complete(client, model: str, stream: bool) -> str:
    kw = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        out = client.completions.create(**kw)
        assert out.model == model                     # vLLM answers with the name asked for
        return out.choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)


def chat(client, model: str, stream: bool) -> str:
    kw = dict(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_the_model_field_picks_each_adapter_and_the_base_name_the_base(client, server, tiny_model_dir, want,
                                                                        stream):
    assert len({want[name][0] for name in ("a", "b", "all", "base")}) == 4     # each adapter changes the output
    for name in ("a", "b", str(tiny_model_dir)):
        key = "base" if name == str(tiny_model_dir) else name
        assert complete(client, name, stream) == want[key][0], name
        assert chat(client, name, stream) == want[key][1], name


def test_an_unknown_model_is_vllms_404(client):
    import openai
    with pytest.raises(openai.NotFoundError) as caught:
        complete(client, "c", stream=False)
    assert caught.value.status_code == 404 and "The model `c` does not exist." in str(caught.value)
    assert caught.value.body["code"] == "model_not_found"


def test_models_lists_the_adapters_under_the_base_model(client, tiny_model_dir, lora_adapters):
    cards = {m.id: m for m in client.models.list().data}
    base = str(tiny_model_dir)
    assert list(cards) == [base, "a", "b"]
    assert (cards["a"].root, cards["a"].parent) == (lora_adapters["attn"].lora_path, base)
    assert (cards["b"].root, cards["b"].parent) == (lora_adapters["mlp"].lora_path, base)
    assert getattr(cards[base], "parent", None) is None


def test_load_and_unload_at_run_time_behind_the_key(server, client, http, tiny_model_dir, lora_adapters, want):
    """A request running with an adapter when it is unloaded finishes with it; new ones
    naming it get the 404."""
    body = {"lora_name": "all", "lora_path": lora_adapters["all"].lora_path}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body).status_code == 401
    loaded = http.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'all' added successfully."
    again = http.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    base = http.post("/v1/load_lora_adapter", json=dict(body, lora_name=str(tiny_model_dir)))
    assert base.status_code == 400 and "is the base model's name" in base.json()["error"]["message"]
    assert "all" in [m.id for m in client.models.list().data]
    assert complete(client, "all", stream=False) == want["all"][0]

    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 401
    stream = client.completions.create(model="all", prompt=PROMPT, max_tokens=LONG, temperature=0,
                                       extra_body={"ignore_eos": True}, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text                    # running with the adapter
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'all' removed successfully."
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want["all", LONG]
    assert "all" not in [m.id for m in client.models.list().data]
    assert http.post("/v1/completions", json={"model": "all", "prompt": PROMPT}).status_code == 404
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'all' cannot be found."


def _nan(config, tensors):
    name = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[name][0, 0] = math.nan


def _missing(config, tensors):
    del tensors[next(k for k in tensors if k.endswith("v_proj.lora_A.weight"))]


def _misshapen(config, tensors):
    name = next(k for k in tensors if k.endswith("k_proj.lora_A.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()


@pytest.mark.parametrize("edit, file, words", [
    (lambda config, tensors: config.update(r=64), "adapter_config.json", "r=64: more than the engine's max_lora_rank"),
    (_missing, "adapter_model.safetensors", "lacks tensor"),
    (_misshapen, "adapter_model.safetensors", "has shape"),
    (_nan, "adapter_model.safetensors", "holds NaN or infinite values"),
], ids=["rank", "missing tensor", "wrong shape", "nan"])
def test_a_bad_folder_is_a_400_naming_its_file_and_field_and_the_server_serves_on(http, bad_adapter, edit, file,
                                                                                   words):
    folder = bad_adapter("bad", edit)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": folder})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"{folder}/{file}" in message and words in message, message
    assert http.post("/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert http.post("/v1/completions", json={"model": "bad", "prompt": PROMPT}).status_code == 404


def test_a_bad_folder_at_the_start_exits_1_naming_its_file_and_field(tiny_model_dir, bad_adapter, capsys):
    from nanopaged.entrypoints.openai.api_server import main
    folder = bad_adapter("bad", lambda config, tensors: config.update(r=64))
    assert main(["--model", str(tiny_model_dir), "--port", str(_free_port()), *TINY_ARGS, "--enable-lora",
                 "--lora-modules", f"bad={folder}"]) == 1
    err = capsys.readouterr().err
    assert f"{folder}/adapter_config.json" in err and "r=64" in err and "Traceback" not in err, err


def test_lora_modules_without_enable_lora_is_an_error_naming_both_flags(tiny_model_dir, lora_adapters, capsys):
    from nanopaged.entrypoints.openai.api_server import main
    assert main(["--model", str(tiny_model_dir), "--port", str(_free_port()), *TINY_ARGS,
                 "--lora-modules", f"a={lora_adapters['attn'].lora_path}"]) == 1
    err = capsys.readouterr().err
    assert "--lora-modules needs --enable-lora" in err, err


def test_runtime_updating_without_an_api_key_is_refused_at_the_start(tiny_model_dir, capsys):
    """A load makes the server read a folder the client names: never for a client without the key."""
    from nanopaged.entrypoints.openai.api_server import main
    assert main(["--model", str(tiny_model_dir), "--port", str(_free_port()), *TINY_ARGS, "--enable-lora",
                 "--allow-runtime-lora-updating"]) == 1
    err = capsys.readouterr().err
    assert "--allow-runtime-lora-updating needs --api-key" in err and "Traceback" not in err, err


@pytest.mark.parametrize("item, words", [("a", "expected name=path"), ('{"name": "a"', "is not JSON"),
                                         ('{"name": "a", "path": "/p", "rank": 2}', "unknown field 'rank'"),
                                         ("=/p", "non-empty")])
def test_a_malformed_lora_module_is_a_usage_error(item, words, capsys):
    from nanopaged.entrypoints.openai.api_server import parse_args
    with pytest.raises(SystemExit) as caught:
        parse_args(["--lora-modules", item])
    assert caught.value.code == 2 and words in capsys.readouterr().err


def test_both_forms_of_lora_modules_parse():
    from nanopaged.entrypoints.openai.api_server import parse_args
    from nanopaged.lora.serving import LoRAModulePath
    args = parse_args(["--lora-modules", "a=/x=y", '{"name": "b", "path": "/p", "base_model_name": "m"}'])
    assert args.lora_modules == [LoRAModulePath("a", "/x=y"), LoRAModulePath("b", "/p")]
