"""LLM / LLMEngine behaviour on a tiny random Llama: API shapes, bad input, batching,
preemption and block accounting. Fast; the real-model checks are in test_real_model.py."""
import os
import sys

import pytest
import torch

from nanopaged import LLM, LLMEngine, EngineConfig, SamplingParams
from nanopaged.core.block_manager import BlockManager
from nanopaged.core.block_table import BlockTable

from invariants import check_block_invariants, run_checked

pytestmark = pytest.mark.exactness

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32")


def engine(tiny_model_dir, **kw) -> LLMEngine:
    """An engine for the comparisons below, in float32 unless a test names another dtype."""
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **kw))


# -- API shapes ---------------------------------------------------------------------------

def test_generate_accepts_every_prompt_form(llm):
    ids = llm.get_tokenizer()("Hello, my name is").input_ids
    one = llm.generate("Hello, my name is", GREEDY)
    assert len(one) == 1 and one[0].prompt == "Hello, my name is" and one[0].prompt_token_ids == ids
    assert llm.generate(ids, GREEDY)[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert llm.generate([ids, ids], GREEDY)[1].prompt is None
    outs = llm.generate(["a", "The capital", "b"], GREEDY)
    assert [o.prompt for o in outs] == ["a", "The capital", "b"]


def test_request_output_fields(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=5))[0]
    c = out.outputs[0]
    assert out.finished and c.index == 0 and c.finish_reason in ("stop", "length")
    assert 1 <= len(c.token_ids) <= 5 and isinstance(c.text, str)
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                     SamplingParams(max_tokens=5, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams()] * 2)


def test_stop_token_ids_and_eos(llm):
    first = llm.generate("Hello", GREEDY)[0].outputs[0].token_ids
    stop = first[3]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == first[:first.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_get_stats_keys(llm):
    stats = llm.engine.get_stats()
    for key in ["num_total_gpu_blocks", "num_free_gpu_blocks", "num_running", "num_waiting",
                "num_preemptions", "num_steps"]:
        assert isinstance(stats[key], int)
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"] == 64


def test_seeded_request_is_batch_invariant(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate("Hello", p)[0].outputs[0].token_ids
    crowd = llm.generate(["The", "Hello", "Paged attention"],
                         [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), p,
                          SamplingParams(temperature=0.7, max_tokens=3)])
    assert crowd[1].outputs[0].token_ids == alone


# -- bad input: a clear error before any work, and the engine keeps serving --------------

@pytest.mark.parametrize("kwargs,match", [({"block_sizee": 4}, "block_sizee"),
                                          ({"swap_space_gb": 1}, "swap_space_gb")])
def test_unknown_keyword_to_llm_is_a_type_error(tiny_model_dir, kwargs, match):
    with pytest.raises(TypeError, match=match):
        LLM(str(tiny_model_dir), **kwargs)


@pytest.mark.parametrize("kwargs,match", [({"block_size": 0}, "block_size"),
                                          ({"num_gpu_blocks": -1}, "num_gpu_blocks"),
                                          ({"dtype": "int8"}, "dtype"),
                                          ({"max_model_len": 10_000}, "max_model_len")])
def test_bad_engine_setting_is_named(tiny_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_model_dir), **kwargs)


@pytest.mark.parametrize("prompt,match", [("", "empty"), ([], "empty"), ([5, 999], "999"),
                                          ([1] * 300, "max_model_len=256")])
def test_bad_prompt_raises_and_engine_keeps_serving(llm, prompt, match):
    before = llm.engine.get_stats()
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], GREEDY)      # the good one is withdrawn too
    after = llm.engine.get_stats()
    assert after["num_free_gpu_blocks"] == before["num_free_gpu_blocks"]
    assert after["num_waiting"] == after["num_running"] == 0
    assert llm.generate("fine", GREEDY)[0].finished


@pytest.fixture(scope="module")
def llm24(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_model_len=24)


