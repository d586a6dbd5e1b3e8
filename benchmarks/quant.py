"""bench.py's `quant` section: GGUF weights run as shipped, side by side in one
run with llama.cpp itself on the same file with the same threads.

    python bench.py --sections quant [--llamacpp-python PATH] [--llama-server PATH] [--num-requests 32]

Seven engines, one after another in this run:
- nanopaged, quantization="gguf": the default model's Q4_1 file as shipped;
- nanopaged on the fp32 folder converted from that file (the same bits, unpacked);
- nanopaged on that folder in bfloat16 (what dtype="auto" would run on a CPU with bf16
  units if exactness did not come first: not exact);
- nanopaged LLM() with dtype "auto": the default's own choice on this CPU class
  (engine/arg_utils.py, DEFAULT_MODEL_WEIGHTS), printed in one table with the others
  (print_default_choice, a table in benchmarks/RESULTS.md's form) and the fastest exact path;
- nanopaged on the file with activation_quantization="int8": x rounded to int8 blocks in
  the matmuls, llama.cpp's own arithmetic (not exact; its accuracy against the exact mode
  is the last line: benchmarks/quant_accuracy.py);
- llama.cpp (llama-cpp-python 0.3.36) on the same file, in a child process of its own
  venv (made once: `python3 -m venv .venv-llamacpp && .venv-llamacpp/bin/pip install
  llama-cpp-python==0.3.36`; found by --llamacpp-python, $NANOPAGED_LLAMACPP_PYTHON or
  ./.venv-llamacpp; without one its rows are skipped and the howto printed);
- llama.cpp's own server (llama-server) with one parallel slot per request, continuous
  batching, on the same file: the throughput workload only (benchmarks/llama_server.py,
  which says how to build it; found by --llama-server, $NANOPAGED_LLAMA_SERVER or
  ./.llama-server/bin/llama-server).

Measured:
- batch 1: one 32-token prompt, (time for 65 greedy tokens - time for 1) / 64, best of
  three: ms per output token, and the ratio llama.cpp / nanopaged (>= 1.0: we are at
  least as fast);
- throughput: bench.py's workload (--num-requests requests, prompts U[32, 256] token ids,
  outputs U[32, --max-output], greedy, ignore_eos): nanopaged gets them all at once and
  batches them; llama.cpp's Python API serves one sequence at a time, so it runs them one
  after another; llama-server gets them all at once, as we do. Tokens/s and the ratios;
- weights: bytes resident in the model (the packed blocks plus what is kept in fp32:
  norms; computed from the loaded tensors) against the file's size;
- bytes per decoded token: the weights a batch-1 step reads (every projection and the LM
  head once; the embedding row and norms are noise) plus the KV it reads at the mean
  context, against this machine's read bandwidth (a large torch reduction, best of five,
  the same threads): the DRAM roofline's ms/token, and the share of it each run reaches;
- the throughput workload's compute roofline: its matmul and attention FLOPs (every
  prompt and output token through the projections, each sampled token through the LM
  head, causal attention over its context) over the best float32 rate this machine's
  cores reach (torch's MKL sgemm on [2048 x 2048] x [2048 x 2048], best of five, the
  same threads): the most tokens/s any float32-exact engine could serve it at here,
  and what that is as a multiple of llama.cpp's serial rate.
The greedy tokens of llama.cpp are compared too: it rounds activations to 8 bits in its
matmuls (Q8_1), our exact mode does not, so they may part after some tokens; reported,
not required.
"""
from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .common import cpu_flags, find_peer, run_nanopaged, workload
from .llama_server import LLAMA_SERVER_HOWTO, find_llama_server, run_llama_server
from .quant_accuracy import ACCURACY_PROMPTS, ACCURACY_TOKENS, accuracy_table, describe
from .results import markdown_table
from .tp import machine

