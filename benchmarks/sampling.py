"""sampling: the cost of full sampling: the throughput workload greedy vs with
temperature 0.8, top_p 0.9, min_p 0.05, repetition/presence/frequency penalties and
logprobs=5 on every request (target: within 10%)."""
from __future__ import annotations

import time

from .common import run_nanopaged, workload


def bench_sampling(model, args) -> None:
    """The throughput workload greedy vs with every sampling feature on, alternating
    runs, best of two each (a shared VM varies from run to run)."""
    from nanopaged import LLM, SamplingParams
    llm = LLM(model, dtype=args.dtype, attention_backend=args.attention_backend,
              enable_prefix_caching=False)                     # reruns of one workload: no cache hits
    prompts, out_lens = workload(args.num_requests, llm.engine.model_config.vocab_size, max_output=args.max_output)
    full = dict(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2,
                frequency_penalty=0.2, logprobs=5, seed=0)
    run_nanopaged(llm, prompts[:4], [4] * 4)                               # warm-up
    rates = {"greedy": 0.0, "full": 0.0}
    for name in ("greedy", "full", "greedy", "full"):
        extra = full if name == "full" else {}
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **({"temperature": 0} | extra)) for n in out_lens]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == sum(out_lens) and (name == "greedy" or all(o.outputs[0].logprobs for o in outs))
        rates[name] = max(rates[name], tokens / secs)
        print(f"sampling {name:<7} {tokens / secs:8.1f} tok/s ({secs:.1f} s)")
    print(f"full sampling / greedy (best of 2 each): {rates['full'] / rates['greedy']:.3f} "
          f"({100 * (1 - rates['full'] / rates['greedy']):.1f}% slower; target within 10%)")