@pytest.mark.parametrize("length", [23, 24, 25])
@pytest.mark.parametrize("how", ["greedy", "n=2", "beams", "chat"])
def test_a_prompt_must_leave_room_for_one_output_token(llm24, length, how):
    """One rule for lengths on every path: prompt_len + 1 <= max_model_len. At
    max_model_len - 1 the request runs and ends at max_model_len; at max_model_len
    (once accepted, with 1 token more than the model's length in all) and past it, a
    ValueError names both numbers, and the engine keeps serving. And vLLM's rule
    (issue 34): prompt_len + max_tokens <= max_model_len, else its "maximum context
    length" message; max_tokens that fit are honoured to the token."""
    from nanopaged.engine.processor import apply_chat_template
    from nanopaged.beam_search.scheduler import BeamSearchParams
    if how == "chat":                  # a user message whose templated prompt is `length` ids
        tok = llm24.get_tokenizer()
        chats = ([{"role": "user", "content": "hi " * k + "a" * j}] for k in range(40) for j in range(4))
        prompt = next(c for c in chats if len(apply_chat_template(tok, c)) == length)
    else:
        prompt = list(range(1, length + 1))

    def run(max_tokens=5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=2 if how == "n=2" else 1)
        if how == "beams":
            return [b.sequences[0].tokens[length:] for b in
                    llm24.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=max_tokens,
                                                                  ignore_eos=True))]
        outs = llm24.chat(prompt, params, use_tqdm=False) if how == "chat" else llm24.generate(prompt, params)
        return [c.token_ids for c in outs[0].outputs]

    if length + 1 <= 24:
        assert all(len(ids) == 24 - length for ids in run(24 - length))
        with pytest.raises(ValueError, match=fr"maximum context length is 24 tokens. However, you requested "
                                             fr"{length + 5} tokens \({length} in the messages, 5 in the completion\)"):
            run(5)
    else:
        with pytest.raises(ValueError, match=fr"prompt is {length} tokens, too long for max_model_len=24: "
                                             r"a prompt may have at most 23 tokens"):
            run()
    stats = llm24.engine.get_stats()
    assert stats["num_waiting"] == stats["num_running"] == 0 and stats["num_free_gpu_blocks"] == 64


def test_a_too_long_text_prompt_gets_only_our_error(tiny_model_dir, capfd, caplog):
    """transformers' tokenizer warns "Token indices sequence length is longer than the
    specified maximum ..." when a text is longer than its model_max_length; our error
    says it already, against max_model_len, so that line must not come first."""
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_model_len=24)
    llm.get_tokenizer().model_max_length = 16
    capfd.readouterr()
    with pytest.raises(ValueError, match="too long for max_model_len=24"):
        llm.generate("Hello, my name is nanopaged. " * 8, GREEDY)
    said = capfd.readouterr().err + caplog.text          # its handler, or pytest's capture
    assert "Token indices sequence length" not in said


@pytest.mark.parametrize("field", ["prompt", "chat", "stop", "bad_words", "choice", "json", "grammar"])
def test_a_lone_surrogate_is_refused_in_every_text_field(llm, field):
    """One validator for text from users (utils/checks.check_text): a lone surrogate is
    the same ValueError naming the field wherever it comes in (a tokenizer's TypeError,
    or a stop string that could never match, before)."""
    from nanopaged.sampling_params import StructuredOutputsParams as S
    bad = "x\udfff"
    prompt, kw = ("hi", {})
    with pytest.raises(ValueError, match=r"is not valid Unicode: a lone surrogate '\\udfff' at index \d+"):
        if field == "prompt":
            prompt = bad
        elif field == "chat":
            return llm.chat([{"role": "user", "content": bad}], GREEDY, use_tqdm=False)
        elif field in ("stop", "bad_words"):
            kw = {field: ["ok", bad]}
        else:
            spec = {"choice": ["a", bad], "json": {"type": "object", "properties": {bad: {}}},
                    "grammar": f'start: "{bad}"'}[field]
            kw = {"structured_outputs": S(**{field: spec})}
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, **kw))
    assert llm.generate("fine", GREEDY)[0].finished


def test_the_engine_says_what_it_chose_as_it_starts(tiny_model_dir, capsys):
    """Progress on stderr while it starts (utils/log.py): the weights it loads, then the
    KV pool it sized and the dtype and attention backend it resolved ("auto" is never
    what a user is left with)."""
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, attention_backend="torch", num_cpu_blocks=0)
    err = capsys.readouterr().err
    assert f"loading weights from {tiny_model_dir}" in err, err
    assert "KV cache: 64 blocks of 4 tokens (" in err, err
    assert f"dtype {llm.engine.config.dtype}, attention: the PyTorch reference" in err, err
    assert llm.engine.config.dtype in ("float32", "bfloat16")


