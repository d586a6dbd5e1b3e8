"""throughput: nanopaged vs HF transformers `generate`, and the matmul roofline.

The workload (fixed seed): `--num-requests` requests with random token-id prompts of
U[32, 256] tokens and outputs of U[32, --max-output (128)] tokens, ignore_eos, greedy. nanopaged gets all
requests at once and batches them continuously; transformers runs static batches of 16,
left-padded, each generating until its longest request is done. Only the requested
output tokens count. Same model (the default SmolLM2-135M-Instruct unless --model), same
dtype, same torch threads, same process. Prints tokens/s of each and the ratio.
--profile adds where nanopaged's time goes (torch profiler, by operator, and by layer of
the step: schedule / prepare inputs / forward / sample / update).
"""
from __future__ import annotations

import time

import torch

from .common import run_nanopaged, run_transformers, workload


class StepRecorder:
    """Records each forward's token count and each LM-head call's row count of an engine
    (tp=1: the model runner is in this process), for the roofline below."""

    def __init__(self, llm) -> None:
        self.model = llm.engine.model_runner.model
        self.forward_tokens: list[int] = []
        self.head_rows: list[int] = []
        forward, logits = self.model.forward, self.model.compute_logits

        def record_forward(input_ids, *args, **kwargs):
            self.forward_tokens.append(input_ids.shape[0])
            return forward(input_ids, *args, **kwargs)

        def record_logits(hidden):
            self.head_rows.append(hidden.shape[0])
            return logits(hidden)
        self.model.forward, self.model.compute_logits = record_forward, record_logits

    def clear(self) -> None:
        self.forward_tokens.clear()
        self.head_rows.clear()


