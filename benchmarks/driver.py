"""nanopaged's benchmarks, each measured side by side with its baseline in one run.

    python bench.py [--dtype float32|bfloat16] [--num-requests 64] [--profile]
                    [--attention-backend auto|torch|cpu|cuda]
                    [--sections throughput,chat,sampling,structured,overlap,prefix,sharing,pressure,
                                memory,kernels]
                    [--kernels] [--sections serve --request-rates 0.5,2,inf --serve-requests 32
                                      --dashboard-viewer]
                    [--sections tp] [--sections vllm --vllm-python PATH] [--max-output 128]
                    [--sections soak --soak-rounds 8]
                    [--sections quant --llamacpp-python PATH --llama-server PATH]
                    [--sections lora]
                    [--sections spec --spec-requests 8 --spec-max-tokens 48 --spec-batches 1,8
                                     --spec-k 2,4 --spec-draft-layers 10 --spec-draft-k 4 --spec-rounds 2]
                    [--results-entry [TITLE]]

--results-entry: at the end, the run printed as an entry of benchmarks/RESULTS.md (the
            date, the machine, dtype and threads, the command, the tables, the output;
            benchmarks/results.py), for any sections.

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
            async scheduling off vs on (benchmarks/serve.py); --dashboard-viewer: each
            rate again with a live dashboard viewer open, and the throughput ratio.
soak:       (not in the default list: minutes) --soak-rounds rounds of mixed load against
            one server (streams, disconnects, n=2, structured outputs, bad requests):
            the RSS of the server and of its EngineCore process after each round, and
            the growth after round 2 (target: flat; benchmarks/soak.py).
tp:         (not in the default list: a few minutes) tensor parallelism
            (chapters/17-tensor-parallelism.md): tp=1 vs tp=2 on a random Llama with even
            heads and tp=1 vs tp=3 on the default model: tokens/s, the share of the
            generate spent in collectives and in delivering the control message, and
            our pyzmq push of it vs a broadcast over the process group (benchmarks/tp.py;
            fp32 and its own two models whatever --model and --dtype say).
pp:         (not in the default list: a few minutes) pipeline parallelism
            (chapters/20-pipeline-parallelism.md): pp=1, 2, 3 on the default model on the
            same cores: tokens/s, batch-1 ms/token, each stage's bubble (idle share of the
            wall time), KV tokens a rank holds at equal memory, bytes and time per hop,
            and pp=2 split over two local "nodes" (--nnodes 2, one headless); fp32
            (benchmarks/pp.py).
structured: structured outputs (chapters/18-structured-outputs.md): the throughput
            workload with every request constrained by a JSON schema vs unconstrained
            (same tokens), best of two each, plus the bitmask's fill and apply cost per
            step (target: within 15%).
overlap:    async scheduling (chapters/16-async-scheduling.md): the throughput workload
            with async_scheduling off vs on (runs off, on, on, off), best of two each: time per
            engine step (ms) and tokens/s, and the ratio on / off.
spec:       (not in the default list: 5-8 minutes) speculative decoding vs plain
            decoding, the same engine settings but speculative_config, greedy, eos
            honoured, max_tokens --spec-max-tokens: chat requests that copy (repeat a
            paragraph with one word changed, rename a variable in a code snippet) and plain
            chat questions, at batch 1 (one request after another) and 8 (all at once),
            with n-gram proposals (prompt lookup 2..5, one engine per --spec-k) and a
            draft made of the target's first --spec-draft-layers layers; interleaved
            rounds, best of --spec-rounds each. Per row: output tokens/s off and on, the
            ratio, acceptance (accepted / proposed), accepted tokens per verify step, and
            whether every output is the baseline's token for token (targets: n-gram
            >= 1.5x on copy at batch 1, >= 0.95x on chat; benchmarks/spec.py).
quant:      (not in the default list: a few minutes, llama.cpp's venv for its rows) the
            default model's Q4_1 GGUF run as shipped (quantization="gguf", exact, and
            with int8 activations) vs its fp32 and bf16 folders vs what LLM() picks on
            this CPU class (one table, and the fastest exact path) vs llama.cpp
            (llama-cpp-python) on the same file and threads: batch-1
            ms/token, throughput (llama.cpp serving one request after another, and
            llama.cpp's own llama-server with parallel slots where one is built:
            benchmarks/llama_server.py), resident weight bytes vs the file, bytes read per
            decoded token vs the DRAM roofline (targets: batch 1 >= llama.cpp's speed,
            throughput >= 5x the serial rate, resident <= 1.25x the file; benchmarks/quant.py).
lora:       (not in the default list: a few minutes, needs peft) multi-LoRA serving
            (chapters/22-lora.md): 32 requests of the throughput workload spread over 1, 4
            and 16 adapters of rank 8 and 64 (made by peft, random A and B, all seven
            projections), every adapter in a slot, vs the base model alone, and vs
            transformers + peft serving one adapter at a time (benchmarks/lora.py).
vllm:       (not in the default list: needs vLLM's own venv) nanopaged vs vLLM's CPU
            backend on the throughput workload and batch-1 decode, vLLM in a child
            process of its own interpreter (benchmarks/vllm.py says how to make its venv).
kernels:    (also --kernels) the compiled paged-attention kernel vs the PyTorch
            reference: decode attention alone (64 sequences x 1024 tokens of context,
            fp32 and bf16, the default model's heads), then the throughput workload end
            to end with each backend. On a GPU: KV bytes read per second at 256 x 2048,
            bf16, as a share of the H200's ~4.8 TB/s, and time vs SDPA on contiguous K/V.

"""
from __future__ import annotations

