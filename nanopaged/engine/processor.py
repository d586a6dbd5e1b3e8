"""Processor: the input side of the engine: user requests in, EngineCoreRequests out.

Everything a request can get wrong is found here, before the core does any work for
it: the prompt is tokenized (or the chat template applied), its token ids and length are
checked against the model, and the SamplingParams against the vocabulary,
max_model_len and the engine's bounds on what one request may cost (n and beam_width
at most max_num_seqs, logprobs at most max_logprobs, a step's logits rows within
max_logits_bytes: tests/engine/test_admission.py). What leaves is tokens and numbers
only; the core never sees a string (but a structured-output spec, a schema or regex,
which it compiles: chapter 18).
vLLM: `vllm/v1/engine/processor.py`; the length rule and its message are vLLM's OpenAI
server's (`serving_engine.py`, `_validate_input`).
"""
from __future__ import annotations

import json
import os
import time

from ..messages import EngineCoreRequest
from ..sampling_params import BeamSearchParams, SamplingParams
from ..utils.checks import check_text, is_int, is_list_of
from ..worker.logits_chunks import LOGIT_BYTES


class Processor:
    """Validates and tokenizes requests for one model.

    Args:
        tokenizer: the model's transformers tokenizer (with its chat template).
        vocab_size: the model's vocabulary size (token ids are in [0, vocab_size)).
        max_model_len: longest sequence, prompt + output, in tokens.
        eos_token_ids: ids that end a sequence (see `eos_token_ids_of`).
        max_num_seqs: most sequences one request may run (n, beam_width); None = no bound.
        max_logprobs: most top logprobs per token (logprobs, prompt_logprobs).
        max_logits_bytes: most bytes of fp32 logits a request's rows of one step may
            take (rows x vocab_size x 4); None = no bound.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 max_num_seqs: int | None = None, max_logprobs: int = 20,
                 max_logits_bytes: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs
        self.max_logits_bytes = max_logits_bytes

    @classmethod
    def from_config(cls, config, model_path, model_config) -> "Processor":
        """The Processor of a resolved EngineConfig's model (arg_utils.create_engine_config):
        reads its tokenizer and eos token ids."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        return cls(tokenizer, model_config.vocab_size, config.max_model_len,
                   eos_token_ids_of(model_path, model_config, tokenizer), config.scheduler_config.max_num_seqs,
                   config.max_logprobs, config.scheduler_config.max_logits_bytes)

    def process_inputs(self, request_id: str, prompt, params,
                       lora_request=None) -> tuple[EngineCoreRequest, str | None]:
        """Build the EngineCoreRequest of one request; also returns the prompt text (None
        when the prompt came as token ids).

        Args:
            request_id: the caller's id (a str).
            prompt: text, a list of token ids, or a chat (a list of {"role", "content"}
                dicts, turned into ids by the tokenizer's chat template).
            params: a SamplingParams (None = SamplingParams()) or a BeamSearchParams.
            lora_request: the LoRA adapter it runs with (a LoRARequest), or None.

        Raises:
            TypeError: a prompt, request_id or params of the wrong type.
            ValueError: an empty prompt; a token id outside the vocabulary; a prompt
                of max_model_len tokens or more (no room for one output token: the rule
                is prompt_len + 1 <= max_model_len, for every path); prompt_len +
                max_tokens > max_model_len (vLLM's rule and message: "This model's
                maximum context length is ..."; max_tokens=None means up to
                max_model_len); a request that costs more than the engine allows:
                n or beam_width > max_num_seqs, logprobs or prompt_logprobs
                > max_logprobs, its rows of logits past max_logits_bytes; a
                SamplingParams field the model cannot honour (a token id outside the
                vocabulary); structured outputs that do not compile (llguidance's
                message, with the position); a lora_request this engine cannot serve
                (`_check_lora_request`). The message names field, value and limit.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if lora_request is not None:
            self._check_lora_request(lora_request)
        text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        params = SamplingParams() if params is None else params
        if isinstance(params, BeamSearchParams):
            self._check_num_seqs("BeamSearchParams.beam_width", params.beam_width)
            params = self._beam_sampling_params(params)
        elif not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams or BeamSearchParams, "
                            f"got {type(params).__name__}")
        else:
            self._check_params(params)
        params = params.update_from_tokenizer(self.tokenizer, self.eos_token_ids)   # a copy
        if params.max_tokens is None:                  # None: up to max_model_len
            params.max_tokens = self.max_model_len - len(prompt_ids)
        self._check_length(len(prompt_ids), params.max_tokens)
        return EngineCoreRequest(request_id, prompt_ids, params, self.eos_token_ids, time.monotonic()), text

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty (''): there is no token to start from")
            check_text("prompt", prompt)
            # verbose=False: no "Token indices sequence length is longer than the specified
            # maximum" from transformers; _check_prompt says it, against our max_model_len
            return prompt, self.tokenizer(prompt, verbose=False).input_ids
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return None, apply_chat_template(self.tokenizer, list(prompt))
        if is_list_of(prompt, is_int):
            return None, list(prompt)
        raise TypeError("prompt must be a str, a list of token ids or a list of chat messages, "
                        f"got {type(prompt).__name__}")

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty (0 token ids): there is no token to start from")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) + 1 > self.max_model_len:       # room for one output token, as vLLM asks
            raise ValueError(f"prompt is {len(ids)} tokens, too long for max_model_len={self.max_model_len}: "
                             f"a prompt may have at most {self.max_model_len - 1} tokens, to leave "
                             f"room for one output token")

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        """vLLM's rule: the prompt and every token asked for fit in max_model_len."""
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. "
                             f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                             f"messages, {max_tokens} in the completion). Please reduce the length of the "
                             f"messages or completion.")

    def _check_num_seqs(self, name: str, rows: int) -> None:
        """A request's `rows` sequences (n, beam_width) fit in one step's batch, and their
        rows of fp32 logits (one per sequence per step) in max_logits_bytes: a request must
        not cost a step more memory than the engine was sized for."""
        if self.max_num_seqs is not None and rows > self.max_num_seqs:
            raise ValueError(f"{name}={rows} is more than max_num_seqs={self.max_num_seqs}: a request's "
                             f"sequences must fit in one step's batch")
        need = rows * self.vocab_size * LOGIT_BYTES
        if self.max_logits_bytes is not None and need > self.max_logits_bytes:
            raise ValueError(f"{name}={rows} needs {rows} rows of fp32 logits a step ({rows} x vocab_size "
                             f"{self.vocab_size} x {LOGIT_BYTES} B = {need} B), more than "
                             f"max_logits_bytes={self.max_logits_bytes}")

    def _check_params(self, params: SamplingParams) -> None:
        params.check_against_vocab(self.vocab_size)
        self._check_num_seqs("SamplingParams.n", params.n)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name}={k} is more than max_logprobs={self.max_logprobs}, "
                                 f"the most top logprobs per token this engine returns")
        if params.structured_outputs is not None:
            self._check_structured_outputs(params.structured_outputs)

    # -- hooks: the per-request features' processors override these (features.py) ------------

    def _beam_sampling_params(self, beam: BeamSearchParams) -> SamplingParams:
        """Hook: the SamplingParams a beam search's rows run with. The base engine has no beam
        search: raises ValueError (beam_search/processor.py gives the rows, and sends the
        request as its BeamSearchRequest)."""
        raise ValueError("BeamSearchParams needs the beam search feature, which is not available "
                         "in this installation (nanopaged/beam_search cannot be imported)")

    def _check_lora_request(self, lora_request) -> None:
        """Hook: raises ValueError when `lora_request` (not None) cannot be served. The base
        engine serves no adapter (lora/processor.py reads and checks the adapter's folder)."""
        raise ValueError(f"lora_request={lora_request!r} needs an engine built with enable_lora=True (and the "
                         "nanopaged/lora package)")

    def _check_structured_outputs(self, spec) -> None:
        """Hook: raises ValueError when `spec` (SamplingParams.structured_outputs) cannot be
        served. The base engine serves none (structured_output/processor.py compiles it)."""
        raise ValueError("SamplingParams.structured_outputs needs the structured outputs feature, which "
                         "is not available in this installation (nanopaged/structured_output cannot be "
                         "imported)")


