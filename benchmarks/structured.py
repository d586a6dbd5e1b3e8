"""structured: structured outputs (chapters/18-structured-outputs.md): the throughput
workload with every request constrained by a JSON schema vs unconstrained (same tokens),
best of two each, plus the bitmask's fill and apply cost per step (target: within 15%)."""
from __future__ import annotations

import time

import torch

from .common import run_nanopaged, workload


def bench_structured(model, args) -> None:
    """The throughput workload with every request constrained by a JSON schema vs
    unconstrained, alternating runs, best of two each. The schema (an array of at least
    200 integers) cannot close within any request's max_tokens, so both runs produce
    exactly the same number of tokens, and the difference is the constraint's cost:
    filling each constrained row's bitmask every step (llguidance, in the core) and
    applying it to the logits (the runner). Both are printed per step."""
    from nanopaged import LLM, SamplingParams, StructuredOutputsParams
    from nanopaged.worker.sampler import apply_grammar_bitmask
    llm = LLM(model, dtype=args.dtype, attention_backend=args.attention_backend,
              enable_prefix_caching=False)                     # reruns of one workload: no cache hits
    prompts, out_lens = workload(args.num_requests, llm.engine.model_config.vocab_size, max_output=args.max_output)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200}
    constraint = StructuredOutputsParams(json=schema)
    manager = llm.engine.engine_core.structured_output_manager
    run_nanopaged(llm, prompts[:4], [4] * 4)                               # warm-up
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    rates = {"free": 0.0, "json": 0.0}
    for name in ("free", "json", "free", "json"):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                 structured_outputs=constraint if name == "json" else None) for n in out_lens]
        steps, mask_s, rows = llm.engine.num_steps, manager.mask_seconds, manager.num_mask_rows
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == sum(out_lens)
        if name == "json":
            assert all(o.outputs[0].text.lstrip().startswith("[") for o in outs)
        steps = llm.engine.num_steps - steps
        rates[name] = max(rates[name], tokens / secs)
        extra = ""
        if name == "json":
            rows, mask_s = manager.num_mask_rows - rows, manager.mask_seconds - mask_s
            extra = (f", bitmask fill {1000 * mask_s / steps:.2f} ms/step ({1e6 * mask_s / rows:.0f} us/row, "
                     f"{rows / steps:.0f} rows/step)")
        print(f"structured {name:<4} {tokens / secs:8.1f} tok/s ({secs:.1f} s, {steps} steps){extra}")
    vocab = llm.engine.model_config.vocab_size
    logits, mask = torch.randn(args.num_requests, vocab), torch.full((args.num_requests, (vocab + 31) // 32), -1,
                                                                   dtype=torch.int32)
    t = time.perf_counter()
    for _ in range(20):
        apply_grammar_bitmask(logits, list(range(args.num_requests)), mask)
    print(f"bitmask apply: {1000 * (time.perf_counter() - t) / 20:.2f} ms for {args.num_requests} rows x {vocab} tokens")
    print(f"json schema / unconstrained (best of 2 each): {rates['json'] / rates['free']:.3f} "
          f"({100 * (1 - rates['json'] / rates['free']):.1f}% slower; target within 15%)")
