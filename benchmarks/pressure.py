"""pressure: a KV pool far too small for the batch: throughput with preemption by swap,
by recompute, and auto (the cheaper by the costs measured at start)."""
from __future__ import annotations

import time

from .common import run_nanopaged, workload


def bench_memory_pressure(model, dtype) -> None:
    """Throughput when the pool holds only a fraction of the batch, per preemption mode."""
    from nanopaged import LLM, SamplingParams
    prompts, out_lens = workload(32, 40000, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    results, outputs = {}, {}
    for mode in ("swap", "recompute", "auto"):
        llm = LLM(model, dtype=dtype, num_gpu_blocks=96, preemption_mode=mode, enable_prefix_caching=False)
        run_nanopaged(llm, prompts[:4], [4] * 4)                          # warm-up
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = sum(out_lens) / (time.perf_counter() - t)
        outputs[mode] = [o.outputs[0].token_ids for o in outs]
        s = llm.engine.get_stats()
        print(f"memory pressure, {mode:<9}: {results[mode]:6.1f} tok/s "
              f"({s['num_preemptions_swap']} swaps, {s['num_preemptions_recompute']} recomputes)")
    best = max(results["swap"], results["recompute"])
    print(f"memory pressure: auto at {100 * results['auto'] / best:.1f}% of the better mode; "
          f"outputs identical across modes: {outputs['swap'] == outputs['recompute'] == outputs['auto']}")
