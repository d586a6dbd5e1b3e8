"""nanopaged's benchmarks, each measured side by side with its baseline in one run.

    python bench.py [--dtype float32|bfloat16] [--num-requests 64] [--profile]
                    [--attention-backend auto|torch|cpu|cuda]
                    [--sections throughput,chat,sampling,structured,overlap,prefix,sharing,pressure,
                                memory,kernels]
                    [--kernels] [--sections serve --request-rates 0.5,2,inf --serve-requests 32]
                    [--sections tp] [--sections vllm --vllm-python PATH] [--max-output 128]

throughput: nanopaged vs HF transformers `generate` (below).
prefix:     one 512-token system prompt shared by 32 short questions, prefix caching on
            vs off: prompt tokens computed and end-to-end time.
sharing:    the paper's §6.3 memory saving: peak KV blocks in use with block sharing vs
            the blocks the same sequences would hold without it, for parallel sampling
            (n=4) and beam search (width 4).
pressure:   a KV pool far too small for the batch: throughput with preemption by swap,
            by recompute, and auto (the cheaper by the costs measured at start).
memory:     the paper's Fig. 2 under one fixed KV budget: the share of reserved KV slots
            that hold live tokens (averaged over steps) and the peak number of concurrent
            requests, paged vs a contiguous baseline that reserves max_model_len slots
            per request up front (the same engine, another BlockManager).
sampling:   the cost of full sampling: the throughput workload greedy vs with
            temperature 0.8, top_p 0.9, min_p 0.05, repetition/presence/frequency
            penalties and logprobs=5 on every request (target: within 10%).
serve:      (not in the default list: minutes) nanopaged's OpenAI server vs `transformers
            serve --continuous-batching`, streaming clients with Poisson arrivals at
            --request-rates: throughput, TTFT and inter-token latency p50/p99, and
            async scheduling off vs on (bench_serve.py).
tp:         (not in the default list: a few minutes) tensor parallelism
            (chapters/17-tensor-parallelism.md): tp=1 vs tp=2 on a random Llama with even
            heads and tp=1 vs tp=3 on the default model: tokens/s, the share of the
            generate spent in collectives and in delivering the control message, and
            our pyzmq push of it vs a broadcast over the process group (bench_tp.py;
            fp32 and its own two models whatever --model and --dtype say).
structured: structured outputs (chapters/18-structured-outputs.md): the throughput
            workload with every request constrained by a JSON schema vs unconstrained
            (same tokens), best of two each, plus the bitmask's fill and apply cost per
            step (target: within 15%).
overlap:    async scheduling (chapters/16-async-scheduling.md): the throughput workload
            with async_scheduling off vs on (runs off, on, on, off), best of two each: time per
            engine step (ms) and tokens/s, and the ratio on / off.
vllm:       (not in the default list: needs vLLM's own venv) nanopaged vs vLLM's CPU
            backend on the throughput workload and batch-1 decode, vLLM in a child
            process of its own interpreter (bench_vllm.py says how to make its venv).
kernels:    (also --kernels) the compiled paged-attention kernel vs the PyTorch
            reference: decode attention alone (64 sequences x 1024 tokens of context,
            fp32 and bf16, the default model's heads), then the throughput workload end
            to end with each backend. On a GPU: KV bytes read per second at 256 x 2048,
            bf16, as a share of the H200's ~4.8 TB/s, and time vs SDPA on contiguous K/V.

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

import argparse
import random
import time

import torch


def workload(n: int, vocab: int, seed: int = 0, max_output: int = 128):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    outputs = [rng.randint(32, max_output) for _ in range(n)]
    return prompts, outputs


def run_nanopaged(llm, prompts, out_lens) -> tuple[float, int]:
    from nanopaged import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens)
    return elapsed, tokens


def run_transformers(model, prompts, out_lens, batch_size=16, pad_id=0) -> tuple[float, int]:
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], out_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t, sum(out_lens)


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


def bench_chat_latency(model, dtype: str, prompt_tokens: int = 64, new_tokens: int = 64) -> None:
    """Time per output token at batch 1, what a chat user feels: the chat REPL's own loop
    (chat.stream_answer, one engine step per token) vs transformers `generate` on one
    sequence. Both: (time for 1 + new_tokens tokens - time for 1 token) / new_tokens, so
    the prompt's prefill drops out; greedy, ignore eos; best of 3 each, alternating."""
    import io
    from transformers import AutoModelForCausalLM
    from nanopaged import LLM, SamplingParams
    from nanopaged.entrypoints.chat import stream_answer
    llm = LLM(model, dtype=dtype)
    engine = llm.engine
    prompt = workload(1, engine.model_config.vocab_size, seed=7)[0][0][:prompt_tokens]
    hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=engine.config.torch_dtype).eval()
    ids = torch.tensor([prompt])

    def ours(n):
        t = time.perf_counter()
        stream_answer(engine, f"chat-{time.perf_counter_ns()}", prompt,
                      SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), out=io.StringIO())
        return time.perf_counter() - t

    def theirs(n):
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    best = {"nanopaged": float("inf"), "transformers": float("inf")}
    for fn in (ours, theirs):
        fn(2)                                                               # warm-up
    for _ in range(3):
        for name, fn in (("nanopaged", ours), ("transformers", theirs)):
            best[name] = min(best[name], (fn(1 + new_tokens) - fn(1)) / new_tokens)
    print(f"chat latency, batch 1, {len(prompt)}-token prompt, {new_tokens} new tokens, {engine.config.torch_dtype}: "
          f"nanopaged {1e3 * best['nanopaged']:.1f} ms/token, transformers {1e3 * best['transformers']:.1f} "
          f"ms/token: {best['transformers'] / best['nanopaged']:.2f}x faster (target 1.5x)")


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


