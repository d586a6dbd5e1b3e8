"""Serving one OpenAI request on AsyncLLM: completions and chat, whole or streamed.

Every request is one `engine.generate(prompt, params, request_id)` in DELTA mode: each
RequestOutput holds only what is new per completion index. A whole response adds the
deltas up per index; a streamed one turns each delta into one SSE chunk
(`data: {json}\\n\\n`), then the usage chunk if asked, then `data: [DONE]`.
The first output is awaited before the response starts, so a request the Processor
refuses (ValueError / TypeError on the first `__anext__`) is still a clean 400, not a
broken stream. Leaving the generator early aborts the request in the core: a streamed
response is cancelled by Starlette when the client goes away, a whole one by
`cancel_on_disconnect`. Latencies go to the app's ServerMetrics.
vLLM: `vllm/entrypoints/openai/serving_completion.py`, `serving_chat.py`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from ...utils.proc import EngineDeadError
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                       ChatLogProbs, ChatResponseMessage, ChatTokenLogprob, CompletionChoice,
                       CompletionLogProbs, CompletionResponse, DeltaMessage, TopLogprob, UsageInfo,
                       error_body)

logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")
_MIN_LOGPROB = -9999.0     # OpenAI's JSON stand-in for -inf (as vLLM clamps)


async def start(engine, metrics, prompt, params, request_id: str, **kwargs):
    """Start a request and wait for its first output; kwargs: the extra keywords of
    engine.generate that the request's model asks for (server_features.model_kwargs).

    Returns (first RequestOutput, the generator for the rest). The generator records
    TTFT, inter-token and end-to-end latency in `metrics` (seconds).

    Raises:
        ValueError, TypeError: the engine's Processor refused the request (nothing queued).
        EngineDeadError: the engine core is gone.
    """
    arrival = time.monotonic()
    gen = engine.generate(prompt, params, request_id, **kwargs)
    first = await gen.__anext__()
    now = time.monotonic()
    metrics.ttft.observe(now - arrival)
    metrics.prompt_tokens.inc(len(first.prompt_token_ids))

    async def rest():
        last = now
        try:
            if not first.finished:
                async for out in gen:
                    t = time.monotonic()
                    metrics.itl.observe(t - last)
                    last = t
                    yield out
            metrics.e2e.observe(last - arrival)
        finally:
            await gen.aclose()        # early exit: aborts the request in the core

    return first, rest()


@dataclass
class _Choice:
    """What one completion index has produced so far."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list = field(default_factory=list)      # [(token_id, {id: Logprob})]


def _absorb(choices: dict[int, _Choice], out) -> None:
    for c in out.outputs:
        ch = choices.setdefault(c.index, _Choice())
        ch.text += c.text
        ch.num_tokens += len(c.token_ids)
        ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        if c.logprobs is not None:
            ch.logprobs += list(zip(c.token_ids, c.logprobs))


async def _gather(first, rest) -> tuple[dict[int, _Choice], list | None]:
    """A whole response's deltas added up per completion index, and the prompt's
    logprobs (prompt_logprobs_json; None unless asked for)."""
    choices: dict[int, _Choice] = {}
    prompt = None
    async with aclosing(_outputs(first, rest)) as outputs:
        async for out in outputs:
            _absorb(choices, out)
            if out.prompt_logprobs is not None:      # in DELTA mode, the new ones (all with the first)
                prompt = (prompt or []) + prompt_logprobs_json(out.prompt_logprobs)
    return choices, prompt


