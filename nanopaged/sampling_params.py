"""SamplingParams: how one request wants its tokens chosen and when to stop.

This is the user-facing half of sampling; the batched math lives in sampler.py.
Names, meanings and defaults follow vLLM's `vllm/sampling_params.py` so that code
written against vLLM's offline API runs here unchanged:

    SamplingParams(temperature=0.0, max_tokens=32)   # greedy
    SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    SamplingParams(repetition_penalty=1.2, stop=["\\n\\n"], logprobs=5)
    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))

Every value is checked when the object is built, so a bad request fails before the
engine does any work for it; the error names the field and the value. Two checks need
the model and the tokenizer, so the engine's Processor runs them when the request
arrives: `check_against_vocab` (token ids in range) and `update_from_tokenizer` (which
turns bad words into token ids and settles which ids end a sequence).
"""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

from .utils.checks import check_int, check_text, invalid, is_int, is_list_of, is_real

# Below this temperature we sample greedily (argmax), as vLLM does: dividing logits by a
# tiny number would only turn float rounding into randomness.
_GREEDY_EPS = 1e-5
# vLLM (its OpenAI layer) clamps logit_bias values to OpenAI's documented range.
_MAX_LOGIT_BIAS = 100.0
# OpenAI's range for presence_penalty and frequency_penalty, which vLLM also enforces.
_MAX_OPENAI_PENALTY = 2.0
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


