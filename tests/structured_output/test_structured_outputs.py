"""Structured outputs (SamplingParams.structured_outputs; structured_output/manager.py;
chapters/18-structured-outputs.md) on the tiny random Llama: every sample follows its
constraint, unconstrained neighbours are untouched, and the constraint survives
everything the engine does to a sequence (n > 1, preemption by swap and recompute,
prefix caching, chunked prefill, stop strings, async scheduling). The real model's
tests (40 JSON samples validated with jsonschema) are at the end, marked slow."""
import json
import re

import jsonschema
import pytest
import torch

from nanopaged import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from nanopaged.worker.sampler import apply_grammar_bitmask

from invariants import run_checked

pytestmark = pytest.mark.exactness

DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"   # not \d: to llguidance (Rust regex) \d is any Unicode digit
CHOICES = ["Paris", "London", "a KV cache"]
# compact: a random model given free whitespace may spend all its tokens on it
SMALL_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["block", "slot"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2}},
    "required": ["id", "kind", "tags"], "additionalProperties": False}
PROMPTS = [[1, 2, 3, 4, 5], list(range(20, 37)), [7, 8, 9]]


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def texts(outs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


def run(folder, prompts, params, **kw):
    """(token_ids, finish_reason, text) of every completion, after checking every block
    came back."""
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("dtype", "float32")
    llm = LLM(str(folder), block_size=4, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == llm.engine.block_manager.num_gpu_blocks
    return [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs]


# -- the parameters -----------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of.*regex.*choice"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"regex": ""}, "regex must be a non-empty str"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 1]}, "choice must be a non-empty list"),
    ({"json_object": "yes"}, "json_object must be a bool"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
])
def test_params_check_their_shape(kw, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


@pytest.mark.parametrize("kw, words", [
    ({"json": {"type": "objectx"}}, r"json does not compile: .*objectx"),
    ({"json": "{not json"}, r"json is not valid JSON"),
    ({"regex": "(abc"}, r"(?s)regex does not compile: .*unclosed group"),
    ({"grammar": "start: ( \"a\""}, r"grammar"),
    ({"json": [1, 2]}, r"json must be a JSON schema"),
])
def test_a_bad_spec_fails_at_add_time_and_the_engine_keeps_serving(tiny_model_dir, kw, words):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4)
    with pytest.raises(ValueError, match=words):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=so(**kw)), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=12, structured_outputs=so(regex=DATE)),
                       use_tqdm=False)
    assert re.fullmatch(DATE, out[0].outputs[0].text)
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == 64


def test_beam_search_with_structured_outputs_is_refused(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks=64, block_size=4))
    from nanopaged.beam_search.messages import BeamSearchRequest
    from nanopaged.beam_search.scheduler import BeamSearchParams
    params = SamplingParams(max_tokens=4, structured_outputs=so(regex=DATE))
    request = BeamSearchRequest("b", [1, 2, 3], params, frozenset({0}), 0.0, BeamSearchParams(beam_width=2))
    with pytest.raises(ValueError, match="not with beam search"):
        eng.engine_core.add_request(request)


# -- the mask ---------------------------------------------------------------------------------

def test_apply_grammar_bitmask_forbids_exactly_the_zero_bits():
    torch.manual_seed(0)
    vocab = 70                                   # 3 words of 32 bits: 26 bits past the vocab
    logits = torch.randn(4, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    out = logits.clone()
    apply_grammar_bitmask(out, [3, 1], bitmask)
    for mask_row, row in ((0, 3), (1, 1)):
        allowed = [(int(bitmask[mask_row, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        for t in range(vocab):
            assert out[row, t] == (logits[row, t] if allowed[t] else float("-inf"))
    assert torch.equal(out[[0, 2]], logits[[0, 2]])            # rows without a mask: untouched
    narrow = logits.clone()
    apply_grammar_bitmask(narrow, [0], bitmask[:1, :1])          # tokens past the mask's width
    assert torch.isinf(narrow[0, 32:]).all()


# -- every sample follows its constraint ----------------------------------------------------

@pytest.mark.parametrize("constraint, check", [
    (so(regex=DATE), lambda t: re.fullmatch(DATE, t)),
    (so(regex=r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"), lambda t: re.fullmatch(r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", t)),
    (so(choice=CHOICES), lambda t: t in CHOICES),
    (so(json=SMALL_SCHEMA, disable_any_whitespace=True), lambda t: jsonschema.validate(json.loads(t), SMALL_SCHEMA) or True),
    (so(json=json.dumps(SMALL_SCHEMA), whitespace_pattern=r"[ ]?"),
     lambda t: jsonschema.validate(json.loads(t), SMALL_SCHEMA) or "\n" not in t),
    (so(grammar='start: "x" NUM ("+" NUM)*\nNUM: /[0-9]{1,2}/'), lambda t: re.fullmatch(r"x\d{1,2}(\+\d{1,2})*", t)),
])
def test_seeded_samples_at_temperature_1_all_follow_the_constraint(tiny_model_dir, constraint, check):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=constraint) for i in range(8)]
    outs = run(tiny_model_dir, [PROMPTS[i % 3] for i in range(8)], params)
    for (tokens, reason, text), in outs:
        assert reason == "stop" and check(text), (reason, text)


def test_the_grammar_ends_the_sequence_on_its_last_token(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=so(choice=CHOICES))
    (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    c = out.outputs[0]
    # no eos is drawn after "Paris": the language allows nothing more, so it stops there
    assert c.finish_reason == "stop" and c.stop_reason is None and c.text in CHOICES
    assert llm.get_tokenizer().decode(c.token_ids) == c.text


def test_max_tokens_mid_structure_ends_with_length(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs=so(regex=r"[0-9]{12}"))
    ((tokens, reason, text),), = run(tiny_model_dir, [[1, 2, 3]], params)
    assert reason == "length" and len(tokens) == 3 and re.fullmatch(r"[0-9]+", text) and len(text) < 12


def test_a_spec_is_compiled_once_and_each_sequence_gets_its_own_matcher(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks=64, block_size=4))
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, structured_outputs=so(regex=DATE))
    for rid in "abc":
        eng.add_request(rid, [1, 2, 3], params)
    manager = eng.engine_core.structured_output_manager
    assert manager.num_compiled == 1
    scheduler = eng.engine_core.scheduler
    grammars = [scheduler.grammars[s.seq_id] for g in scheduler.requests.values() for s in g.seqs]
    assert len({id(g) for g in grammars}) == 9
    outs = run_checked(eng)
    assert all(re.fullmatch(DATE, c.text) for o in outs.values() for c in o.outputs)
    assert len({c.text for o in outs.values() for c in o.outputs}) > 1          # the samples differ
    assert manager.num_mask_rows > 0


# -- neighbours and the engine's machinery ---------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)])
def test_an_unconstrained_request_equals_its_solo_run(tiny_model_dir, params):
    solo = run(tiny_model_dir, [PROMPTS[1]], params)
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_outputs=so(regex=DATE))
    mixed = run(tiny_model_dir, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [constrained, params, constrained])
    assert mixed[1] == solo[0]
    assert all(re.fullmatch(DATE, mixed[i][0][2]) for i in (0, 2))


def workload():
    """Constrained and free requests with n > 1, a shared prefix and a stop string."""
    prefix = list(range(40, 60))
    prompts = [prefix + [i] for i in range(6)] + [PROMPTS[2]]
    kinds = [so(regex=DATE), so(choice=CHOICES), so(json=SMALL_SCHEMA, disable_any_whitespace=True), None]
    params = [SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=64 if kinds[i % 4] else 48,
                             structured_outputs=kinds[i % 4], ignore_eos=kinds[i % 4] is None) for i in range(6)]
    params.append(SamplingParams(temperature=0.9, seed=9, max_tokens=20, stop=["-"],
                                 structured_outputs=so(regex=DATE)))
    return prompts, params


