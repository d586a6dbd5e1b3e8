"""The pipeline-parallel benchmark (`python bench.py --sections pp`;
chapters/20-pipeline-parallelism.md), in one run on this machine, SmolLM2-135M in fp32:

    throughput   pp=1, 2, 3 on the same workload and the same cores: tokens/s, and
                 whether each gives pp=1's greedy tokens
    batch 1      one request, ms per output token (its prefill included)
    bubbles      per stage, the share of the timed generate's wall time it was not
                 computing: waiting for the previous stage's hidden states, for its next
                 control message, or sending (1 - compute / wall, compute = time in
                 execute_model minus time blocked in recv and send)
    memory       KV blocks and tokens a rank holds with the same kv_cache_memory_bytes
    hops         bytes and microseconds per stage boundary (a send of one step's
                 hidden states and residual)
    two nodes    pp=2 with its stages in two "nodes" on this machine (--nnodes 2, node 1
                 a headless `python -m nanopaged.serve` process, a thread a rank), same
                 numbers
    codec        the messages of the pp=1 run (each step's call with its SchedulerOutput,
                 and the answer with its ModelRunnerOutput), recorded, then encoded and
                 decoded with pickle (one host's ipc sockets) and with utils/codec.py
                 (what crosses hosts): bytes and microseconds per message, in the results
                 file's form

Threads: pp=1 runs torch's default (one per core); a pp > 1 rank gets cores // pp, at
least 1 (the executor's rule), so at pp=3 on 2 cores 3 ranks share 2 cores.
The workload (fixed seed): 16 requests with random token-id prompts of U[32, 64] tokens,
32 output tokens each, greedy, ignore_eos. Each engine gets a warm-up generate first and
is shut down before the next starts.
"""
from __future__ import annotations

import os
import random
import secrets
import socket
import subprocess
import sys
import time

import torch

from .tp import machine

NUM_REQUESTS, MAX_TOKENS, BATCH1_TOKENS = 16, 32, 48
KV_BYTES = 64 << 20        # the same KV memory per rank for every pp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _diff(after: list[dict], before: list[dict]) -> list[dict]:
    return [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before)]


def record_messages(model: str, prompts: list[list[int]]) -> list:
    """The (call, answer) messages of one generate at pp=1, as the executor sends them."""
    from nanopaged import LLM, SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=KV_BYTES, num_cpu_blocks=0, preemption_mode="recompute")
    executor, messages = llm.engine.engine_core.executor, []
    step = executor.execute_model

    def recorded(scheduler_output, non_blocking=False):
        out = step(scheduler_output, non_blocking)
        result = out.result() if hasattr(out, "result") else out
        messages.append((len(messages), "execute_model", (scheduler_output,), time.monotonic()))
        messages.append((len(messages), 0, True, result))
        return out
    executor.execute_model = recorded
    try:
        llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return messages


def time_codecs(messages: list, repeats: int = 20) -> None:
    """Encode and decode every recorded message with pickle and with the codec; one table
    in the results file's form."""
    import pickle

    from nanopaged.utils import codec

    ways = {"pickle (one host, ipc)": (lambda m: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
            "codec (across hosts)": (codec.encode, codec.decode)}
    rows = {}
    for name, (dumps, loads) in ways.items():
        assert all(loads(dumps(m)) == m for m in messages)       # the same messages back
        data = [dumps(m) for m in messages]
        enc = dec = float("inf")
        for _ in range(repeats):                                             # best of repeats
            t0 = time.perf_counter()
            data = [dumps(m) for m in messages]
            t1 = time.perf_counter()
            for d in data:
                loads(d)
            t2 = time.perf_counter()
            enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
        rows[name] = (sum(map(len, data)) / len(data), 1e6 * enc / len(data), 1e6 * dec / len(data))
    print(f"  codec: {len(messages)} recorded messages (steps of the pp=1 run: calls and answers), best of {repeats}:")
    print("  | encoding | bytes per message | encode (us) | decode (us) | encode + decode (us) |")
    print("  |---|---:|---:|---:|---:|")
    for name, (size, enc, dec) in rows.items():
        print(f"  | {name} | {size:.0f} | {enc:.1f} | {dec:.1f} | {enc + dec:.1f} |")
    (_, pe, pd), (_, ce, cd) = rows.values()
    print(f"  the codec costs {(ce + cd) / (pe + pd):.1f}x pickle's time per message")


def run_pp(model: str, pp: int, prompts: list[list[int]], **node_args) -> dict:
    """One engine at pp stages: the timed generate, batch-1 decode and per-rank stats."""
    from nanopaged import LLM, SamplingParams

    llm = LLM(model, dtype="float32", pipeline_parallel_size=pp, kv_cache_memory_bytes=KV_BYTES,
              num_cpu_blocks=0, preemption_mode="recompute", **node_args)
    try:
        executor = llm.engine.engine_core.executor
        stats = getattr(executor, "get_comm_stats", lambda: [])
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)        # warm-up
        before = stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - start
        ranks = _diff(stats(), before)
        start = time.perf_counter()
        one = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=BATCH1_TOKENS, ignore_eos=True),
                           use_tqdm=False)
        batch1 = (time.perf_counter() - start) / len(one[0].outputs[0].token_ids)
        outputs = [o.outputs[0].token_ids for o in outs]
        return dict(wall=wall, tokens=sum(map(len, outputs)), outputs=outputs, ranks=ranks, batch1=batch1,
                    blocks=llm.engine.engine_core.block_manager.num_gpu_blocks,
                    block_size=llm.engine.engine_core.config.cache_config.block_size)
    finally:
        llm.shutdown()


