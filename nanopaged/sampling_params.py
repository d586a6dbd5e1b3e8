"""SamplingParams: how one request wants its tokens chosen and when to stop.

This is the user-facing half of sampling; the batched math lives in sampler.py.
Names, meanings and defaults follow vLLM's `vllm/sampling_params.py` so that code
written against vLLM's offline API runs here unchanged:

    SamplingParams(temperature=0.0, max_tokens=32)   # greedy
    SamplingParams(temperature=0.8, top_p=0.95, seed=1234)

Every value is checked when the object is built, so a bad request fails before the
engine does any work for it; the error names the field and the value.
"""
from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

# Below this temperature we sample greedily (argmax), as vLLM does: dividing logits by a
# tiny number would only turn float rounding into randomness.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's `SamplingParams`).

    Args:
        n: number of completions for this request (parallel sampling). The n sequences
            share the prompt's KV blocks and copy a shared block before writing into it
            (copy-on-write); each draws from its own random stream.
        temperature: >= 0. 0 means greedy (argmax). Logits are divided by it.
        top_p: nucleus sampling, in (0, 1]: keep the smallest set of tokens whose
            probability sums to at least top_p (always at least one token).
        top_k: keep the k most likely tokens; 0 or -1 means no top-k filter (vLLM).
        seed: if set, this request draws from its own random generator, so it gets
            the same tokens whatever else shares the batch.
        max_tokens: most tokens to generate (>= 1).
        stop_token_ids: extra token ids that end the sequence. As in vLLM, the stop
            token stays in `token_ids`, and in `text` too unless it is a special token.
        ignore_eos: keep generating past the end-of-sequence token (for benchmarks).

    Raises:
        ValueError: a value out of range; the message names the field and the value.
        TypeError: an unknown keyword (raised by the dataclass constructor).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop: list | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    allowed_token_ids: list | None = None
    bad_words: list | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop_ids: frozenset[int] = field(init=False, repr=False, default=frozenset())

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {rule}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not _is_real(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 or 0 (no filter) or a positive integer")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", self.seed, "an integer or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                    _is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids (ints >= 0)")
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "a bool")
        self._stop_ids = frozenset(self.stop_token_ids or ())

    def update_from_tokenizer(self, tokenizer, eos):
        return copy.copy(self)

    def check_against_vocab(self, v):
        pass

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax token every step."""
        return self.temperature < _GREEDY_EPS

    @property
    def stop_ids(self) -> frozenset[int]:
        """`stop_token_ids` as a set, for the per-token stop check."""
        return self._stop_ids


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)