LLAMACPP_HOWTO = ("python3 -m venv .venv-llamacpp && .venv-llamacpp/bin/pip install "
                  "llama-cpp-python==0.3.36")
PROMPT_TOKENS, DECODE_TOKENS = 32, 64

# Run by llama-cpp-python's interpreter: argv[1] is a JSON file with the spec; JSON out.
LLAMACPP_SCRIPT = '''
import json, sys, time

def main():
    spec = json.load(open(sys.argv[1]))
    from llama_cpp import Llama
    llm = Llama(model_path=spec["gguf"], n_ctx=1024, n_batch=512, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], seed=0, verbose=False)

    def gen(prompt, n):
        llm.reset()                          # no prefix reuse between calls
        out = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            if len(out) == n:
                return out

    gen(spec["batch1_prompt"], 4)            # warm-up
    times = {}
    for n in (1, spec["decode_tokens"] + 1):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            ids = gen(spec["batch1_prompt"], n)
            best = min(best, time.perf_counter() - t)
        times[n] = best
    batch1_ids = ids
    t = time.perf_counter()
    tokens = 0
    for prompt, n in zip(spec["prompts"], spec["out_lens"]):
        tokens += len(gen(prompt, n))
    wall = time.perf_counter() - t
    print(json.dumps(dict(times=times, batch1_ids=batch1_ids, wall=wall, tokens=tokens)))

if __name__ == "__main__":
    main()
'''


def find_llamacpp_python(explicit: str | None) -> str | None:
    """llama-cpp-python's interpreter: the flag, $NANOPAGED_LLAMACPP_PYTHON, or ./.venv-llamacpp."""
    return find_peer(explicit, "NANOPAGED_LLAMACPP_PYTHON", ".venv-llamacpp/bin/python")


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the loaded weights: "resident" (the engine's own count, worker.weights_info:
    every parameter and packed block once) and "per_token" (what a batch-1 decode step
    reads: the projections and the LM head)."""
    from nanopaged.worker.worker import weights_info

    resident = weights_info(model).nbytes
    per_token = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            per_token += method.nbytes
        elif module.__class__.__name__ in ("ColumnParallelLinear", "RowParallelLinear"):
            per_token += module.weight.numel() * module.weight.element_size()
    head = getattr(model, "lm_head", None) or getattr(model, "embed_tokens", None)
    if head is not None and getattr(head, "quant_method", None) is None:
        per_token += head.weight.numel() * head.weight.element_size()
    return dict(resident=resident, per_token=per_token)


def _best_seconds(fn, threads: int, runs: int = 5) -> float:
    """fn()'s fastest of `runs` calls (after one warm-up), torch on `threads` threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fn()
        best = float("inf")
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        torch.set_num_threads(old)


def read_bandwidth(threads: int) -> float:
    """Bytes per second this machine reads from DRAM: a 512 MiB float32 tensor summed by
    torch with `threads` threads, best of five (far larger than any cache)."""
    a = torch.ones(128 << 20)
    return a.numel() * 4 / _best_seconds(a.sum, threads)


def sgemm_flops(threads: int) -> float:
    """float32 FLOP/s torch's sgemm (MKL) reaches on [2048 x 2048] @ [2048 x 2048] with
    `threads` threads, best of five: the ceiling for any float32 matmul here."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048 ** 3 / _best_seconds(lambda: a @ b, threads)


def workload_flops(config, prompts, out_lens) -> float:
    """FLOPs the workload needs at the least (2 per multiply-add): every prompt and output
    token but the last through the projections (q, k, v, o, gate, up, down of every
    layer), each output token's row through the LM head, and causal attention (q.k and
    p.v over the context, every head). config: the model's ModelConfig."""
    h, d = config.hidden_size, config.head_dim
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    per_token = config.num_hidden_layers * (h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter)
    macs = 0
    for prompt, n in zip(prompts, out_lens):
        tokens = len(prompt) + n - 1                    # the last output token is never fed back
        context = tokens * (tokens + 1) // 2            # token t attends to t + 1 positions
        macs += tokens * per_token + n * h * config.vocab_size + config.num_hidden_layers * 2 * heads * d * context
    return 2 * macs