@pytest.fixture(scope="module")
def workload_reference(tiny_model_dir):
    prompts, params = workload()
    outs = run(tiny_model_dir, prompts, params, num_gpu_blocks=256, enable_prefix_caching=False)
    for i, completions in enumerate(outs[:6]):
        for tokens, reason, text in completions:
            if i % 4 == 0:
                assert re.fullmatch(DATE, text)
            elif i % 4 == 1:
                assert text in CHOICES
            elif i % 4 == 2:
                jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    ((tokens, reason, text),) = outs[6]
    assert reason == "stop" and re.fullmatch(r"[0-9]{4}", text)       # cut at the stop string
    return outs


@pytest.mark.parametrize("kw", [
    dict(num_gpu_blocks=32, preemption_mode="swap", num_cpu_blocks=200),
    dict(num_gpu_blocks=32, preemption_mode="recompute"),
    dict(max_num_batched_tokens=8, max_num_seqs=8),                   # chunked prefill
    dict(async_scheduling=True),
    dict(async_scheduling=True, num_gpu_blocks=32, preemption_mode="recompute", max_num_batched_tokens=16,
         max_num_seqs=16),
], ids=["swap", "recompute", "chunked", "async", "async-recompute-chunked"])
def test_the_constraint_survives_the_engines_machinery(tiny_model_dir, workload_reference, kw):
    prompts, params = workload()
    llm = LLM(str(tiny_model_dir), block_size=4, **{"num_gpu_blocks": 256, "dtype": "float32", **kw})
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)    # its prefix is then cached
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in first + outs]
    assert got == workload_reference[:1] + workload_reference
    stats = llm.engine.get_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"]
    if "preemption_mode" in kw:
        assert stats[f"num_preemptions_{kw['preemption_mode']}"] > 0


# -- the real model (slow) ----------------------------------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "role": {"enum": ["student", "teacher", "engineer", "artist"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"], "additionalProperties": False},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "height_m", "role", "address", "skills"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm(default_model_dir):
    """float32: the tests below assert where the model's sampled JSON ends, which bf16's
    CPU-dependent rounding would change."""
    return LLM(str(default_model_dir), dtype="float32")


@pytest.mark.slow
def test_40_json_samples_at_temperature_1_all_validate(smollm):
    chat = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=so(json=PERSON))
              for i in range(40)]
    outs = smollm.chat([chat] * 40, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({o.outputs[0].text for o in outs}) > 30                  # really 40 samples


@pytest.mark.slow
def test_regex_and_choice_samples_all_match(smollm):
    email = r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)"
    cases = [("Today's date is", so(regex=DATE), lambda t: re.fullmatch(DATE, t)),
             ("Write an email address:", so(regex=email), lambda t: re.fullmatch(email, t)),
             ("Which is the capital of France?", so(choice=CHOICES), lambda t: t in CHOICES)]
    for prompt, constraint, check in cases:
        params = SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=40, structured_outputs=constraint)
        (out,) = smollm.generate([prompt], params, use_tqdm=False)
        assert all(c.finish_reason == "stop" and check(c.text) for c in out.outputs), texts([out])
    # any JSON object: at temperature 1 its keys and values have no bound (some samples
    # run to max_tokens, "length"), so greedy, and a question with a short answer
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=so(json_object=True))
    question = "Reply with a JSON object holding the name and the country of the city Paris."
    (out,) = smollm.chat([[{"role": "user", "content": question}]], params,
                         use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and isinstance(json.loads(out.outputs[0].text), dict)
