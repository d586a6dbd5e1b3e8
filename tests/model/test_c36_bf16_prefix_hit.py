"""Field case C36: bf16 greedy output must not change on a prefix-cache hit.

A 163-token Chinese prompt, bf16, greedy, 16 new tokens, the same request twice with
prefix caching on: the second run finds 160 tokens (10 blocks of 16) in the cache and
computes 3. Before the fix the two runs split (this prompt at output token 13): SDPA,
given the 3 queries of the hit path rather than all 163, rounded the attention of
positions 160-162 differently in a few layers (by 1 bf16 step), and the K/V and the
logits followed (max |diff| 0.3 at the last prompt position).
attention._prefill now calls SDPA one KV block of queries at a time, so the hit path
makes exactly the calls the miss path made for the blocks it computes.
"""
import pytest
import torch

from nanopaged import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = ("人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。"
        "北京是中华人民共和国的首都，是全国的政治中心、文化中心、国际交往中心和科技创新中心。"
        "从前有一座山，山里有一座庙，庙里有一个老和尚在给小和尚讲故事。长江是亚洲第一长河，全长约六千三百公里，"
        "流经青海、西藏、四川、云南、重庆、湖北、湖南、江西、安徽、江苏和上海。茶起源于中国，饮茶的习惯已有几千年的历史。")


@pytest.mark.parametrize("num_prompt", [163, 161])
def test_c36_bf16_greedy_equal_on_prefix_cache_hit(default_model_dir, num_prompt):
    """The hit run's logits equal the miss run's bit for bit, every step, so its tokens do.

    Bitwise equality is what the two paths now reach on the CPU (the matmuls of this model
    give a row the same result whatever the number of rows; SDPA now gets the same calls).
    161 tokens leave a tail of one prompt token after the hit: it is prefill, not a decode
    row (model_runner.prepare_inputs), so it too makes the miss path's SDPA call rather
    than going through the decode kernel, whose rounding differs.
    """
    llm = LLM(str(default_model_dir), dtype="bfloat16", enable_prefix_caching=True, block_size=16,
              kv_cache_memory_bytes=64 << 20)
    model = llm.engine.model_runner.model
    prompt = llm.get_tokenizer()(TEXT * 2, add_special_tokens=False)["input_ids"][34:34 + num_prompt]
    assert len(prompt) == num_prompt
    forward, compute_logits = model.forward, model.compute_logits
    num_tokens, logits = [], []
    model.forward = lambda ids, *a: num_tokens.append(len(ids)) or forward(ids, *a)
    model.compute_logits = lambda h: logits.append(compute_logits(h)) or logits[-1]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    runs = []
    for _ in range(2):
        num_tokens.clear(), logits.clear()
        hits = llm.engine.get_stats()["prefix_cache_hits"]
        tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        runs.append((tokens, torch.cat(logits), num_tokens[0],
                     llm.engine.get_stats()["prefix_cache_hits"] - hits))
    (miss, miss_logits, miss_computed, _), (hit, hit_logits, hit_computed, hit_cached) = runs

    assert (miss_computed, hit_computed, hit_cached) == (num_prompt, num_prompt - 160, 160)
    differ = (miss_logits != hit_logits).any(-1).nonzero().flatten().tolist()
    assert not differ, (f"logits differ from step {differ[0]}: max |diff| "
                        f"{(miss_logits - hit_logits).abs().max().item():.3g}; tokens {miss} vs {hit}")
    assert hit == miss
