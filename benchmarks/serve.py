"""The serving benchmark (`python bench.py --sections serve`), in the spirit of vLLM's
benchmarks/benchmark_serving.py: clients on loopback send the throughput workload's
requests to an OpenAI-compatible server with Poisson arrivals at a few request rates,
streaming, and we measure what a user of the server sees:

    throughput   output tokens / seconds from the first request sent to the last token
    TTFT         time to first token: request sent -> first chunk with text (p50, p99)
    ITL          inter-token latency: the gaps between a stream's chunks (p50, p99)

Side by side in one run, each server started here as a process of its own on a free
port on 127.0.0.1, the same model folder, dtype and thread count, the same requests:
nanopaged (`python -m nanopaged.serve`) and transformers' own OpenAI server
(`transformers serve --continuous-batching`). Greedy, so both produce the same tokens
and the same amount of work (neither server honours ignore_eos the same way, so a
request may end early at an eos; we count the tokens each server says it produced).
With --overlap, nanopaged runs twice more, async scheduling off and on. With
--dashboard-viewer, each nanopaged server then runs every rate 2 x VIEWER_ROUNDS more
times on the same server, alternately without and with one viewer reading GET
/dashboard/events the whole time (as an open browser tab does; it parses every
snapshot), and the ratios of the median and of the best throughputs are printed (the target: >= 0.97).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time


_TRANSFORMERS_CLI = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_workload(tokenizer, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """n (prompt text, max_tokens): prompts of U[32, 256] random tokens decoded to text,
    outputs of U[32, 96] tokens (the issue's serving workload)."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    work = []
    for _ in range(n):
        ids = [rng.randrange(100, vocab) for _ in range(rng.randint(32, 256))]
        work.append((tokenizer.decode(ids), rng.randint(32, 96)))
    return work


class Server:
    """A server process on a free port; stopped (by pid) when the with-block ends."""

    def __init__(self, name: str, argv: list[str], threads: int) -> None:
        self.name, self.port = name, free_port()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.log = tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        import httpx
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log.name) as f:
                    raise RuntimeError(f"{self.name} server exited: {f.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    models = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
                    self.model = models[0]["id"]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} server did not start in 600 s")

    def __exit__(self, *exc) -> None:
        import signal
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)      # its own session: it and its children
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        os.unlink(self.log.name)


