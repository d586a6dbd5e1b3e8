"""The server's routes: the OpenAI API, /health and /metrics (a feature's own come with
it: server_features.py). Each reads what it serves from `request.app.state` (engine,
served_model_name, lifecycle, metrics, server_features: set by api_server.build_app).
vLLM: the `router` of `vllm/entrypoints/openai/api_server.py`.
"""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from ...utils.proc import EngineDeadError
from . import serving
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, OpenAIError, random_id
from .server_features import feature_model_cards, model_kwargs

logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")
router = APIRouter()


def _model_name(request: Request, body) -> str:
    """The name a response carries: the `model` the request named (the base model's or
    one a server feature serves), else the base model's (vLLM's
    OpenAIServingModels.model_name)."""
    return body.model or request.app.state.served_model_name


async def _run(request: Request, body, prompt, params_fn, prefix: str, respond):
    """Start the request (an error before any byte is sent is a 4xx/5xx), then answer
    it whole or as a stream: respond(first, rest, request_id, stream). Its `model` picks
    the base model or one a server feature serves (server_features.model_kwargs)."""
    state = request.app.state
    kwargs = model_kwargs(state.server_features, state.served_model_name, body.model)
    if kwargs is None:
        raise OpenAIError(404, f"The model `{body.model}` does not exist.", "model", "model_not_found")
    if state.engine.errored:
        raise OpenAIError(500, serving.DEAD_ENGINE_MESSAGE)
    if state.lifecycle.draining:
        raise OpenAIError(503, "the server is shutting down")
    request_id = random_id(prefix)
    try:
        first, rest = await serving.cancel_on_disconnect(
            request, serving.start(state.engine, state.metrics, prompt(), params_fn(), request_id, **kwargs))
    except (ValueError, TypeError, EngineDeadError, serving.ShuttingDown) as e:
        raise OpenAIError(*serving.error_for_client(e)) from None
    if body.stream:
        lines = serving.guarded_stream(respond(first, rest, request_id, stream=True))
        return StreamingResponse(lines, media_type="text/event-stream", background=BackgroundTask(lines.aclose))
    try:
        return await serving.cancel_on_disconnect(request, respond(first, rest, request_id, stream=False))
    except (EngineDeadError, serving.ShuttingDown) as e:
        raise OpenAIError(*serving.error_for_client(e)) from None


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    """OpenAI's completions (vLLM: serving_completion.py)."""
    tokenizer, name = request.app.state.engine.tokenizer, _model_name(request, body)
    usage = body.stream_options is not None and body.stream_options.include_usage

    def respond(first, rest, rid, stream):
        if stream:
            return serving.stream_completion(tokenizer, first, rest, rid, name, body.logprobs is not None, usage)
        return serving.full_completion(tokenizer, first, rest, rid, name, body.logprobs is not None)
    return await _run(request, body, body.single_prompt, body.to_sampling_params, "cmpl", respond)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """OpenAI's chat completions; the chat template makes the prompt (vLLM: serving_chat.py)."""
    tokenizer, name = request.app.state.engine.tokenizer, _model_name(request, body)
    usage = body.stream_options is not None and body.stream_options.include_usage
    top = (body.top_logprobs or 0) if body.logprobs else None

    def respond(first, rest, rid, stream):
        if stream:
            return serving.stream_chat(tokenizer, first, rest, rid, name, body.n, top, usage)
        return serving.full_chat(tokenizer, first, rest, rid, name, top)
    return await _run(request, body, lambda: body.prompt_token_ids(tokenizer), body.to_sampling_params,
                      "chatcmpl", respond)


@router.get("/v1/models")
async def list_models(request: Request):
    """The base model, then the models the server's features serve (their `parent`: the
    base model)."""
    state = request.app.state
    base = ModelCard(id=state.served_model_name, root=str(state.engine.model_path),
                     max_model_len=state.engine.config.max_model_len)
    return ModelList(data=[base] + [ModelCard(**card) for card in
                                    feature_model_cards(state.server_features, state.served_model_name)])


@router.get("/health")
async def health(request: Request):
    """200, or 503 when the core is dead, silent past --health-timeout, or draining;
    answers at once, from the core's last sign of life (launcher.Lifecycle)."""
    problem = request.app.state.lifecycle.health_problem()
    if problem is not None:
        logger.warning("/health: 503: %s", problem)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/metrics")
async def get_metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
