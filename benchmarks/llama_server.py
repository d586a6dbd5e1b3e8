"""llama.cpp's own server with parallel slots, for bench.py's `quant` section: the ratio of
our throughput to llama.cpp's own continuous batching, where its server can be built.

llama-cpp-python serves one sequence at a time; llama.cpp's C++ server (`llama-server`,
tools/server in llama.cpp) keeps N slots and puts every slot's next tokens (prompt chunks
and decodes alike) into one batch a step: continuous batching, llama.cpp's answer to ours.
It is not in any wheel; it builds from the llama.cpp that llama-cpp-python 0.3.36 vendors
(the same ggml as the llama.cpp row of the section), 6.5 minutes on our two cores. It
needs cmake, ninja and a C++17 compiler; run from the checkout's root (the bench looks for
the binary there), with no network but the package index:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    cmake -S /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp -B .llama-server -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    ninja -C .llama-server llama-server

The section finds the binary by --llama-server, $NANOPAGED_LLAMA_SERVER or the checkout's
.llama-server/bin/llama-server (without one its row is skipped and this howto named).
It is started here on a free port of 127.0.0.1 with the same GGUF file and threads, one
slot per request (-np), a unified KV cache big enough for all of them at once (-kvu), no
prompt cache; after a warm-up request the workload's requests are all sent at once
(greedy: top_k 1, ignore_eos, n_predict = the request's output length), as our engine gets
them, and the wall time from the first sent to the last answered is the figure. The
process is stopped by its pid (benchmarks/serve.py's Server) when the run ends.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from .common import find_peer
from .serve import Server

LLAMA_SERVER_HOWTO = "see benchmarks/llama_server.py's docstring (cmake, then ninja llama-server)"
SLOT_CONTEXT = 512          # tokens a slot may hold: a prompt of at most 256 and its output


def find_llama_server(explicit: str | None) -> str | None:
    """llama-server's path: the flag, $NANOPAGED_LLAMA_SERVER, or ./.llama-server/bin/llama-server."""
    return find_peer(explicit, "NANOPAGED_LLAMA_SERVER", ".llama-server/bin/llama-server")


def llama_server_argv(binary: str, gguf: Path, threads: int, slots: int) -> list[str]:
    """The command line: `slots` parallel slots sharing one KV cache of slots x SLOT_CONTEXT
    tokens, `threads` threads for decode and prompt batches, no prompt cache, port {port}."""
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * SLOT_CONTEXT),
            "-kvu", "-cb", "--cache-ram", "0", "--no-webui"]


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    """A /completion request for prompt's token ids: greedy, exactly max_tokens tokens."""
    return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "stream": False}


async def _send_all(url: str, prompts: list[list[int]], out_lens: list[int]) -> tuple[float, int]:
    import httpx
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800)) as client:
        async def one(prompt, n):
            r = await client.post(url + "/completion", json=completion_body(prompt, n))
            r.raise_for_status()
            return r.json()["tokens_predicted"]

        await one(prompts[0][:16], 4)                               # warm-up
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, out_lens)))
        return time.perf_counter() - t, sum(counts)


def run_llama_server(binary: str, gguf: Path, threads: int, prompts: list[list[int]], out_lens: list[int],
                     slots: int | None = None) -> dict:
    """Serve the workload with `slots` slots (default: one per request; fewer queue the
    rest in the server); returns wall seconds, output tokens and
    the slots. Raises RuntimeError if the server does not start or a request comes back
    short (ignore_eos not honoured would make the figure a lie)."""
    slots = slots or len(prompts)
    with Server("llama-server", llama_server_argv(binary, gguf, threads, slots), threads) as server:
        wall, tokens = asyncio.run(_send_all(server.url, prompts, out_lens))
    if tokens != sum(out_lens):
        raise RuntimeError(f"llama-server produced {tokens} tokens, the requests asked for {sum(out_lens)}")
    return dict(wall=wall, tokens=tokens, slots=slots)