@dataclass(kw_only=True)
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's `StructuredOutputsParams`).

    Set exactly one of:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value
            that validates against it.
        regex: a regular expression (Rust `regex` syntax, as llguidance reads it): the
            whole output matches it.
        choice: a non-empty list of str: the output is exactly one of them.
        grammar: a context-free grammar, in Lark syntax (`start: ...`) or llama.cpp's
            GBNF / EBNF (`root ::= ...`).
        json_object: True: any JSON object (the OpenAI server's `json_object`).
    and optionally, for json / json_object:
        disable_any_whitespace: no whitespace at all between JSON tokens (compact
            JSON). By default a bounded run is allowed there: up to 4 spaces, or one
            line break and up to 32 spaces of indent (vLLM allows any run, which a
            small model may fill with newlines until max_tokens: see
            structured_output.DEFAULT_JSON_WHITESPACE).
        whitespace_pattern: a regex the whitespace between JSON tokens must match
            instead (e.g. r"[ ]?", or vLLM's r"[ \t\n\r]*"); overrides
            disable_any_whitespace.

    The engine compiles the constraint with llguidance (structured_output/manager.py)
    and masks every token that would leave the language before each sampling step.
    Here only the shape is checked; whether a schema, regex or grammar compiles is
    checked when the request is added (Processor), before any generation.

    Raises:
        ValueError: none or several kinds set, or a value of the wrong type; the
            message names the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema (a dict or its JSON "
                             f"text), got {type(self.json).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if not is_list_of(self.choice, lambda c: isinstance(c, str)) or not self.choice:
                raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list of str, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("json", "regex", "choice", "grammar", "whitespace_pattern"):
            check_text(f"StructuredOutputsParams.{name}", getattr(self, name))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutputsParams.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("StructuredOutputsParams.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a streamed request holds (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0   # everything generated so far
    DELTA = 1        # only what is new since the last output
    FINAL_ONLY = 2   # nothing until the request finishes, then everything


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's `SamplingParams`); keyword arguments only.

    Args:
        n: number of completions for this request (parallel sampling). The n sequences
            share the prompt's KV blocks and copy a shared block before writing into it
            (copy-on-write); each draws from its own random stream.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token that
            already appears in the *output* (not the prompt). > 0 favours new tokens.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the output.
        repetition_penalty: > 0; for every token in the prompt *or* the output, a
            positive logit is divided by it and a negative one multiplied (the CTRL
            paper's rule, as transformers' RepetitionPenaltyLogitsProcessor). 1 = off.
        temperature: >= 0. 0 means greedy (argmax). Logits are divided by it.
        top_p: nucleus sampling, in (0, 1]: keep the smallest set of tokens whose
            probability sums to at least top_p (always at least one token).
        top_k: keep the k most likely tokens; 0 or -1 means no top-k filter (vLLM).
        min_p: in [0, 1]; drop tokens whose probability is below min_p times the most
            likely token's. 0 = off.
        seed: if set, this request draws from its own random generator, so it gets
            the same tokens whatever else shares the batch. Any int64 (-2**63 <= seed
            < 2**63, so -1 is allowed: torch.Generator.manual_seed takes it). Note that
            torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so on
            CPU seeds that agree mod 2**32 give the same stream; CUDA's uses all 64.
        stop: strings that end the sequence when they appear in the text (a str or a
            list of non-empty str; stored as a list). The string is cut from the
            output unless include_stop_str_in_output.
        stop_token_ids: extra token ids that end the sequence. As in vLLM, the stop
            token stays in `token_ids`, and in `text` too unless it is a special token.
        bad_words: words that must never be generated (a list of non-empty str);
            turned into token ids by update_from_tokenizer.
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating past the end-of-sequence token (for benchmarks).
        max_tokens: most tokens to generate (>= 1), or None: up to max_model_len
            (the Processor resolves it to an int).
        min_tokens: >= 0, <= max_tokens; stop_token_ids (and the eos ids, once the
            Processor has called update_from_tokenizer) cannot be sampled before this
            many tokens are generated; as in vLLM, stop strings are not looked for
            before then either (the detokenizer's check, not the sampler's).
        logprobs: None, or k >= 0: return the log-probability of each sampled token and
            of the k most likely ones. vLLM's -1 (the whole vocabulary) is not supported.
        prompt_logprobs: None, or k >= 0: the same for every prompt token.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: put spaces around special tokens in the text.
        logit_bias: token id -> a number added to its logit every step; values are
            clamped to [-100, 100] as vLLM does.
        allowed_token_ids: a non-empty list; only these tokens can be sampled.
        output_kind: a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY).
        structured_outputs: a StructuredOutputsParams, or None: the output must follow
            a JSON schema, regex, choice or grammar (constrained decoding). The request
            ends with finish_reason "stop" when the constraint is complete; if
            max_tokens comes first it ends with "length" and the text is cut off
            mid-structure (not valid JSON, say), as in vLLM.

    Raises:
        ValueError: a value out of range; the message names the field and the value.
        TypeError: an unknown keyword (raised by the dataclass constructor).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by update_from_tokenizer (the engine's Processor), derived from the above.
    # _all_stop_token_ids: the ids min_tokens holds back (stop_token_ids, plus the eos
    # ids unless ignore_eos). _bad_words_token_ids: None until bad_words are tokenized.
    _all_stop_token_ids: frozenset[int] = field(init=False, repr=False, compare=False,
                                                default=frozenset())
    _bad_words_token_ids: list[list[int]] | None = field(init=False, repr=False, compare=False,
                                                         default=None)
    _stop_ids: frozenset[int] = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return invalid(f"SamplingParams.{name}", value, rule)

        check_int("SamplingParams.n", self.n, minimum=1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -_MAX_OPENAI_PENALTY <= value <= _MAX_OPENAI_PENALTY:
                raise bad(name, value, "a number in [-2, 2]")
        if not is_real(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        if not is_real(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        check_int("SamplingParams.top_k", self.top_k, minimum=-1,
                  rule="-1 or 0 (no filter) or a positive integer")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "a number in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            raise bad("seed", self.seed, "None or an integer in [-2**63, 2**63) (int64)")
        if self.stop is not None:
            stop = [self.stop] if isinstance(self.stop, str) else self.stop
            if not is_list_of(stop, lambda s: isinstance(s, str) and s != ""):
                raise bad("stop", self.stop, "a non-empty str or a list of them")   # as the user gave it
            self.stop = list(stop)
            check_text("stop", self.stop)
        for name in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None:
                if not is_list_of(value, lambda t: is_int(t) and t >= 0):
                    raise bad(name, value, "a list of token ids (ints >= 0)")
                setattr(self, name, list(value))
        if self.allowed_token_ids == []:
            raise bad("allowed_token_ids", self.allowed_token_ids, "None or a non-empty list")
        if self.bad_words is not None:
            if not is_list_of(self.bad_words, lambda w: isinstance(w, str) and w.strip() != ""):
                raise bad("bad_words", self.bad_words, "a list of str with a non-space character each")
            self.bad_words = list(self.bad_words)
            check_text("bad_words", self.bad_words)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "a bool")
        if self.max_tokens is not None:
            check_int("SamplingParams.max_tokens", self.max_tokens, minimum=1, rule="None or an integer >= 1")
        check_int("SamplingParams.min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value == -1 and is_int(value):
                raise bad(name, value, "None or an integer >= 0 (-1, vLLM's 'whole vocabulary', "
                                       "is not supported here)")
            if value is not None:
                check_int(f"SamplingParams.{name}", value, minimum=0, rule="None or an integer >= 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(t) and t >= 0 and is_real(b) for t, b in self.logit_bias.items()):
                raise bad("logit_bias", self.logit_bias, "a dict of token id (int >= 0) -> number")
            self.logit_bias = {t: min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(b)))
                               for t, b in self.logit_bias.items()}
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        self._stop_ids = self._all_stop_token_ids = frozenset(self.stop_token_ids or ())

    def check_against_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id this request names is outside [0, vocab_size),
        or if it asks for more logprobs than the vocabulary has. The Processor calls it
        with the model's vocab size; the message names the field and the id."""
        def check(name: str, ids) -> None:
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"SamplingParams.{name} holds token id {t!r}, outside the "
                                     f"model's vocabulary [0, {vocab_size})")

        check("stop_token_ids", self.stop_token_ids or ())
        check("allowed_token_ids", self.allowed_token_ids or ())
        check("logit_bias", (self.logit_bias or {}).keys())
        check("bad_words", (t for ids in self._bad_words_token_ids or () for t in ids))
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > vocab_size:
                raise ValueError(f"SamplingParams.{name} must be <= the vocab size "
                                 f"({vocab_size}), got {getattr(self, name)!r}")

    def update_from_tokenizer(self, tokenizer, eos_token_ids: frozenset[int]) -> "SamplingParams":
        """A copy with the tokenizer-dependent private fields filled in.

        `_all_stop_token_ids` becomes stop_token_ids plus `eos_token_ids` (unless
        ignore_eos). Each bad word is encoded (`add_special_tokens=False`) without and
        with a leading space, so it is banned both at the start of the text and after a
        space; the spaced form is kept only when it is a different token sequence of the
        same length whose first token differs (vLLM's rule: a tokenizer that spells the
        space as a token of its own would otherwise ban what follows a bare space).
        Duplicates are dropped. `self` is not changed.
        """
        new = copy.copy(self)
        stop = frozenset(self.stop_token_ids or ())
        new._all_stop_token_ids = stop if self.ignore_eos else stop | frozenset(eos_token_ids)
        if self.bad_words is None:
            return new
        new._bad_words_token_ids = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            variants = [plain]
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                variants.append(spaced)
            new._bad_words_token_ids += [v for v in variants if v not in new._bad_words_token_ids]
        return new

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax token every step."""
        return self.temperature < _GREEDY_EPS

    @property
    def stop_ids(self) -> frozenset[int]:
        """`stop_token_ids` as a set, for the per-token stop check."""
        return self._stop_ids

    @property
    def needs_token_counts(self) -> bool:
        """True when a penalty is on, so the sampler must count this sequence's tokens."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class BeamSearchParams:
    """Beam-search settings (vLLM's name and fields).

    Args:
        beam_width: beams kept each step (>= 1).
        max_tokens: most tokens generated (>= 1).
        ignore_eos: do not end hypotheses at EOS.
        length_penalty: hypothesis score = cum_logprob / generated_len ** length_penalty.

    Raises:
        ValueError: a value out of range, naming the field.
    """

    beam_width: int = 4
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            check_int(f"BeamSearchParams.{name}", getattr(self, name), minimum=1)
        if not is_real(self.length_penalty, finite=False):
            raise invalid("BeamSearchParams.length_penalty", self.length_penalty, "a number")