def _usage(first, choices: dict[int, _Choice]) -> UsageInfo:
    prompt = len(first.prompt_token_ids)
    completion = sum(c.num_tokens for c in choices.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _token_str(tokenizer, token_id: int, lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


def completion_logprobs(tokenizer, pairs, text_offset: int) -> CompletionLogProbs:
    """The legacy completions format of [(token_id, {id: Logprob})]: the sampled token,
    its logprob, and the top-k (plus the sampled token) as {token text: logprob};
    text_offset: characters of generated text before the first of these tokens."""
    out = CompletionLogProbs()
    for token_id, top in pairs:
        s = _token_str(tokenizer, token_id, top[token_id])
        out.text_offset.append(text_offset)
        text_offset += len(s)
        out.tokens.append(s)
        out.token_logprobs.append(max(top[token_id].logprob, _MIN_LOGPROB))
        out.top_logprobs.append({_token_str(tokenizer, i, lp): max(lp.logprob, _MIN_LOGPROB)
                                 for i, lp in sorted(top.items(), key=lambda kv: kv[1].rank or 0)})
    return out


def prompt_logprobs_json(prompt_logprobs) -> list[dict[int, dict] | None]:
    """vLLM's prompt_logprobs of [None | {id: Logprob}]: per prompt token None (the first:
    nothing predicts it) or token id -> {logprob, rank, decoded_token}, the prompt token
    and the top-k (-inf as -9999.0, as vLLM's clamp_prompt_logprobs)."""
    return [None if top is None else {i: {"logprob": max(lp.logprob, _MIN_LOGPROB), "rank": lp.rank,
                                          "decoded_token": lp.decoded_token} for i, lp in top.items()}
            for top in prompt_logprobs]


def chat_logprobs(tokenizer, pairs, top_k: int) -> ChatLogProbs:
    """The chat format of [(token_id, {id: Logprob})]: per token its text, logprob, UTF-8
    bytes, and the top_k most likely tokens (rank 1..top_k)."""
    content = []
    for token_id, top in pairs:
        s = _token_str(tokenizer, token_id, top[token_id])
        ranked = sorted((lp.rank, i, lp) for i, lp in top.items() if lp.rank is not None and lp.rank <= top_k)
        content.append(ChatTokenLogprob(
            token=s, logprob=max(top[token_id].logprob, _MIN_LOGPROB), bytes=list(s.encode()),
            top_logprobs=[TopLogprob(token=(t := _token_str(tokenizer, i, lp)), bytes=list(t.encode()),
                                     logprob=max(lp.logprob, _MIN_LOGPROB)) for _, i, lp in ranked]))
    return ChatLogProbs(content=content)


# ---- the HTTP side ------------------------------------------------------------

class ClientGone(Exception):
    """The client disconnected before its response started; nobody reads the answer."""


async def cancel_on_disconnect(request: Request, coro):
    """Run coro; cancel it (which aborts its engine request) if the client disconnects
    first. As vLLM's `with_cancellation` (vllm/entrypoints/utils.py)."""
    work = asyncio.ensure_future(coro)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    try:
        return await work
    except asyncio.CancelledError:
        if watch.done() and not watch.cancelled():
            raise ClientGone() from None
        raise


class ShuttingDown(Exception):
    """The server stopped before this request finished (it ran past --shutdown-timeout
    and was aborted): a 503, or a stream's last error event."""


DEAD_ENGINE_MESSAGE = "the engine core has died"     # the cause goes to the log, not to clients


def error_for_client(e: Exception) -> tuple[int, str]:
    """(HTTP status, message) a client is told for an exception raised while serving
    its request: never a traceback or a file path (those go to the server's log)."""
    if isinstance(e, ShuttingDown):
        return 503, str(e)
    if isinstance(e, EngineDeadError):
        return 500, DEAD_ENGINE_MESSAGE
    if isinstance(e, (ValueError, TypeError)):        # the request's fault, said by our checks
        return 400, str(e)
    return 500, f"internal server error ({type(e).__name__})"


async def guarded_stream(lines):
    """The SSE lines; an error after the stream started becomes an error event, then
    `data: [DONE]`."""
    try:
        async for line in lines:
            yield line
    except Exception as e:      # the status line has gone: say it in the stream, as vLLM does
        if not isinstance(e, (ShuttingDown, EngineDeadError)):    # those are logged once, by the launcher
            logger.exception("error while streaming")
        status, message = error_for_client(e)
        yield f"data: {json.dumps(error_body(status, message))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await lines.aclose()


# ---- whole responses ----------------------------------------------------------

async def full_completion(tokenizer, first, rest, request_id: str, model: str, want_logprobs: bool):
    """The whole CompletionResponse: the deltas added up per completion index; each
    choice has the prompt's logprobs, when asked for (as vLLM's)."""
    choices, prompt = await _gather(first, rest)
    return CompletionResponse(id=request_id, model=model, usage=_usage(first, choices), choices=[
        CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                         logprobs=completion_logprobs(tokenizer, c.logprobs, 0) if want_logprobs else None,
                         prompt_logprobs=prompt)
        for i, c in sorted(choices.items())])


async def full_chat(tokenizer, first, rest, request_id: str, model: str, top_logprobs: int | None):
    """The whole ChatCompletionResponse (top_logprobs None: no logprobs asked for), with
    the prompt's logprobs when asked for (as vLLM's)."""
    choices, prompt = await _gather(first, rest)
    return ChatCompletionResponse(id=request_id, model=model, usage=_usage(first, choices), choices=[
        ChatChoice(index=i, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                   stop_reason=c.stop_reason,
                   logprobs=chat_logprobs(tokenizer, c.logprobs, top_logprobs)
                   if top_logprobs is not None else None)
        for i, c in sorted(choices.items())], prompt_logprobs=prompt)


# ---- streams ------------------------------------------------------------------

def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _outputs(first, rest):
    """first, then the rest; closing this closes `rest` (which aborts the request)."""
    try:
        yield first
        async for out in rest:
            yield out
    finally:
        await rest.aclose()


async def stream_completion(tokenizer, first, rest, request_id: str, model: str,
                            want_logprobs: bool, include_usage: bool):
    """SSE lines of a streamed completion: one chunk per delta per index."""
    choices: dict[int, _Choice] = {}
    created = int(time.time())
    async with aclosing(_outputs(first, rest)) as outputs:
        async for out in outputs:
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                offset = len(choices[c.index].text) if c.index in choices else 0
                lp = (completion_logprobs(tokenizer, list(zip(c.token_ids, c.logprobs or [])), offset)
                      if want_logprobs else None)
                yield _sse(CompletionResponse(id=request_id, created=created, model=model, choices=[
                    CompletionChoice(index=c.index, text=c.text, logprobs=lp,
                                     finish_reason=c.finish_reason, stop_reason=c.stop_reason)]))
            _absorb(choices, out)
    if include_usage:
        yield _sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                      usage=_usage(first, choices)))
    yield "data: [DONE]\n\n"


async def stream_chat(tokenizer, first, rest, request_id: str, model: str, n: int,
                      top_logprobs: int | None, include_usage: bool):
    """SSE lines of a streamed chat: per index a first chunk with role "assistant", then
    one chunk per content delta, the last with its finish_reason."""
    choices: dict[int, _Choice] = {}
    created = int(time.time())

    def chunk(choice):
        return _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]))

    async with aclosing(_outputs(first, rest)) as outputs:
        for i in range(n):
            yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for out in outputs:
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                lp = (chat_logprobs(tokenizer, list(zip(c.token_ids, c.logprobs or [])), top_logprobs)
                      if top_logprobs is not None else None)
                yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.text), logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            _absorb(choices, out)
    if include_usage:
        yield _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                       usage=_usage(first, choices)))
    yield "data: [DONE]\n\n"
