"""RequestOutput and CompletionOutput: what the engine hands back, in vLLM's shapes.

`LLMEngine.step()` returns a RequestOutput for every request that made progress that
step (what each holds depends on SamplingParams.output_kind: everything so far, only
what is new, or only the final one); `LLM.generate` returns the final one of each
request, in input order. The OutputProcessor (output_processor.py) builds them.
vLLM: `vllm/outputs.py`, `vllm/logprobs.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's `Logprob`).

    Attributes:
        logprob: natural log of its probability under the raw model distribution.
        rank: its rank in that distribution (1 = the most likely), or None if unknown.
        decoded_token: the token decoded on its own (may hold U+FFFD for part of a
            multi-byte character), or None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request (in DELTA mode: what is new in it since its last output).

    Attributes:
        index: which of the request's n completions this is (0..n-1; for beam search,
            the hypothesis' rank, best first).
        text: the generated text (special tokens skipped unless skip_special_tokens=False;
            cut before a matched stop string; while running, the last len(longest stop
            string) - 1 characters are held back).
        token_ids: the generated token ids (a stop token, if any, included).
        finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens,
            max_model_len or the KV pool's size), "abort", or None while running.
        cumulative_logprob: sum of the sampled tokens' logprobs so far (None unless
            logprobs were asked for; always set for beam search).
        logprobs: one dict per token in token_ids, token id -> Logprob: the sampled token
            with its own rank and the top-k with ranks 1..k; None unless asked for.
        stop_reason: what stopped it: the stop_token_ids id (int) or the stop string
            (str) that did; None for an eos, length, abort, or still running (vLLM's).
        score: a beam hypothesis' length-penalised score (beam search only).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    score: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the id it was added with.
        prompt: the prompt text (None when it was given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: its CompletionOutputs, in index order (in DELTA mode only those that
            changed).
        finished: True once every completion has finished.
        prompt_logprobs: one entry per prompt token: None for the first (nothing predicts
            it), then token id -> Logprob for the prompt token and the top-k; None unless
            asked for (in DELTA mode, given once, with the first output).
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0


@dataclass
class BeamSearchSequence:
    """A finished hypothesis: tokens = prompt + generated ids."""

    tokens: list[int]
    cum_logprob: float
    text: str = ""
    score: float = 0.0           # cum_logprob / generated_len ** length_penalty
    finish_reason: str = "stop"  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """One prompt's result: its best hypotheses, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
