"""chat: time per output token at batch 1, nanopaged's chat loop vs transformers."""
from __future__ import annotations

import time

import torch

from .common import workload


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