import argparse

import torch

from .chat import bench_chat_latency
from .common import cpu_flags
from .kernels import bench_kernels
from .lora import bench_lora
from .memory import bench_memory_utilization
from .overlap import bench_overlap
from .pp import bench_pp
from .quant import bench_quant
from .results import recorded_run
from .prefix import bench_prefix_caching
from .pressure import bench_memory_pressure
from .sampling import bench_sampling
from .serve import bench_serve
from .soak import bench_soak
from .spec import bench_spec
from .sharing import bench_sharing_memory
from .structured import bench_structured
from . import throughput
from .throughput import bench_throughput
from .tp import bench_tp
from .vllm import bench_vllm


def main() -> None:
    # --help ends with the throughput workload's description, kept once, in throughput.py
    workload = throughput.__doc__.split("\n", 2)[2]
    ap = argparse.ArgumentParser(description=__doc__ + workload, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder (default: the default model's converted "
                    "float32 folder; quant always measures its GGUF file)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: what LLM(dtype='auto') picks on this machine (both sides use it)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=128,
                    help="the workload's outputs are U[32, this] tokens (throughput, vllm; default 128)")
    ap.add_argument("--vllm-python", default=None,
                    help="vllm: the interpreter of vLLM's venv (else $NANOPAGED_VLLM_PYTHON or ./.venv-vllm)")
    ap.add_argument("--llamacpp-python", default=None,
                    help="quant: the interpreter of llama-cpp-python's venv (else $NANOPAGED_LLAMACPP_PYTHON "
                         "or ./.venv-llamacpp)")
    ap.add_argument("--llama-server", default=None,
                    help="quant: llama.cpp's llama-server binary (else $NANOPAGED_LLAMA_SERVER or "
                         "./.llama-server/bin/llama-server; benchmarks/llama_server.py says how to build it)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "cuda"])
    ap.add_argument("--sections",
                    default="throughput,chat,sampling,structured,overlap,prefix,sharing,pressure,memory,kernels",
                    help="comma-separated, from the list above; serve, soak, spec, tp, pp, quant, lora and vllm are not in "
                         "the default")
    ap.add_argument("--kernels", action="store_true", help="only the kernels section")
    ap.add_argument("--request-rates", default="0.5,2,inf", help="serve: requests per second")
    ap.add_argument("--serve-requests", type=int, default=32, help="serve: requests per rate")
    ap.add_argument("--dashboard-viewer", action="store_true",
                    help="serve: each rate also with one GET /dashboard/events viewer open (its cost)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="serve, soak: threads per server")
    ap.add_argument("--soak-rounds", type=int, default=8, help="soak: rounds of mixed load")
    ap.add_argument("--spec-requests", type=int, default=8, help="spec: requests per workload (default 8)")
    ap.add_argument("--spec-max-tokens", type=int, default=48, help="spec: max_tokens of each request (default 48)")
    ap.add_argument("--spec-batches", default="1,8", help="spec: requests at once (1: one after another)")
    ap.add_argument("--spec-k", default="2,4", help="spec: n-gram num_speculative_tokens, one engine each")
    ap.add_argument("--spec-draft-layers", type=int, default=10,
                    help="spec: the layer draft's depth (the target's first layers; 0: no draft engine)")
    ap.add_argument("--spec-draft-k", type=int, default=4, help="spec: the draft's num_speculative_tokens")
    ap.add_argument("--spec-rounds", type=int, default=2, help="spec: interleaved rounds, best of them")
    ap.add_argument("--results-entry", nargs="?", const="", default=None, metavar="TITLE",
                    help="at the end, print the run as an entry of benchmarks/RESULTS.md (date, machine, dtype, "
                         "threads, command, the tables, the output), titled TITLE (benchmarks/results.py)")
    args = ap.parse_args()
    sections = ["kernels"] if args.kernels else args.sections.split(",")
    if args.dtype == "auto":
        from nanopaged.config import EngineConfig
        args.dtype = str(EngineConfig(model=args.model).torch_dtype).removeprefix("torch.")
    quant_model = args.model
    if args.model is None:
        # LLM() runs the default model's GGUF file in float32 (engine/arg_utils.py's
        # default_model_weights); these sections measure its converted folder, the weights
        # transformers and vLLM read too (quant measures the file, the folder and llama.cpp)
        from nanopaged.model.model_loader import ensure_default_model
        args.model = str(ensure_default_model(progress=False))
    print(cpu_flags(), f"| dtype {args.dtype}")
    if args.results_entry is None:
        run_sections(sections, args, quant_model)
    else:
        with recorded_run(args.results_entry or f"the sections {', '.join(sections)}", args.dtype):
            run_sections(sections, args, quant_model)


def run_sections(sections: list[str], args, quant_model: str | None) -> None:
    """The sections asked for, in this fixed order, whatever order --sections names them in."""
    if "vllm" in sections:
        bench_vllm(args.model, args)
    if "chat" in sections:
        bench_chat_latency(args.model, args.dtype)
    if "serve" in sections:
        bench_serve(args.model, args.dtype, args.serve_requests,
                    [float(r) for r in args.request_rates.split(",")], args.threads,
                    skip_transformers=args.skip_transformers, dashboard_viewer=args.dashboard_viewer)
    if "soak" in sections:
        bench_soak(args.model, args.dtype, args.soak_rounds, args.threads)
    if "tp" in sections:
        bench_tp()
    if "pp" in sections:
        bench_pp()
    if "quant" in sections:
        bench_quant(quant_model, args)
    if "lora" in sections:
        bench_lora(args.model, args)
    if "sampling" in sections:
        bench_sampling(args.model, args)
    if "overlap" in sections:
        bench_overlap(args.model, args)
    if "structured" in sections:
        bench_structured(args.model, args)
    if "kernels" in sections:
        bench_kernels(args.model, args)
    if "spec" in sections:
        bench_spec(args.model, args)
    if "prefix" in sections:
        bench_prefix_caching(args.model, args.dtype)
    if "sharing" in sections:
        bench_sharing_memory(args.model, args.dtype)
    if "pressure" in sections:
        bench_memory_pressure(args.model, args.dtype)
    if "memory" in sections:
        bench_memory_utilization(args.model, args.dtype)
    if "throughput" in sections:
        bench_throughput(args.model, args)


if __name__ == "__main__":
    main()