def matmul_roofline(model, forward_tokens: list[int], head_rows: list[int], backend) -> dict:
    """The workload's matmuls alone, timed on this machine in this run.

    For every distinct step size M seen, times the model's own weights (every layer's
    qkv, o, gate_up and down projections, in layer order, so they stream from memory as
    in a real step, and the LM head) on an [M, K] input, once each after a warm-up,
    with the library's `F.linear` (MKL in fp32, oneDNN in bf16: AMX where the CPU has
    it) and with the engine's backend's `linear` (our batch-invariant kernel, with its
    packed AMX weights where it uses them), keeping the faster. The roofline is the sum
    over steps of those times: what the run would take if it did nothing but its
    matmuls at the best speed this CPU does them at each step's size.
    Returns the FLOPs, the roofline seconds, and the best rate of any size (GFLOP/s).
    """
    import torch.nn.functional as F
    layer_weights = [w for layer in model.layers for w in (
        layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
        layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    packed = {id(w): backend.pack_weight(w) for w in layer_weights + [head.weight]}
    body_flops_per_token = 2 * sum(w.numel() for w in layer_weights)
    head_flops_per_row = 2 * head.weight.numel()

    def ours(x, w):
        return backend.linear(x, w, packed=packed[id(w)])

    def timed(m, weights):
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights}
        best = float("inf")
        for linear in (F.linear, ours):
            with torch.inference_mode():
                for w in weights[:4]:
                    linear(xs[w.shape[1]], w)                    # warm-up
                t = time.perf_counter()
                for w in weights:
                    linear(xs[w.shape[1]], w)
                best = min(best, time.perf_counter() - t)
        return best

    body = {m: timed(m, layer_weights) for m in sorted(set(forward_tokens))}
    heads = {m: timed(m, [head.weight]) for m in sorted(set(head_rows))}
    flops = sum(forward_tokens) * body_flops_per_token + sum(head_rows) * head_flops_per_row
    seconds = sum(body[m] for m in forward_tokens) + sum(heads[m] for m in head_rows)
    best = max([m * body_flops_per_token / t for m, t in body.items()] +
               [m * head_flops_per_row / t for m, t in heads.items()]) / 1e9
    return dict(flops=flops, seconds=seconds, best_gflops=best)


def profile_nanopaged(llm, prompts, out_lens) -> None:
    """Where a nanopaged run spends its time: by engine stage, then by torch operator."""
    from nanopaged import SamplingParams
    eng = llm.engine
    stages = dict(schedule=0.0, prepare_inputs=0.0, forward=0.0, sample=0.0, update=0.0, output=0.0)
    runner = eng.model_runner

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            stages[name] += time.perf_counter() - t
            return r
        return wrapper

    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    runner.prepare_inputs = timed("prepare_inputs", runner.prepare_inputs)
    runner.model.forward = timed("forward", runner.model.forward)
    runner.sampler.__class__.__call__ = timed("sample", runner.sampler.__class__.__call__)
    eng.scheduler.update_from_output = timed("update", eng.scheduler.update_from_output)
    eng.output_processor.process_outputs = timed("output", eng.output_processor.process_outputs)
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t = time.perf_counter()
    with torch.profiler.profile() as prof:
        while eng.has_unfinished_requests():
            eng.step()
    total = time.perf_counter() - t
    print(f"\nnanopaged time by stage ({total:.1f} s, {eng.num_steps} steps in all):")
    for name, s in stages.items():
        print(f"  {name:<15} {s:7.2f} s  {100 * s / total:5.1f}%")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def bench_throughput(model, args) -> None:
    """nanopaged vs transformers on the workload, alternating, best of two each; then
    the roofline of the best nanopaged run, and with --profile where its time goes."""
    from transformers import AutoModelForCausalLM
    from nanopaged import LLM

    dtype = getattr(torch, args.dtype)
    # Prefix caching off: the runs repeat the same prompts, and a second run would find
    # every prompt cached (transformers recomputes them)
    llm = LLM(model, dtype=args.dtype, attention_backend=args.attention_backend, enable_prefix_caching=False)
    folder = llm.engine.model_path
    prompts, out_lens = workload(args.num_requests, llm.engine.model_config.vocab_size, max_output=args.max_output)
    print(f"model {folder.name}, dtype {args.dtype}, attention {llm.engine.attn_backend.name}, torch threads {torch.get_num_threads()}, "
          f"{len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, "
          f"output tokens {sum(out_lens)}")

    recorder = StepRecorder(llm)
    run_nanopaged(llm, prompts[:4], [4] * 4)                               # warm-up
    hf = None
    if not args.skip_transformers:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        run_transformers(hf, prompts[:2], [4, 4])                          # warm-up
    # Alternating runs, best of two each (ABAB): this shared VM's speed drifts by up to
    # 1.4x between minutes, and a drift then hits both sides alike.
    best = {"nanopaged": float("inf"), "transformers": float("inf")}
    for name in ("nanopaged", "transformers") * 2:
        if name == "transformers" and hf is None:
            continue
        if name == "nanopaged":
            recorder.clear()
            secs, tokens = run_nanopaged(llm, prompts, out_lens)
            if secs < best[name]:
                steps = (list(recorder.forward_tokens), list(recorder.head_rows))
            note = f"{llm.engine.get_stats()['num_preemptions']} preemptions so far"
        else:
            secs, tokens = run_transformers(hf, prompts, out_lens)
            note = "static batches of 16"
        best[name] = min(best[name], secs)
        print(f"{name:<13} {tokens / secs:8.1f} tok/s  ({tokens} tokens in {secs:.1f} s, {note})")
    ours_s, ours = best["nanopaged"], sum(out_lens) / best["nanopaged"]
    if hf is not None:
        print(f"ratio nanopaged / transformers (best of 2 each): {best['transformers'] / ours_s:.2f}x "
              f"({ours:.1f} vs {sum(out_lens) / best['transformers']:.1f} tok/s; target 2x)")
    roof = matmul_roofline(recorder.model, *steps, backend=llm.engine.attn_backend)
    print(f"roofline: the run's matmuls ({roof['flops'] / 1e12:.2f} TFLOP over {len(steps[0])} "
          f"steps) take {roof['seconds']:.1f} s alone at this CPU's measured rate for each step's size "
          f"({roof['flops'] / roof['seconds'] / 1e9:.0f} GFLOP/s on average; best size "
          f"{roof['best_gflops']:.0f}): nanopaged's {ours_s:.1f} s is {100 * roof['seconds'] / ours_s:.0f}% "
          f"of the roofline (target: 50% fp32 on AVX2, 40% bf16); at the best size's rate throughout it would be "
          f"{100 * roof['flops'] / roof['best_gflops'] / 1e9 / ours_s:.0f}%")
    if args.profile:
        profile_nanopaged(llm, prompts, out_lens)
