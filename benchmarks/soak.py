"""The memory soak (`python bench.py --sections soak`): does a server that has served a
while hold more memory than one that just warmed up?

One nanopaged server (`python -m nanopaged.serve`, a process of its own on a free port of
127.0.0.1) takes --soak-rounds rounds of the same mixed load, each all at once:

    8 streamed completions that run to the end
    4 streams the client leaves after two chunks (a disconnect: the server aborts them)
    2 completions with n = 2 (parallel sampling, blocks shared by copy-on-write)
    2 chat completions constrained by a JSON schema (structured outputs)
    2 bad requests (a 400 each)

After each round, once the server is idle again (its /metrics say no request runs or
waits), we read the resident set size (RSS) of the server process and of its
EngineCore process. A leak shows as growth that goes on round after round; the first
rounds grow while allocators, caches and the kernels' scratch warm up. The target is
flat after round 2: the line "growth after round 2" is the RSS of the last round minus
that of round 2.
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import time

from .serve import Server, text_workload

JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False}


async def _stream(client, url, body, leave_after=None) -> int:
    """Stream one request; leave after `leave_after` data lines if given. Returns the
    data lines read."""
    n = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                n += 1
                if leave_after is not None and n >= leave_after:
                    break
    return n


async def one_round(server: Server, work, rng: random.Random) -> dict[str, int]:
    """The mixed load of one round, all at once; returns how many of each kind ended as
    expected (a stream that ran, a 400 for a bad request, ...)."""
    import httpx

    completions, chat = server.url + "/v1/completions", server.url + "/v1/chat/completions"
    picks = rng.sample(work, 14)

    def completion(i, **kw):
        prompt, max_tokens = picks[i]
        return {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}

    async with httpx.AsyncClient(timeout=600) as client:
        streams = [_stream(client, completions, completion(i, stream=True)) for i in range(8)]
        left = [_stream(client, completions, completion(8 + i, stream=True, max_tokens=200), leave_after=2)
                for i in range(4)]
        parallel = [client.post(completions, json=completion(12 + i, n=2, temperature=0.8, seed=i))
                    for i in range(2)]
        structured = [client.post(chat, json={
            "model": server.model, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": f"Describe person number {i} as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": JSON_SCHEMA}}})
            for i in range(2)]
        bad = [client.post(completions, json={"model": server.model, "prompt": "hi", "temperature": -1}),
               client.post(chat, json={"model": server.model, "messages": []})]
        results = await asyncio.gather(*streams, *left, *parallel, *structured, *bad)
    streams_ok = sum(n > 0 for n in results[:8])
    left_ok = sum(n == 2 for n in results[8:12])
    rest = results[12:]
    return {"streams": streams_ok, "left": left_ok,
            "n=2": sum(r.status_code == 200 and len(r.json()["choices"]) == 2 for r in rest[:2]),
            "structured": sum(r.status_code == 200 for r in rest[2:4]),
            "400": sum(r.status_code == 400 for r in rest[4:])}


def _idle(server: Server, timeout_s: float = 60) -> None:
    """Wait until the server's /metrics say no request runs or waits."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("nanopaged:num_requests_running", "nanopaged:num_requests_waiting"))}
        if values and not any(values.values()):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the server was not idle {timeout_s} s after a round")


def bench_soak(model, dtype: str, rounds: int, threads: int) -> None:
    """Run the soak and print one line per round (RSS of server and core, MiB; what each
    kind of request did), then the growth after round 2."""
    import psutil
    from transformers import AutoTokenizer
    from nanopaged.model.model_loader import resolve_model

    folder = str(resolve_model(model))
    work = text_workload(AutoTokenizer.from_pretrained(folder), 64, seed=3)
    work = [(prompt, min(max_tokens, 64)) for prompt, max_tokens in work]
    print(f"soak: model {os.path.basename(folder)}, dtype {dtype}, {rounds} rounds of 20 requests "
          f"(8 streams, 4 left after 2 chunks, 2 with n=2, 2 JSON-schema chats, 2 bad), {threads} threads")
    argv = [sys.executable, "-m", "nanopaged.serve", "--model", folder, "--host", "127.0.0.1",
            "--port", "{port}", "--dtype", dtype]
    rng = random.Random(0)
    rss: list[tuple[float, float]] = []
    with Server("nanopaged", argv, threads) as server:
        proc = psutil.Process(server.proc.pid)
        (core,) = proc.children()
        for i in range(1, rounds + 1):
            t0 = time.perf_counter()
            done = asyncio.run(one_round(server, work, rng))
            _idle(server)
            rss.append((proc.memory_info().rss / 2**20, core.memory_info().rss / 2**20))
            print(f"  round {i:2}: server {rss[-1][0]:7.1f} MiB, core {rss[-1][1]:7.1f} MiB "
                  f"({time.perf_counter() - t0:5.1f} s; as expected: " +
                  ", ".join(f"{k} {v}" for k, v in done.items()) + ")")
    if len(rss) > 2:
        grow = [rss[-1][j] - rss[1][j] for j in (0, 1)]
        per = [g / (len(rss) - 2) for g in grow]
        print(f"  growth after round 2: server {grow[0]:+.1f} MiB ({per[0]:+.2f} a round), "
              f"core {grow[1]:+.1f} MiB ({per[1]:+.2f} a round) (target: flat)")