def run_engine(model: str | None, quantization: str | None, batch1_prompt, prompts, out_lens,
               activation_quantization: str | None = None, dtype: str = "float32") -> dict:
    """One nanopaged engine: batch-1 ms/token (best of three), the workload, its weights,
    and what it resolved to ("config": quantization and dtype; model None and dtype "auto"
    are LLM()'s own choice, engine/arg_utils.default_model_weights)."""
    from nanopaged import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, quantization=quantization, enable_prefix_caching=False,
              activation_quantization=activation_quantization)
    resolved = llm.engine.config
    config = f"{resolved.quant_config.quantization or 'folder'}, {resolved.dtype}"
    try:
        def one(n):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t = time.perf_counter()
            out = llm.generate([batch1_prompt], params, use_tqdm=False)
            return time.perf_counter() - t, out[0].outputs[0].token_ids

        one(4)                                                             # warm-up
        t1 = min(one(1)[0] for _ in range(3))
        runs = [one(DECODE_TOKENS + 1) for _ in range(3)]
        batch1 = (min(t for t, _ in runs) - t1) / DECODE_TOKENS
        wall, tokens = run_nanopaged(llm, prompts, out_lens)
        model_config = llm.engine.model_runner.model.config
        return dict(batch1=batch1, ids=list(runs[0][1]), wall=wall, tokens=tokens, config=config,
                    flops=workload_flops(model_config, prompts, out_lens),
                    **weight_bytes(llm.engine.model_runner.model), kv_per_token=_kv_per_token(llm))
    finally:
        llm.shutdown()


def _kv_per_token(llm) -> int:
    """KV bytes a token of context holds over all layers: the cache's bytes over its slots."""
    cache = llm.engine.model_runner.kv_cache      # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return cache[:, :, 0, 0].numel() * cache.element_size()