async def one_request(client, server: Server, prompt: str, max_tokens: int) -> dict:
    """Stream one completion; returns its send time, chunk arrival times, token count."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times, tokens = [], None
    async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return {"sent": sent, "times": times, "tokens": tokens if tokens is not None else len(times)}


async def watch_dashboard(client, server: Server, seen: list) -> None:
    """A dashboard viewer: read the snapshot stream and parse each, until cancelled."""
    async with client.stream("GET", server.url + "/dashboard/events") as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen.append(len(json.loads(line[6:])["steps"]))


async def run_rate(server: Server, work, rate: float, seed: int = 0, viewer: bool = False) -> dict:
    """Send every request, spaced by exponential gaps of mean 1/rate s (inf: all at once);
    viewer: with a dashboard viewer open the whole time (its snapshot count in "snapshots")."""
    import httpx
    rng = random.Random(seed)
    seen: list[int] = []
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(work) + 1)) as client:
        watching = asyncio.create_task(watch_dashboard(client, server, seen)) if viewer else None
        while watching is not None and not seen and not watching.done():
            await asyncio.sleep(0.01)          # the idle state arrived: the viewer is in
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(one_request(client, server, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        if watching is not None:
            await asyncio.sleep(0.2)           # the snapshot flushed when the engine idles
            watching.cancel()
    end = max(r["times"][-1] for r in results if r["times"])
    ttft = [r["times"][0] - r["sent"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in results)
    return {"tok_s": tokens / (end - start), "tokens": tokens, "secs": end - start,
            "ttft": ttft, "itl": itl, "snapshots": len(seen)}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def report(name: str, rate: float, m: dict) -> None:
    print(f"  {name:<22} rate {rate:>5}/s: {m['tok_s']:7.1f} tok/s ({m['tokens']} tokens, {m['secs']:.1f} s)  "
          f"TTFT p50 {1e3 * statistics.median(m['ttft']):7.0f} ms p99 {1e3 * pct(m['ttft'], 99):7.0f} ms  "
          f"ITL p50 {1e3 * statistics.median(m['itl']):6.0f} ms p99 {1e3 * pct(m['itl'], 99):6.0f} ms")


VIEWER_ROUNDS = 4      # --dashboard-viewer: runs with and without a viewer, interleaved


def viewer_rounds(server: Server, work, rate: float, name: str) -> None:
    """The same load without and with one dashboard viewer, VIEWER_ROUNDS times each,
    interleaved (none, viewer, none, viewer, ...: a slow moment of the machine hits
    both), after the rate's first run (whose new batch shapes make it slow); prints the
    median and the best throughput of each, and their ratios."""
    none, watched = [], []
    for _ in range(VIEWER_ROUNDS):
        n = asyncio.run(run_rate(server, work, rate))
        report(name, rate, n)
        w = asyncio.run(run_rate(server, work, rate, viewer=True))
        report(f"{name} + viewer", rate, w)
        none.append(n["tok_s"])
        watched.append(w["tok_s"])
    for what, f in (("median", statistics.median), ("best", max)):
        a, b = f(watched), f(none)
        print(f"  {name}: 1 dashboard viewer / none at {rate}/s: throughput {a / b:.3f}x ({what} of "
              f"{VIEWER_ROUNDS} interleaved runs each: {a:.1f} / {b:.1f} tok/s)")
    print(f"  ({w['snapshots']} snapshots read in the last run with a viewer)")


def bench_serve(model, dtype: str, num_requests: int, rates: list[float], threads: int,
                overlap: bool = True, skip_transformers: bool = False, dashboard_viewer: bool = False) -> None:
    """Run the serving benchmark and print one line per server and rate, then the
    ratios at each rate (throughput, p50 TTFT); dashboard_viewer: nanopaged's rates
    also with a dashboard viewer open, and the throughput ratio with / without."""
    from transformers import AutoTokenizer
    from nanopaged.model.model_loader import resolve_model

    folder = str(resolve_model(model))
    work = text_workload(AutoTokenizer.from_pretrained(folder), num_requests)
    print(f"serve: model {os.path.basename(folder)}, dtype {dtype}, {num_requests} requests per rate, "
          f"streaming /v1/completions, greedy, {threads} threads per server, rates {rates}")
    ours_argv = [sys.executable, "-m", "nanopaged.serve", "--model", folder, "--host", "127.0.0.1",
                 "--port", "{port}", "--dtype", dtype]
    servers = {"nanopaged": ours_argv}
    if overlap:
        servers = {"nanopaged (overlap off)": ours_argv + ["--async-scheduling", "false"],
                   "nanopaged (overlap on)": ours_argv + ["--async-scheduling", "true"]}
    if not skip_transformers:
        servers["transformers serve --cb"] = [sys.executable, "-c", _TRANSFORMERS_CLI, "serve",
                                             "--continuous-batching", "--device", "cpu", "--dtype", dtype,
                                             "--port", "{port}", folder]
    results: dict[str, dict[float, dict]] = {}
    for name, argv in servers.items():
        with Server(name, argv, threads) as server:
            asyncio.run(run_rate(server, work[:2], float("inf"), seed=1))        # warm-up
            results[name] = {}
            for rate in rates:
                results[name][rate] = m = asyncio.run(run_rate(server, work, rate))
                report(name, rate, m)
                if dashboard_viewer and name.startswith("nanopaged"):
                    viewer_rounds(server, work, rate, name)
    if "transformers serve --cb" in results:
        theirs = results["transformers serve --cb"]
        for name in (n for n in results if n.startswith("nanopaged")):
            for rate in rates:
                a, b = results[name][rate], theirs[rate]
                print(f"  {name} / transformers at {rate}/s: throughput {a['tok_s'] / b['tok_s']:.2f}x, "
                      f"p50 TTFT {statistics.median(a['ttft']) / statistics.median(b['ttft']):.2f}x "
                      f"(lower is better)")
    if overlap:
        off, on = results["nanopaged (overlap off)"], results["nanopaged (overlap on)"]
        for rate in rates:
            print(f"  overlap on / off at {rate}/s: throughput {on[rate]['tok_s'] / off[rate]['tok_s']:.2f}x, "
                  f"p50 ITL {statistics.median(on[rate]['itl']) / statistics.median(off[rate]['itl']):.2f}x")
