"""The OpenAI wire format: pydantic models of requests and responses, and their mapping
to SamplingParams.

A request body is parsed into `CompletionRequest` or `ChatCompletionRequest` (a wrong
type or a missing field is a pydantic ValidationError, which api_server.py answers with an
OpenAI-style 400); `to_sampling_params` turns it into the engine's SamplingParams, whose
own checks (negative max_tokens, temperature < 0, ...) raise ValueError naming the field.
Fields OpenAI has and we do not model are accepted and ignored, as vLLM ignores them
(with a warning in the log); vLLM's own fields the engine cannot honour (best_of,
use_beam_search) are a 400 naming them and their value. Responses are built as pydantic
models too, so the official `openai` client parses them.
vLLM: `vllm/entrypoints/openai/protocol.py`.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from ...engine.processor import apply_chat_template, check_chat_template_kwargs
from ...sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")


class OpenAIBaseModel(BaseModel):
    """Accepts unknown fields and logs them, as vLLM's OpenAIBaseModel does."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _warn_extra(self):
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """OpenAI's response_format.json_schema: a name and the schema (strict is accepted;
    the output always follows the schema here)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON
    object) or "json_schema" (a JSON value valid against json_schema.schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(OpenAIBaseModel):
    """The fields completions and chat share (OpenAI's, then vLLM's extra sampling ones)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None          # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None                  # vLLM extension, as are min_p .. bad_words
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None        # vLLM's: the top-k of every prompt token too
    best_of: int | None = None                # vLLM's: None or 1 (its V1 engine has no best-of either)
    use_beam_search: bool = False             # vLLM's: refused, beam search is LLM.beam_search's
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                   # accepted, ignored
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the
    # guided_* fields vLLM had before it (all map onto StructuredOutputsParams)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None     # StructuredOutputsParams' fields
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def _sampling_kwargs(self) -> dict[str, Any]:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be at least n={self.n} (as in vLLM); leave it out")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={self.best_of} is not supported: the engine returns all n completions it "
                             "samples and picks no best among more (vLLM's V1 engine neither); leave it out")
        if self.use_beam_search:
            raise ValueError("use_beam_search=true is not served over HTTP: beam search runs through "
                             "LLM.beam_search")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs} is not available with stream=true (as in vLLM)")
        bias = None
        if self.logit_bias is not None:         # OpenAI's keys are token ids as strings
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (integers as strings), "
                                 f"got {list(self.logit_bias)!r}") from None
        kw = dict(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                  structured_outputs=self._structured_outputs(),
                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                  logit_bias=bias, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                  bad_words=self.bad_words, prompt_logprobs=self.prompt_logprobs,
                  skip_special_tokens=self.skip_special_tokens, output_kind=RequestOutputKind.DELTA)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The request's constraint, from whichever field gave it. Raises ValueError for
        a json_schema response_format without a schema, or for constraints given twice
        (say response_format and guided_regex: StructuredOutputsParams names them)."""
        kw: dict[str, Any] = {}
        given: list[str] = []

        def put(source: str, key: str, value) -> None:
            if value is not None and value is not False:
                given.append(source)
                kw[key] = value

        for key, value in (self.structured_outputs or {}).items():
            if key in ("json", "regex", "choice", "grammar", "json_object"):
                put(f"structured_outputs.{key}", key, value)
            else:                   # the options, or an unknown key: StructuredOutputsParams says
                kw[key] = value
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            put("response_format", "json_object", True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format: type 'json_schema' needs json_schema.schema")
            put("response_format", "json", rf.json_schema.schema_)
        for key in ("json", "regex", "choice", "grammar"):
            put(f"guided_{key}", key, getattr(self, f"guided_{key}"))
        if self.guided_whitespace_pattern is not None:
            kw["whitespace_pattern"] = self.guided_whitespace_pattern
        if not given and not kw:
            return None
        if len(given) > 1:
            raise ValueError(f"structured outputs given more than once ({', '.join(given)}): set one of them")
        try:
            return StructuredOutputsParams(**kw)
        except TypeError as e:      # an unknown key of structured_outputs
            raise ValueError(f"structured_outputs: {e}") from None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a str, a list of token ids, or a list holding one
    of those (a batch of several prompts is refused with a 400)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16               # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request. Raises ValueError for a batch or echo/suffix."""
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"prompt: a batch of {len(p)} prompts is not supported; "
                                 "send one prompt per request")
            p = p[0]
        return p

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams in DELTA mode. Raises ValueError naming a bad field."""
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs,
                              **self._sampling_kwargs())


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; OpenAI's list of content parts may hold text parts only."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("messages: only text content parts are supported")
        texts = [part.get("text", "") for part in self.content]
        for t in texts:
            if not isinstance(t, str):
                raise ValueError(f"messages: a text content part's text must be a str, got {t!r:.60}")
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. max_tokens (or max_completion_tokens) None = up to
    max_model_len, as OpenAI's and vLLM's chat default."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extension: extra variables for the chat template, e.g. {"enable_thinking":
    # false} for Qwen3 (the openai client sends it as extra_body={"chat_template_kwargs": ...})
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v):
        check_chat_template_kwargs(v)       # a key the engine sets: ValueError, so a 400 naming it
        return v

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them ({"role", "content"} dicts)."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def prompt_token_ids(self, tokenizer) -> list[int]:
        """The prompt: the chat template over the messages, with chat_template_kwargs
        (vLLM renders it in the front end too: serving_chat.py). Raises ValueError for a
        message that is not text."""
        return apply_chat_template(tokenizer, self.chat(), self.chat_template_kwargs)

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams in DELTA mode (logprobs = top_logprobs, 0 if only logprobs=true).
        Raises ValueError naming a bad field."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(max_tokens=max_tokens,
                              logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                              **self._sampling_kwargs())


# ---- responses ---------------------------------------------------------------

def random_id(prefix: str) -> str:
    """An id as OpenAI's look: `cmpl-<32 hex>`, `chatcmpl-<32 hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    """The legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None        # vLLM's extra: the stop token id or string
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None     # vLLM's extra

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):      # left out unless asked for: a stream's chunks never have it
        return {k: v for k, v in handler(self).items() if k != "prompt_logprobs" or v is not None}


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None     # vLLM's extra


class DeltaMessage(BaseModel):
    """A chat stream's delta; fields left None are left out, as OpenAI's are."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One model of GET /v1/models; parent: the model it adapts (a LoRA adapter's base
    model), None for the base model itself (vLLM's ModelCard)."""
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanopaged"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """An error answered as OpenAI's JSON body with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON for an HTTP status (type "invalid_request_error" below 500)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()