def run_llamacpp(python: str, gguf: Path, threads: int, batch1_prompt, prompts, out_lens) -> dict | None:
    """llama.cpp on the same file in its own interpreter; None (and why) if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        script, spec = Path(tmp) / "run_llamacpp.py", Path(tmp) / "spec.json"
        script.write_text(LLAMACPP_SCRIPT)
        spec.write_text(json.dumps(dict(gguf=str(gguf), threads=threads, batch1_prompt=batch1_prompt,
                                        decode_tokens=DECODE_TOKENS, prompts=prompts, out_lens=out_lens)))
        proc = subprocess.run([python, str(script), str(spec)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        print(f"  llama.cpp failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
        return None
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    times = {int(k): v for k, v in r["times"].items()}
    return dict(batch1=(times[DECODE_TOKENS + 1] - times[1]) / DECODE_TOKENS, ids=r["batch1_ids"][:DECODE_TOKENS + 1],
                wall=r["wall"], tokens=r["tokens"])


def bench_quant(model: str | None, args) -> None:
    """The default model's Q4_1 file as shipped vs its fp32 folder vs llama.cpp."""
    from nanopaged.model.model_loader import ensure_default_gguf, ensure_default_model

    if model is not None:
        print("quant: measures the default model's GGUF file; --model is ignored here")
    gguf = ensure_default_gguf(progress=False)
    folder = str(ensure_default_model(progress=False))
    threads = torch.get_num_threads()
    prompts, out_lens = workload(args.num_requests, 49152, max_output=args.max_output)
    batch1_prompt = [random.Random(7).randrange(100, 49152) for _ in range(PROMPT_TOKENS)]
    print(f"quant: {machine()}; {threads} threads each; float32 activations; {gguf.name} "
          f"({gguf.stat().st_size / 1e6:.1f} MB); batch 1: a {PROMPT_TOKENS}-token prompt, "
          f"{DECODE_TOKENS} tokens; throughput: {len(prompts)} requests, {sum(out_lens)} output tokens")
    bandwidth, peak = read_bandwidth(threads), sgemm_flops(threads)
    rows = {"nanopaged gguf (as shipped)": run_engine(str(gguf), "gguf", batch1_prompt, prompts, out_lens),
            "nanopaged fp32 folder": run_engine(folder, None, batch1_prompt, prompts, out_lens),
            "nanopaged bf16 folder": run_engine(folder, None, batch1_prompt, prompts, out_lens, dtype="bfloat16"),
            "nanopaged LLM() default": run_engine(None, None, batch1_prompt, prompts, out_lens, dtype="auto"),
            "nanopaged gguf, int8 activations": run_engine(str(gguf), "gguf", batch1_prompt, prompts, out_lens,
                                                           activation_quantization="int8")}
    print_default_choice(rows)
    python = find_llamacpp_python(getattr(args, "llamacpp_python", None))
    peer = None
    if python is None:
        print(f"  llama.cpp: no interpreter found; make one with: {LLAMACPP_HOWTO}")
    else:
        peer = run_llamacpp(python, gguf, threads, batch1_prompt, prompts, out_lens)
    ours, a8 = rows["nanopaged gguf (as shipped)"], rows["nanopaged gguf, int8 activations"]
    context = PROMPT_TOKENS + DECODE_TOKENS / 2                        # mean context of the decode
    print(f"  read bandwidth (torch sum of 512 MiB, {threads} threads): {bandwidth / 1e9:.1f} GB/s")
    for label, r in rows.items():
        step = r["per_token"] + r["kv_per_token"] * context
        print(f"  {label}: batch 1 {1e3 * r['batch1']:.1f} ms/token, throughput {r['tokens'] / r['wall']:.1f} tok/s; "
              f"weights resident {r['resident'] / 1e6:.1f} MB ({r['resident'] / gguf.stat().st_size:.2f}x the file); "
              f"a decode step reads {step / 1e6:.1f} MB: DRAM roofline {1e3 * step / bandwidth:.1f} ms/token, "
              f"reached {100 * step / bandwidth / r['batch1']:.0f}%")
    ceiling = ours["tokens"] / (ours["flops"] / peak)                   # tok/s at the sgemm rate
    reached = ", ".join(f"{label.split(' (')[0]} {100 * r['tokens'] / r['wall'] / ceiling:.0f}%"
                        for label, r in rows.items())
    print(f"  compute roofline: the throughput workload needs {ours['flops'] / 1e12:.2f} TFLOP; torch's sgemm "
          f"reached {peak / 1e9:.0f} GFLOP/s here, so no float32 engine serves it faster than {ceiling:.0f} tok/s "
          f"(reached: {reached})")
    same = ours["ids"] == rows["nanopaged fp32 folder"]["ids"]
    folder = rows["nanopaged fp32 folder"]
    print(f"  gguf vs fp32 folder: same batch-1 greedy tokens: {same}; batch 1 "
          f"{folder['batch1'] / ours['batch1']:.2f}x faster, throughput "
          f"{(ours['tokens'] / ours['wall']) / (folder['tokens'] / folder['wall']):.2f}x")
    if peer is not None:
        agree = next((i for i, (a, b) in enumerate(zip(peer["ids"], ours["ids"])) if a != b), len(ours["ids"]))
        print(f"  llama.cpp (llama-cpp-python 0.3.36): batch 1 {1e3 * peer['batch1']:.1f} ms/token, "
              f"serving one after another {peer['tokens'] / peer['wall']:.1f} tok/s; same greedy tokens as ours "
              f"for the first {agree} of {len(ours['ids'])}")
        print(f"  ratios (target): batch 1 llama.cpp / nanopaged = {peer['batch1'] / ours['batch1']:.2f}x (>= 1.0); "
              f"throughput nanopaged / llama.cpp serial = "
              f"{(ours['tokens'] / ours['wall']) / (peer['tokens'] / peer['wall']):.2f}x (>= 5); "
              f"resident / file = {ours['resident'] / gguf.stat().st_size:.2f}x (<= 1.25)")
        print(f"  with activation_quantization='int8' (llama.cpp's own arithmetic; not exact, see below): "
              f"batch 1 llama.cpp / nanopaged = {peer['batch1'] / a8['batch1']:.2f}x (>= 1.0); throughput "
              f"{(a8['tokens'] / a8['wall']) / (peer['tokens'] / peer['wall']):.2f}x (>= 5)")
        serial = peer["tokens"] / peer["wall"]
        print(f"  the float32 compute roofline is {ceiling / serial:.2f}x llama.cpp's serial {serial:.1f} tok/s: "
              f"the most throughput ratio any float32-exact engine could reach on these cores")
    server = find_llama_server(getattr(args, "llama_server", None))
    if server is None:
        print(f"  llama-server: not found; {LLAMA_SERVER_HOWTO}")
    else:
        try:
            s = run_llama_server(server, gguf, threads, prompts, out_lens)
        except Exception as e:                        # a peer that fails is reported, not fatal
            print(f"  llama-server ({server}) failed: {e}")
        else:
            rate = s["tokens"] / s["wall"]
            print(f"  llama.cpp's server (llama-server, {s['slots']} parallel slots, continuous batching): "
                  f"{rate:.1f} tok/s; nanopaged / llama-server = {(ours['tokens'] / ours['wall']) / rate:.2f}x, "
                  f"with int8 activations {(a8['tokens'] / a8['wall']) / rate:.2f}x")
    print(f"  int8 activations against exact, {len(ACCURACY_PROMPTS)} prompts x {ACCURACY_TOKENS} greedy tokens "
          f"(benchmarks/quant_accuracy.py): {describe(accuracy_table(str(gguf)))}")


