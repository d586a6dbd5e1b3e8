"""memory: the paper's Fig. 2 under one fixed KV budget: the share of reserved KV slots
that hold live tokens (averaged over steps) and the peak number of concurrent requests,
paged vs a contiguous baseline that reserves max_model_len slots per request up front
(the same engine, another BlockManager)."""
from __future__ import annotations

from .common import workload


def bench_memory_utilization(model, dtype) -> None:
    """Paged blocks vs reserving max_model_len slots per request, same KV budget."""
    from nanopaged import LLM, SamplingParams
    from nanopaged.core.block_manager import BlockManager

    class ContiguousBlockManager(BlockManager):
        """Pre-vLLM systems: a request reserves max_model_len slots when admitted."""
        reserve_tokens = 0

        def _blocks_to_take(self, seq_group, computed, first_end):
            return -(-self.reserve_tokens // self.block_size)

        def _append_blocks(self, seq, end):
            super()._append_blocks(seq, max(end, self.reserve_tokens))

    prompts, out_lens = workload(32, 40000, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    for name in ("paged", "contiguous"):
        llm = LLM(model, dtype=dtype, num_gpu_blocks=400, max_model_len=2048,
                  enable_prefix_caching=False, preemption_mode="recompute")
        eng = llm.engine
        if name == "contiguous":
            old, core = eng.block_manager, eng.engine_core      # the engine's are read-only views
            core.block_manager = ContiguousBlockManager(old.num_gpu_blocks, old.block_size, False,
                                                        observers=old.observers)
            core.block_manager.reserve_tokens = eng.config.max_model_len
            core.scheduler.block_manager = core.block_manager
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(str(i), p, sp)
        fractions, peak = [], 0
        while eng.has_unfinished_requests():
            eng.step()
            bm = eng.block_manager
            reserved = (bm.num_gpu_blocks - bm.get_num_free_gpu_blocks()) * bm.block_size
            live = sum(s.num_computed_tokens for g in eng.scheduler.running for s in g.seqs)
            if reserved:
                fractions.append(live / reserved)
            peak = max(peak, len(eng.scheduler.running))
        print(f"KV memory, {name:<10}: {100 * sum(fractions) / len(fractions):5.1f}% of reserved slots "
              f"hold live tokens, peak {peak} concurrent requests ({eng.num_steps} steps)")