def report(label: str, r: dict, base: dict) -> None:
    rate = r["tokens"] / r["wall"]
    print(f"  {label}: {rate:6.1f} tok/s ({r['tokens']} tokens in {r['wall']:.1f} s), "
          f"{rate / (base['tokens'] / base['wall']):.2f}x pp=1; batch 1: {1e3 * r['batch1']:.1f} ms/token; "
          f"same greedy tokens as pp=1: {r['outputs'] == base['outputs']}; "
          f"KV: {r['blocks']} blocks = {r['blocks'] * r['block_size']} tokens a rank")
    ranks = r["ranks"]
    if len(ranks) < 2 or "pp_num_hops" not in ranks[0]:      # pp=1: one process, no stages
        return
    wall = r["wall"]
    idle = [1 - max(0.0, s.get("execute_seconds", 0.0) - s["pp_recv_seconds"] - s["pp_send_seconds"]) / wall
            for s in ranks]
    waiting = " / ".join(f"{100 * s['pp_recv_seconds'] / wall:.0f}%" for s in ranks)
    print(f"    bubble (idle share of the wall time) per stage: {' / '.join(f'{100 * x:.0f}%' for x in idle)}; "
          f"waiting for the previous stage: {waiting}")
    hops = [s for s in ranks if s["pp_num_hops"]]
    if hops:
        n = sum(s["pp_num_hops"] for s in hops)
        print(f"    hops: {int(n)} sends, {sum(s['pp_bytes_sent'] for s in hops) / n / 1024:.1f} KiB and "
              f"{1e6 * sum(s['pp_send_seconds'] for s in hops) / n:.0f} us a send on average")


def start_headless_node(model: str, pp: int, port: int) -> subprocess.Popen:
    """Node 1 of 2: a headless server process holding the second stage."""
    env = dict(os.environ, OMP_NUM_THREADS="1")         # NANOPAGED_CLUSTER_SECRET: bench_pp's
    return subprocess.Popen([sys.executable, "-m", "nanopaged.serve", "--model", model, "--dtype", "float32",
                             "--pipeline-parallel-size", str(pp), "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "--headless",
                             "--kv-cache-memory-bytes", str(KV_BYTES), "--num-cpu-blocks", "0",
                             "--preemption-mode", "recompute"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def bench_pp() -> None:
    """pp=1, 2, 3 on the default model, then pp=2 over two local "nodes"."""
    from nanopaged.model.model_loader import ensure_default_model

    model = str(ensure_default_model(progress=False))
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randint(32, 64))] for _ in range(NUM_REQUESTS)]
    cores = len(os.sched_getaffinity(0))
    print(f"pp: {machine()}; torch threads: pp=1 {torch.get_num_threads()}, a rank at pp=2 "
          f"{os.environ.get('OMP_NUM_THREADS') or max(1, cores // 2)}, at pp=3 "
          f"{os.environ.get('OMP_NUM_THREADS') or max(1, cores // 3)}; gloo over loopback; fp32; "
          f"{NUM_REQUESTS} requests, prompts U[32, 64] ({sum(map(len, prompts))} tokens), {MAX_TOKENS} output "
          f"tokens each, greedy, ignore_eos; batch 1: {BATCH1_TOKENS} tokens; KV memory {KV_BYTES >> 20} MiB a rank")
    print("SmolLM2-135M-Instruct (30 layers; pp=2: 15 + 15, pp=3: 10 + 10 + 10):")
    base = run_pp(model, 1, prompts)
    report("pp=1", base, base)
    for pp in (2, 3):
        report(f"pp={pp}", run_pp(model, pp, prompts), base)
    time_codecs(record_messages(model, prompts))
    # one thread a rank, as at pp=2 on one node (each node would otherwise take every core)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("NANOPAGED_CLUSTER_SECRET", secrets.token_hex(32))     # both nodes hold it
    port = _free_port()
    node1 = start_headless_node(model, 2, port)
    try:
        report("pp=2 over two nodes", run_pp(model, 2, prompts, nnodes=2, node_rank=0,
                                              master_addr="127.0.0.1", master_port=port), base)
    finally:
        if node1.poll() is None:
            node1.terminate()
        try:
            node1.wait(30)
        except subprocess.TimeoutExpired:
            node1.kill()
            node1.wait()