def print_default_choice(rows: dict) -> None:
    """The default model's configurations in one table (`markdown_table`): each one's
    weights and dtype, batch-1 ms/token, throughput, and whether it is exact (the same
    batch-1 greedy ids as the float32 folder, which the file dequantizes to, bit for bit by
    design for the file and the folder); then the fastest exact path at batch 1 and in
    throughput, and what LLM() chose on this CPU class (DEFAULT_MODEL_WEIGHTS)."""
    from nanopaged.engine.arg_utils import DEFAULT_MODEL_WEIGHTS
    from nanopaged.utils.cpu import cpu_class

    reference = rows["nanopaged fp32 folder"]["ids"]
    exact = {label: r["config"].endswith("float32") and "int8" not in label and r["ids"] == reference
             for label, r in rows.items()}
    print(f"  the default model on this CPU (class {cpu_class()}, {cpu_flags()}):")
    print(markdown_table(["configuration", "weights, dtype", "batch 1 (ms/token)", "throughput (tok/s)", "exact"],
                         [[label, r["config"], f"{1e3 * r['batch1']:.1f}", f"{r['tokens'] / r['wall']:.1f}",
                           "yes" if exact[label] else "no"] for label, r in rows.items()]))
    candidates = {label: r for label, r in rows.items() if exact[label] and "default" not in label}
    fastest1 = min(candidates, key=lambda label: candidates[label]["batch1"])
    fastest_t = max(candidates, key=lambda label: candidates[label]["tokens"] / candidates[label]["wall"])
    print(f"  fastest exact path: batch 1 {fastest1}, throughput {fastest_t}; LLM() runs "
          f"{rows['nanopaged LLM() default']['config']} (DEFAULT_MODEL_WEIGHTS[{cpu_class()!r}] = "
          f"{DEFAULT_MODEL_WEIGHTS.get(cpu_class(), ('?',))[0]!r})")
