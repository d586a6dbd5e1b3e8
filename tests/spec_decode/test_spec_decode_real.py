"""Speculative decoding on the real default model (SmolLM2-135M-Instruct), slow: greedy
ids with n-gram equal transformers' generate in float32 (block size 16); with n-gram and
with a layer draft (SmolLM2's first 10 of 30 layers, a poor guesser: about 1% accepted)
they equal the engine's own ids without speculation in bfloat16 (block sizes 4 and 1,
a tight pool, a prefix hit; emulated on a CPU without bf16 units). The prompts ask the model to copy text, where n-gram drafts are accepted;
plain chat is bench.py --sections spec's."""
import pytest
import torch

from nanopaged import LLM, SamplingParams
from nanopaged.spec_decode.draft_model import make_layer_draft

pytestmark = pytest.mark.slow

PARAGRAPH = ("The quick brown fox jumps over the lazy dog near the river bank. The dog does not move, "
             "and the fox runs back into the forest where the tall trees grow.")
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
QUESTIONS = [f"Repeat this paragraph exactly, but change the word 'fox' to 'cat':\n\n{PARAGRAPH}",
             f"Rename the variable result to total in this code and show the whole function:\n\n{CODE}"]
PARAMS = SamplingParams(temperature=0, max_tokens=32)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                        add_generation_prompt=True)).input_ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def layer_draft(default_model_dir, tmp_path_factory):
    folder = make_layer_draft(default_model_dir, tmp_path_factory.mktemp("smollm-draft"), 10)
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def hf_reference(default_model_dir, prompts):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=PARAMS.max_tokens, do_sample=False)
        out.append(y[0, len(ids):].tolist())
    return out


def greedy(model_dir, prompts, **kw):
    llm = LLM(str(model_dir), kv_cache_memory_bytes=64 << 20, **kw)
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    stats = llm.engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"]
    return ids, stats


def test_float32_greedy_with_speculation_equals_transformers(default_model_dir, prompts, hf_reference):
    """In float32 the ids are transformers' on every CPU, and so are the n-gram drafts
    taken from them: the copy prompts accept many, in far fewer steps than without."""
    _, base = greedy(default_model_dir, prompts, dtype="float32")
    ids, stats = greedy(default_model_dir, prompts, dtype="float32", speculative_config=NGRAM)
    assert ids == hf_reference
    assert stats["spec_decode_acceptance_rate"] > 0.2 and stats["num_steps"] < base["num_steps"], stats


def test_bfloat16_greedy_with_speculation_equals_without(default_model_dir, prompts, layer_draft):
    """Equal ids by design (the drafts only decide which rows a step verifies); how many
    drafts are accepted follows bf16's text, which differs by CPU, so only that drafts
    were proposed and checked is asserted here."""
    want, _ = greedy(default_model_dir, prompts, dtype="bfloat16", block_size=4)
    for spec in (NGRAM, layer_draft):
        ids, stats = greedy(default_model_dir, prompts, dtype="bfloat16", block_size=4, speculative_config=spec)
        assert ids == want, spec["method"]
        assert stats["spec_decode_num_draft_tokens"] > 0, spec["method"]


def test_block_size_1_a_tight_pool_and_a_prefix_hit(default_model_dir, prompts):
    """bfloat16, n-gram, block size 1 (every draft crosses block boundaries), a pool that
    holds one request and a half (the later one is preempted), then the same prompts
    again (prefix-cache hits): the ids without speculation, every time."""
    want, _ = greedy(default_model_dir, prompts, dtype="bfloat16", block_size=1)
    pool = max(len(p) for p in prompts) + PARAMS.max_tokens + 60
    llm = LLM(str(default_model_dir), dtype="bfloat16", block_size=1, num_gpu_blocks=pool,
              preemption_mode="recompute", speculative_config=NGRAM)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_free_gpu_blocks"] == pool
