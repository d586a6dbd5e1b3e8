"""overlap: async scheduling (chapters/16-async-scheduling.md): the throughput workload
with async_scheduling off vs on (runs off, on, on, off), best of two each: time per
engine step (ms) and tokens/s, and the ratio on / off."""
from __future__ import annotations

from .common import run_nanopaged, workload


def bench_overlap(model, args) -> None:
    """The throughput workload with async scheduling off vs on (the Python work of
    scheduling and taking in a step overlaps the next forward), runs in the order off,
    on, on, off, best of two each (a shared VM varies from run to run)."""
    from nanopaged import LLM
    llms = {name: LLM(model, dtype=args.dtype, attention_backend=args.attention_backend,
                      async_scheduling=name == "on", enable_prefix_caching=False)   # reruns: no cache hits
            for name in ("off", "on")}
    prompts, out_lens = workload(args.num_requests, llms["off"].engine.model_config.vocab_size)
    best = {"off": (0.0, 0.0), "on": (0.0, 0.0)}              # (tok/s, ms per step)
    for name in ("off", "on"):
        run_nanopaged(llms[name], prompts[:4], [4] * 4)                    # warm-up
    for name in ("off", "on", "on", "off"):           # ABBA: a drifting load hits both alike
        engine = llms[name].engine
        steps = engine.num_steps
        secs, tokens = run_nanopaged(llms[name], prompts, out_lens)
        ms = 1000 * secs / (engine.num_steps - steps)
        print(f"overlap {name:<3} {tokens / secs:8.1f} tok/s, {ms:6.1f} ms/step "
              f"({engine.num_steps - steps} steps, {secs:.1f} s)")
        if tokens / secs > best[name][0]:
            best[name] = (tokens / secs, ms)
    print(f"async scheduling on / off (best of 2 each): {best['on'][0] / best['off'][0]:.3f}x tok/s, "
          f"step {best['off'][1]:.1f} -> {best['on'][1]:.1f} ms")