# apply_chat_template's own arguments: the engine sets them, or they change what the call
# returns, so a request's chat_template_kwargs may not. vLLM refuses `chat_template` and
# `tokenize` (vllm/renderers/hf.py, resolve_chat_template_kwargs) and lets the others
# override request fields of its own (add_generation_prompt, continue_final_message);
# nanopaged has no such fields, so it refuses them all.
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize",
    "chat_template", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs"})


def check_chat_template_kwargs(chat_template_kwargs: dict | None) -> dict:
    """The extra variables a request gives the chat template (vLLM's
    `chat_template_kwargs`, e.g. {"enable_thinking": False} for Qwen3), checked; None is {}.

    Raises:
        TypeError: not a dict (a JSON object), or a key that is not a str.
        ValueError: a key of RESERVED_CHAT_TEMPLATE_KWARGS (named in the message); a
            string that is not valid Unicode.
    """
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict):
        raise TypeError("chat_template_kwargs must be a dict (a JSON object) of chat template "
                        f"variables, got {type(chat_template_kwargs).__name__}")
    for key in chat_template_kwargs:
        if not isinstance(key, str):
            raise TypeError(f"chat_template_kwargs keys must be str, got {key!r}")
        if key in RESERVED_CHAT_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: it is an argument of the "
                             f"engine's own apply_chat_template call, not a template variable "
                             f"(reserved: {', '.join(sorted(RESERVED_CHAT_TEMPLATE_KWARGS))})")
    check_text("chat_template_kwargs", chat_template_kwargs)
    return dict(chat_template_kwargs)


def apply_chat_template(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat with the generation prompt, exactly as the tokenizer's
    `apply_chat_template(tokenize=True, add_generation_prompt=True, **chat_template_kwargs)`
    gives them: the template writes the BOS itself, so nothing adds a second one
    (tests/engine/test_engine_v1_real.py::test_c19_one_bos_with_a_chat_template).
    `chat_template_kwargs` are extra template variables (see
    check_chat_template_kwargs, which raises for a bad one); every front end (the
    Processor, LLM.chat, the server, the REPL) renders a chat here."""
    kwargs = check_chat_template_kwargs(chat_template_kwargs)
    check_text("messages", messages)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    if not isinstance(ids, list):                 # newer transformers: a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def eos_token_ids_of(model_folder, model_config, tokenizer) -> frozenset[int]:
    """Every id that ends a sequence: config.json's eos_token_id, generation_config.json's
    (which may list several, e.g. the eos and a chat end-of-turn id: tests/engine/
    test_engine_v1_real.py::test_c17_several_eos_ids_stop_at_the_first) and the
    tokenizer's eos."""
    ids = list(model_config.eos_token_id)
    path = os.path.join(model_folder, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)