def test_missing_model_folder_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_prompt_needing_more_blocks_than_the_pool(tiny_model_dir):
    eng = engine(tiny_model_dir, num_gpu_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks.*holds only 4 blocks"):
        eng.add_request("big", list(range(1, 21)), GREEDY)
    eng.add_request("small", list(range(1, 6)), SamplingParams(temperature=0, max_tokens=3))
    assert run_checked(eng)["small"].outputs[0].finish_reason == "length"


def test_lone_sequence_outgrowing_the_pool_finishes_with_length(tiny_model_dir, caplog):
    eng = engine(tiny_model_dir, num_gpu_blocks=4, block_size=4)
    eng.add_request("grow", list(range(1, 15)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    out = run_checked(eng, max_steps=50)["grow"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16 - 14 + 1
    assert "more KV blocks than the whole pool" in caplog.text


def test_abort_frees_blocks(tiny_model_dir):
    eng = engine(tiny_model_dir, num_gpu_blocks=32, block_size=4, max_num_seqs=1)
    for i in range(3):
        eng.add_request(str(i), list(range(1, 10)), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.abort_request(["0", "2"])          # one running, one waiting
    check_block_invariants(eng)
    assert eng.get_stats()["num_running"] == 0 and eng.get_stats()["num_waiting"] == 1
    assert run_checked(eng)["1"].finished


# -- batching and preemption ----------------------------------------------------------------

def solo(tiny_model_dir, prompts, params):
    eng = engine(tiny_model_dir, num_gpu_blocks=256, block_size=16)
    out = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
        out.update(run_checked(eng))
    return {k: v.outputs[0].token_ids for k, v in out.items()}


def test_continuous_batching_refills_the_batch(tiny_model_dir):
    eng = engine(tiny_model_dir, num_gpu_blocks=64, block_size=4, max_num_seqs=2)
    lengths = [2, 6, 3, 5, 4]
    for i, n in enumerate(lengths):
        eng.add_request(str(i), [1 + i, 2, 3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    running = []
    while eng.has_unfinished_requests():
        eng.step()
        running.append([g.request_id for g in eng.scheduler.running])
    # request 2 joins the step after request 0 (2 tokens) finished, while 1 keeps running
    assert running[0] == ["0", "1"] and running[2] == ["1", "2"]
    assert eng.get_stats()["num_steps"] < sum(lengths)      # batched, not one at a time


def test_preemption_by_recompute_keeps_outputs_exact(tiny_model_dir):
    prompts = [list(range(1 + i, 12 + i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(6)]
    eng = engine(tiny_model_dir, num_gpu_blocks=14, block_size=4)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    got = {k: v.outputs[0].token_ids for k, v in run_checked(eng).items()}
    assert eng.get_stats()["num_preemptions"] > 0
    assert got == solo(tiny_model_dir, prompts, params)


def test_block_table_and_manager_basics():
    bm = BlockManager(num_gpu_blocks=5, block_size=4)
    table = BlockTable(4)
    for _ in range(table.num_new_blocks_for(9)):
        table.append_block(bm.block_pool.get_new_block())
    assert len(table) == 3
    assert table.slots(7, 9) == [table.block_ids[1] * 4 + 3, table.block_ids[2] * 4]
    assert bm.get_num_free_gpu_blocks() == 2 and bm.ref_count[table.block_ids[0]] == 1


def test_chunked_prefill_splits_a_long_prompt_and_keeps_outputs(tiny_model_dir):
    prompt = list(range(1, 40))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng = engine(tiny_model_dir, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    eng.add_request("short", [5, 6, 7], params)
    eng.step()                                              # short is decoding from now on
    eng.add_request("long", prompt, params)
    chunks, final = [], {}
    while eng.has_unfinished_requests():
        request_of = {s.seq_id: rid for rid, g in eng.requests.items() for s in g.seqs}
        out = eng.scheduler.schedule()
        chunks.append({request_of[i]: n for i, n in out.num_scheduled_tokens.items()})
        core_outputs = eng.scheduler.update_from_output(out, eng.model_runner.execute_model(out))
        final.update({o.request_id: o for o in eng.output_processor.process_outputs(core_outputs).request_outputs
                      if o.finished})
        check_block_invariants(eng)
    # running decodes first, then as much of the prompt as the 16-token budget has left
    assert chunks[:3] == [{"short": 1, "long": 15}, {"short": 1, "long": 15}, {"short": 1, "long": 9}]
    assert max(sum(c.values()) for c in chunks) <= 16
    whole = engine(tiny_model_dir, num_gpu_blocks=64, block_size=4, enable_chunked_prefill=False,
                   max_num_batched_tokens=256)
    whole.add_request("long", prompt, params)
    assert run_checked(whole)["long"].outputs[0].token_ids == final["long"].outputs[0].token_ids


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt(tiny_model_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is smaller than max_model_len=256"):
        engine(tiny_model_dir, enable_chunked_prefill=False, max_num_batched_tokens=16, max_num_seqs=4)


def test_c18_streaming_multibyte_text(tiny_model_dir):
    from nanopaged.engine.detokenizer import IncrementalDetokenizer
    tok = LLM(str(tiny_model_dir), num_gpu_blocks=8).get_tokenizer()
    text = "Café déjà vu. 東京と大阪. 👍🏽 done. "
    ids = tok(text).input_ids
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.step(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text      # nothing lost, nothing twice


def test_dtype_auto_is_bf16_only_where_the_cpu_has_bf16_dot_products(monkeypatch):
    """"auto" picks bf16 on a CPU with AVX512-BF16 or AMX, fp32 elsewhere, and fp32 with a
    quantization; NANOPAGED_AUTO_DTYPE (bfloat16 or float32) decides instead, and any other
    value is refused by name; an explicit dtype wins either way. The probe is torch's
    (cpuinfo), capped by the instruction set torch runs (ATEN_CPU_CAPABILITY)."""
    from nanopaged.utils import cpu
    monkeypatch.delenv(cpu.AUTO_DTYPE_ENV, raising=False)
    for forced in (None, "bfloat16", "float32"):
        if forced is not None:
            monkeypatch.setenv(cpu.AUTO_DTYPE_ENV, forced)
        for has_bf16 in (True, False):
            monkeypatch.setattr(cpu, "cpu_has_bf16_dot_products", lambda: has_bf16)
            expected = {None: torch.bfloat16 if has_bf16 else torch.float32,
                        "bfloat16": torch.bfloat16, "float32": torch.float32}[forced]
            assert EngineConfig(device="cpu").torch_dtype == expected
            assert EngineConfig(device="cpu", quantization="int8").torch_dtype == torch.float32
            assert EngineConfig(device="cpu", dtype="float32").torch_dtype == torch.float32
            assert EngineConfig(device="cpu", dtype="bfloat16").torch_dtype == torch.bfloat16
    monkeypatch.setenv(cpu.AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=r"NANOPAGED_AUTO_DTYPE='fp8': expected one of \['bfloat16', 'float32'\]"):
        EngineConfig(device="cpu").torch_dtype
    monkeypatch.undo()
    flags = open("/proc/cpuinfo").read().split() if sys.platform == "linux" else None
    if flags is not None:          # torch's probe agrees with what the kernel reports
        units = "avx512_bf16" in flags or "amx_tile" in flags
        torch_runs_them = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        assert cpu.cpu_has_bf16_dot_products() == (units and torch_runs_them)


def test_the_auto_dtype_switch_reaches_a_new_process():
    """NANOPAGED_AUTO_DTYPE is read where the config resolves, in whatever process: a child
    started with it (as servers, EngineCore and worker processes inherit it) resolves
    "auto" to that dtype."""
    import subprocess
    code = "from nanopaged.config import EngineConfig; print(EngineConfig(device='cpu').torch_dtype)"
    for forced in ("bfloat16", "float32"):
        env = dict(os.environ, NANOPAGED_AUTO_DTYPE=forced)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == f"torch.{forced}", out.stderr[-2000:]


def test_the_config_is_resolved_once_into_a_frozen_copy(tiny_model_dir):
    """The engine resolves the user's EngineConfig once (arg_utils.create_engine_config)
    into a new frozen one that every part takes whole: what "auto" and None became is
    readable afterwards, the user's object is left as it was, and nobody can change it."""
    import dataclasses

    from nanopaged.utils.cpu import auto_cpu_dtype

    given = EngineConfig(model=str(tiny_model_dir), block_size=4, num_gpu_blocks=16)
    eng = LLMEngine(given)
    got = eng.config
    assert (given.dtype, given.device, given.max_model_len, given.scheduler_config.max_num_batched_tokens) == ("auto", "auto", None, None)
    assert got.dtype == str(auto_cpu_dtype()).removeprefix("torch.") and got.device == "cpu"
    assert got.max_model_len == eng.model_config.max_position_embeddings
    assert got.scheduler_config.max_num_batched_tokens == 512 and got.parallel_config.distributed_executor_backend == "uni"   # the CPU's default
    assert got.resolve(got.max_model_len) == got                      # resolving again changes nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.max_model_len = 3
    assert eng.engine_core.config is got and eng.processor.max_model_len == got.max_model_len
