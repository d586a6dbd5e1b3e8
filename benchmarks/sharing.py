"""sharing: the paper's §6.3 memory saving: peak KV blocks in use with block sharing vs
the blocks the same sequences would hold without it, for parallel sampling (n=4) and
beam search (width 4)."""
from __future__ import annotations

import random


def bench_sharing_memory(model, dtype) -> None:
    """Peak blocks in use with sharing vs the sum of every sequence's own block table."""
    from nanopaged import LLM, BeamSearchParams, SamplingParams
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))] for _ in range(16)]
    cases = [("parallel sampling n=4", prompts,
              SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=64, ignore_eos=True)),
             ("beam search width=4", prompts[:8], BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True))]
    for name, ps, params in cases:
        llm = LLM(model, dtype=dtype, enable_prefix_caching=False)   # count only fork sharing
        eng = llm.engine
        for i, p in enumerate(ps):
            eng.add_request(str(i), p, params)
        peak_used = peak_unshared = 0
        while eng.has_unfinished_requests():
            eng.step()
            used = eng.block_manager.num_gpu_blocks - eng.block_manager.get_num_free_gpu_blocks()
            unshared = sum(len(s.block_table) for g in eng.scheduler.running for s in g.seqs)
            peak_used, peak_unshared = max(peak_used, used), max(peak_unshared, unshared)
        print(f"{name}: peak {peak_used} blocks with sharing vs {peak_unshared} without: "
              f"{100 * (1 - peak_used / peak_unshared):.1f}% of KV memory saved "
              f"({eng.get_stats()['num_copy_on_write']} copy-on-write copies)")
