"""What activation_quantization="int8" costs in accuracy: greedy agreement and mean
|delta logprob| against the exact mode, on the default model's Q4_1 file, float32.

The exact engine first writes each prompt's greedy continuation (ACCURACY_TOKENS tokens).
Both engines then score prompt + continuation with prompt_logprobs=1 (teacher forcing:
every position sees the same context, so one early difference does not decide the rest):
- greedy agreement: the share of continuation positions where the int8 engine's most likely
  token is the exact engine's greedy token (the exact engine's own is 100% by construction);
- mean |delta logprob|: |log p_int8(token) - log p_exact(token)| of the continuation's
  tokens, averaged (nats);
- free-running: how many of the prompts the int8 engine continues with the same
  ACCURACY_TOKENS greedy ids.
Deterministic (both paths are batch-invariant): the same numbers on every run of one kernel
build. An AVX512 build sums the float32 parts (norms, attention, the exact matmuls) in 16
lanes, not 8, so its numbers differ a little. Chapter 21 quotes the AVX2 build's, and
tests/quantization/test_quant_accuracy.py checks that quote on AVX2 and its bounds everywhere.
"""
from __future__ import annotations

ACCURACY_TOKENS = 32
ACCURACY_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one paragraph.",
    "List three prime numbers and say why they are prime.",
    "Once upon a time, in a small village,",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your steps.",
    "The three laws of thermodynamics are",
    "Give me a recipe for pancakes.",
    "import numpy as np\n# compute the mean of a list\n",
    "Summarize the plot of Romeo and Juliet.",
    "Why do cats purr?",
    "A paged KV cache stores",
    "The best way to learn a new language is",
    "Q: Who wrote 'Pride and Prejudice'?\nA:",
]


def _scores(llm, sequences: list[list[int]], starts: list[int]) -> tuple[list[float], list[int]]:
    """Each sequence's continuation (positions from its start) scored with prompt_logprobs=1:
    (logprob of each actual token, the most likely token at each position)."""
    from nanopaged import SamplingParams

    outs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    logprobs, top = [], []
    for out, seq, start in zip(outs, sequences, starts):
        for pos in range(start, len(seq)):
            entry = out.prompt_logprobs[pos]
            logprobs.append(entry[seq[pos]].logprob)
            top.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return logprobs, top


def accuracy_table(gguf: str, prompts: list[str] = ACCURACY_PROMPTS, tokens: int = ACCURACY_TOKENS) -> dict:
    """Runs both modes on `gguf` (float32) and returns dict(positions, agreement (0..1),
    mean_abs_dlogprob (nats), max_abs_dlogprob, same_free_running (prompts), prompts)."""
    from nanopaged import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results = {}
    for mode in (None, "int8"):
        llm = LLM(gguf, quantization="gguf", activation_quantization=mode, dtype="float32",
                  enable_prefix_caching=False)
        try:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            if mode is None:
                sequences = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]
                starts = [len(o.prompt_token_ids) for o in outs]
            results[mode] = dict(free=[list(o.outputs[0].token_ids) for o in outs],
                                 scores=_scores(llm, sequences, starts))
        finally:
            llm.shutdown()
    (lp_exact, top_exact), (lp_a8, top_a8) = results[None]["scores"], results["int8"]["scores"]
    reference = [t for seq, start in zip(sequences, starts) for t in seq[start:]]
    assert top_exact == reference, "the exact engine's greedy tokens must be its own most likely ones"
    diffs = [abs(a - b) for a, b in zip(lp_a8, lp_exact)]
    return dict(positions=len(reference), prompts=len(prompts),
                agreement=sum(a == r for a, r in zip(top_a8, reference)) / len(reference),
                mean_abs_dlogprob=sum(diffs) / len(diffs), max_abs_dlogprob=max(diffs),
                same_free_running=sum(a == b for a, b in zip(results[None]["free"], results["int8"]["free"])))


def describe(table: dict) -> str:
    """The table as bench.py prints it and chapter 21 quotes it."""
    return (f"greedy agreement {100 * table['agreement']:.1f}% of {table['positions']} positions, "
            f"mean |delta logprob| {table['mean_abs_dlogprob']:.4f} nats (max {table['max_abs_dlogprob']:.3f}), "
            f"same {ACCURACY_TOKENS} free-running greedy ids for {table['same_free_running']} of "
            f"{table['prompts']} prompts")


if __name__ == "__main__":
    from nanopaged.model.model_loader import ensure_default_gguf

    print(describe(accuracy_table(str(ensure_default_gguf(progress=False)))))
