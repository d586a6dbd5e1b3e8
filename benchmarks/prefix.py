"""prefix: one 512-token system prompt shared by 32 short questions, prefix caching on
vs off: prompt tokens computed and end-to-end time."""
from __future__ import annotations

import random
import time


def bench_prefix_caching(model, dtype) -> None:
    """Shared system prompt: compare prompt tokens computed and time, caching on vs off."""
    from nanopaged import LLM, SamplingParams
    rng = random.Random(1)
    system = [rng.randrange(100, 40000) for _ in range(512)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(rng.randint(8, 32))] for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    result = {}
    for caching in (False, True):
        llm = LLM(model, dtype=dtype, enable_prefix_caching=caching)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up, unrelated
        before = llm.engine.get_stats()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        after = llm.engine.get_stats()
        computed = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
        result[caching] = (computed, elapsed, [o.outputs[0].token_ids for o in outs])
        print(f"prefix caching {'on ' if caching else 'off'}: {computed:6d} prompt tokens computed, "
              f"{elapsed:6.1f} s")
    (off_tok, off_s, off_out), (on_tok, on_s, on_out) = result[False], result[True]
    print(f"prefix caching: {100 * (1 - on_tok / off_tok):.1f}% fewer prompt tokens computed, "
          f"{off_s / on_s:.2f}x faster end to end, outputs identical: {on_out == off_out}")