def bench_memory_utilization(model, dtype) -> None:
    """Paged blocks vs reserving max_model_len slots per request, same KV budget."""
    from nanopaged import LLM, SamplingParams
    from nanopaged.core.block_manager import BlockManager

    class ContiguousBlockManager(BlockManager):
        """Pre-vLLM systems: a request reserves max_model_len slots when admitted."""
        reserve_tokens = 0

        def _blocks_to_take(self, seq_group, first_end):
            return -(-self.reserve_tokens // self.block_size)

        def append_slots(self, seq, end=None):
            copies = super().append_slots(seq, end)
            table = seq.block_table
            while len(table) < table.num_blocks_for(self.reserve_tokens):
                table.append_block(self._allocate_block())
            return copies

    prompts, out_lens = workload(32, 40000, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    for name in ("paged", "contiguous"):
        llm = LLM(model, dtype=dtype, num_gpu_blocks=400, max_model_len=2048,
                  enable_prefix_caching=False, preemption_mode="recompute")
        eng = llm.engine
        if name == "contiguous":
            old = eng.block_manager
            eng.block_manager = ContiguousBlockManager(old.num_gpu_blocks, old.block_size, False)
            eng.block_manager.reserve_tokens = eng.config.max_model_len
            eng.scheduler.block_manager = eng.block_manager
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


def _time(fn, repeat: int) -> float:
    """Seconds per call of fn(), after one warm-up call (synchronizing on CUDA)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - t) / repeat


def decode_batch(num_seqs, context, num_heads, num_kv_heads, head_size, block_size, dtype, device):
    """Random decode inputs with each sequence's blocks scattered over the pool."""
    from nanopaged.layers.attention import AttentionMetadata
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
    lens = [context] * num_seqs
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
                             block_tables=tables, seq_lens=torch.tensor(lens, device=device),
                             query_start_loc=torch.arange(num_seqs + 1, device=device),
                             num_decodes=num_seqs, seq_lens_list=lens,
                             query_start_loc_list=list(range(num_seqs + 1)))
    return query, key_cache, value_cache, meta


def bench_kernels(model, args) -> None:
    """Compiled decode attention vs the reference, then end to end with each backend."""
    from nanopaged.layers.backends import TorchBackend, get_attn_backend
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel, ref = get_attn_backend(device, device), TorchBackend()
    heads, kv_heads, head = 9, 3, 64                          # SmolLM2-135M
    print(f"decode attention, 64 sequences x 1024 tokens, {heads} heads / {kv_heads} KV heads x {head}, "
          f"block_size 16, {device}, torch threads {torch.get_num_threads()}:")
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, meta = decode_batch(64, 1024, heads, kv_heads, head, 16, dtype, device)
        t_ref = _time(lambda: ref.forward(q, kc, vc, meta, head ** -0.5), 5)
        t_ker = _time(lambda: kernel.forward(q, kc, vc, meta, head ** -0.5), 5)
        print(f"  {str(dtype)[6:]:<9} reference {1e3 * t_ref:8.2f} ms   {kernel.name} kernel "
              f"{1e3 * t_ker:8.2f} ms   ratio {t_ref / t_ker:5.2f}x")
    if device == "cuda":
        bench_gpu_bandwidth(kernel)
    from nanopaged import LLM
    # Alternating runs, best of two each: on a shared VM one run can be 1.5x slower than
    # the next, and the first engine of a process pays the first touch of its memory.
    rates = {"torch": 0.0, device: 0.0}
    for name in ("torch", device, "torch", device):
        llm = LLM(model, dtype=args.dtype, attention_backend=name, enable_prefix_caching=False)
        prompts, out_lens = workload(args.num_requests, llm.engine.model_config.vocab_size, max_output=args.max_output)
        run_nanopaged(llm, prompts[:4], [4] * 4)                           # warm-up
        secs, tokens = run_nanopaged(llm, prompts, out_lens)
        rates[name] = max(rates[name], tokens / secs)
        print(f"end to end, attention_backend={name!r:<8} {tokens / secs:8.1f} tok/s ({args.dtype})")
        del llm
    print(f"end-to-end ratio {device} kernel / torch reference (best of 2 each): "
          f"{rates[device] / rates['torch']:.2f}x")


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


def cpu_flags() -> str:
    """The CPU features that decide our speed, as this machine reports them."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":")[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, flags: "
            f"{' '.join(w for w in wanted if w in flags) or 'none of ' + '/'.join(wanted)}")


def bench_gpu_bandwidth(kernel, num_seqs=256, context=2048, head=128, heads=32, kv_heads=8) -> None:
    """KV bytes read per second vs the H200's HBM bandwidth; time vs SDPA on contiguous K/V."""
    import torch.nn.functional as F
    q, kc, vc, meta = decode_batch(num_seqs, context, heads, kv_heads, head, 16, torch.bfloat16, "cuda")
    t_ker = _time(lambda: kernel.forward(q, kc, vc, meta, head ** -0.5), 20)
    kv_bytes = 2 * num_seqs * context * kv_heads * head * 2
    k = kc.view(num_seqs, context, kv_heads, head).transpose(1, 2).contiguous()   # [S, kv_heads, T, D]
    v = vc.view(num_seqs, context, kv_heads, head).transpose(1, 2).contiguous()
    t_sdpa = _time(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True), 20)
    print(f"GPU decode, {num_seqs} x {context}, bf16, {heads}/{kv_heads} heads x {head}: kernel "
          f"{1e3 * t_ker:.3f} ms = {kv_bytes / t_ker / 1e12:.2f} TB/s of KV "
          f"({100 * kv_bytes / t_ker / 4.8e12:.0f}% of 4.8 TB/s); SDPA on contiguous K/V "
          f"{1e3 * t_sdpa:.3f} ms; kernel / SDPA time {t_ker / t_sdpa:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: what LLM(dtype='auto') picks on this machine (both sides use it)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=128,
                    help="the workload's outputs are U[32, this] tokens (throughput, vllm; default 128)")
    ap.add_argument("--vllm-python", default=None,
                    help="vllm: the interpreter of vLLM's venv (else $NANOPAGED_VLLM_PYTHON or ./.venv-vllm)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "cuda"])
    ap.add_argument("--sections",
                    default="throughput,chat,sampling,structured,overlap,prefix,sharing,pressure,memory,kernels",
                    help="comma-separated, from the list above; serve, tp and vllm are not in the default")
    ap.add_argument("--kernels", action="store_true", help="only the kernels section")
    ap.add_argument("--request-rates", default="0.5,2,inf", help="serve: requests per second")
    ap.add_argument("--serve-requests", type=int, default=32, help="serve: requests per rate")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="serve: threads per server")
    args = ap.parse_args()
    sections = ["kernels"] if args.kernels else args.sections.split(",")
    if args.dtype == "auto":
        from nanopaged.config import EngineConfig
        args.dtype = str(EngineConfig(model=args.model).torch_dtype).removeprefix("torch.")
    print(cpu_flags(), f"| dtype {args.dtype}")
    if "vllm" in sections:
        from bench_vllm import bench_vllm
        bench_vllm(args.model, args, workload, run_nanopaged)
    if "chat" in sections:
        bench_chat_latency(args.model, args.dtype)
    if "serve" in sections:
        from bench_serve import bench_serve
        bench_serve(args.model, args.dtype, args.serve_requests,
                    [float(r) for r in args.request_rates.split(",")], args.threads,
                    skip_transformers=args.skip_transformers)
    if "tp" in sections:
        from bench_tp import bench_tp
        bench_tp()
    if "sampling" in sections:
        bench_sampling(args.model, args)
    if "overlap" in sections:
        bench_overlap(args.model, args)
    if "structured" in sections:
        bench_structured(args.model, args)
    if "kernels" in sections:
        bench_kernels(args.model, args)
    if "prefix" in sections:
        bench_prefix_caching(args.model, args.dtype)
    if "sharing" in sections:
        bench_sharing_memory(args.model, args.dtype)
    if "pressure" in sections:
        bench_memory_pressure(args.model, args.dtype)
    if "memory" in sections:
        bench_memory_utilization(args.model, args.dtype)
    if "throughput" not in sections:
        return

    from transformers import AutoModelForCausalLM
    from nanopaged import LLM

    dtype = getattr(torch, args.dtype)
    # Prefix caching off: the runs repeat the same prompts, and a second run would find
    # every prompt cached (transformers recomputes them)
    llm = LLM(args.model, dtype=args.dtype, attention_backend=args.attention_backend, enable_prefix_caching=False)
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


if __name__ == "__main__":
    main()
