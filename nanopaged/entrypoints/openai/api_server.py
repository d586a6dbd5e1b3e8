"""An OpenAI-compatible HTTP server: `python -m nanopaged.serve`, on FastAPI + uvicorn.

    python -m nanopaged.serve [--model PATH] [--host 127.0.0.1] [--port 8000]
        [--api-key KEY] [--served-model-name NAME] [--max-body-bytes N]
        [--health-timeout S] [--shutdown-timeout S] [--dashboard-show-text] [--no-dashboard]
        [every EngineConfig field as a flag: --block-size 16 --max-model-len N ...]

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events with "stream": true), GET /health (at once: 200 while the engine core
has been heard from within --health-timeout seconds; 503 when it is dead, silent for
longer, or the server is shutting down), GET /metrics
(Prometheus text, metrics.py), GET /dashboard: a live page of the KV pool and the
scheduler, fed by GET /dashboard/events (serving_dashboard.py; ids and counts only, text
with --dashboard-show-text; off with --no-dashboard), GET /docs (FastAPI's page of the
API, as vLLM's; its scripts come from a CDN). The line "ready on ..." names the pages. The server only turns HTTP into
`AsyncLLM.generate` calls and back (serving.py); the engine core runs in its own
process, so the event loop never waits for a forward pass. Errors are OpenAI's JSON
body {"error": {"message", "type", "param", "code"}}: 400 for a bad request (pydantic's
validation, SamplingParams' and the Processor's checks, invalid JSON), 401 for a
missing or wrong key when --api-key is set (/health and /metrics stay open, as in
vLLM; /dashboard?key=KEY trades the key for a cookie that the page's stream then sends,
since a browser's EventSource cannot send headers: auth.py), 400 for a body that nests
JSON more than 128 deep (utils/checks.py), 404 for an unknown model, 413 for a body over
--max-body-bytes, 500 when the engine died (no traceback: that goes to the log), 503
while the server shuts down. The access log never shows a key (auth.RedactSecrets). A
client that disconnects aborts its request in the core. How the server stops (SIGTERM,
SIGINT, the core's death: exit status 1) is launcher.py's.
vLLM: `vllm/entrypoints/openai/api_server.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import typing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import EngineConfig
from . import auth, launcher, serving
from ...engine.async_llm import HEALTH_TIMEOUT_S, AsyncLLM
from ...utils.checks import check_json_nesting
from ...utils.proc import EngineDeadError
from .metrics import ServerMetrics
from .serving_dashboard import DashboardHub, page_file
from .protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, OpenAIError,
                       error_body, random_id)

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"   # what model=None serves
DEFAULT_MAX_BODY_BYTES = 1 << 20
logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")


async def _send_error(send, status: int, message: str, code: str | None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """ASGI middleware: the API key (on /v1/ paths, the dashboard's page and stream:
    auth.py), the body size limit (413) and the body's nesting depth (400).

    The body is read here, up to max_body_bytes, and replayed to the app, so a client
    that declares no Content-Length (chunked) cannot get past the limit either. Its JSON
    nesting is counted before anything parses it (check_json_nesting): json.loads
    recurses once per level, and a body of 100,000 "[" would be a RecursionError, a 500.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.api_key is not None:
            refused = auth.check_key(scope, headers, self.api_key)      # a 401, or the dashboard's 303
            if refused is not None:
                return await refused(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _send_error(send, 413, f"request body is {int(declared)} bytes, more than "
                                                f"the server's limit of {self.max_body_bytes}",
                                     "request_too_large")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":          # disconnected while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return await _send_error(send, 413, f"request body is more than the server's "
                                                    f"limit of {self.max_body_bytes} bytes",
                                         "request_too_large")
        try:
            check_json_nesting("the request body", b"".join(chunks))
        except ValueError as e:
            return await _send_error(send, 400, str(e), None)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()                      # waits for http.disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def build_app(engine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              health_timeout: float = HEALTH_TIMEOUT_S, dashboard: bool = True,
              dashboard_show_text: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` (an AsyncLLM) under the name `served_model_name`.

    Args:
        api_key: if set, every /v1/ request must send `Authorization: Bearer <api_key>`
            (and /dashboard, /dashboard/events that or the cookie that /dashboard?key=
            sets: auth.py).
        max_body_bytes: larger request bodies get a 413.
        health_timeout: seconds of silence from the core after which GET /health is a 503.
        dashboard: serve GET /dashboard and its stream (False: they are 404s).
        dashboard_show_text: the dashboard shows the requests' prompt and output text.
    """
    app = FastAPI(title="nanopaged", docs_url="/docs", redoc_url=None)     # /docs: Swagger UI, as vLLM
    lifecycle = launcher.Lifecycle(engine, health_timeout)
    hub = DashboardHub(engine, dashboard_show_text) if dashboard else None
    metrics = ServerMetrics(engine, served_model_name, hub)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):      # bytes that are not JSON, 404, 405
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(_, e: Exception):         # Starlette logs the traceback after this answer
        return JSONResponse(error_body(500, f"internal server error ({type(e).__name__})"), status_code=500)

    @app.exception_handler(serving.ClientGone)
    async def _gone(_, e: serving.ClientGone):
        return Response(status_code=499)      # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errors = e.errors()
        bad_json = next((err for err in errors if err.get("type") == "json_invalid"), None)
        if bad_json is not None:
            reason = bad_json.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(400, f"the body is not valid JSON: {reason}"), status_code=400)
        loc = [str(x) for x in errors[0].get("loc", ())[1:]] if errors else []
        message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ())[1:]) or 'body'}: {err.get('msg')}"
                            for err in errors)
        return JSONResponse(error_body(400, message, ".".join(loc) or None), status_code=400)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    async def run(request: Request, body, prompt, params_fn, prefix: str, respond):
        """Start the request (400/500 before any byte is sent), then answer it."""
        check_model(body.model)
        if engine.errored:
            raise OpenAIError(500, serving.DEAD_ENGINE_MESSAGE)
        if lifecycle.draining:
            raise OpenAIError(503, "the server is shutting down")
        request_id = random_id(prefix)
        try:
            first, rest = await serving.cancel_on_disconnect(
                request, serving.start(engine, metrics, prompt(), params_fn(), request_id))
        except (ValueError, TypeError, EngineDeadError, serving.ShuttingDown) as e:
            raise OpenAIError(*serving.error_for_client(e)) from None
        if body.stream:
            lines = serving.guarded_stream(respond(first, rest, request_id, stream=True))
            return StreamingResponse(lines, media_type="text/event-stream",
                                     background=BackgroundTask(lines.aclose))
        try:
            return await serving.cancel_on_disconnect(request, respond(first, rest, request_id, stream=False))
        except (EngineDeadError, serving.ShuttingDown) as e:
            raise OpenAIError(*serving.error_for_client(e)) from None

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        """OpenAI's completions (vLLM: serving_completion.py)."""
        usage = body.stream_options is not None and body.stream_options.include_usage

        def respond(first, rest, rid, stream):
            if stream:
                return serving.stream_completion(engine.tokenizer, first, rest, rid, served_model_name,
                                                 body.logprobs is not None, usage)
            return serving.full_completion(engine.tokenizer, first, rest, rid, served_model_name,
                                           body.logprobs is not None)
        return await run(request, body, body.single_prompt, body.to_sampling_params, "cmpl", respond)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        """OpenAI's chat completions; the chat template makes the prompt (vLLM: serving_chat.py)."""
        usage = body.stream_options is not None and body.stream_options.include_usage
        top = (body.top_logprobs or 0) if body.logprobs else None

        def respond(first, rest, rid, stream):
            if stream:
                return serving.stream_chat(engine.tokenizer, first, rest, rid, served_model_name,
                                           body.n, top, usage)
            return serving.full_chat(engine.tokenizer, first, rest, rid, served_model_name, top)
        return await run(request, body, lambda: body.prompt_token_ids(engine.tokenizer), body.to_sampling_params,
                         "chatcmpl", respond)

    @app.get("/v1/models")
    async def list_models():
        return ModelList(data=[ModelCard(id=served_model_name, root=str(engine.model_path),
                                         max_model_len=engine.config.max_model_len)])

    @app.get("/health")
    async def health():                     # answers at once, from the core's last sign of life
        problem = lifecycle.health_problem()
        if problem is not None:
            logger.warning("/health: 503: %s", problem)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if hub is not None:
        @app.get("/dashboard")
        async def dashboard_page():
            return HTMLResponse(page_file("index.html")[0])

        @app.get("/dashboard/static/{name}")
        async def dashboard_static(name: str):
            found = page_file(name)
            if found is None:
                raise OpenAIError(404, f"no dashboard file {name!r}")
            return Response(found[0], media_type=found[1])

        @app.get("/dashboard/events")
        async def dashboard_events():
            if engine.errored:
                raise OpenAIError(500, "the engine core has died")
            events = hub.events()
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.state.dashboard_hub = hub        # serve() ends its streams when the server stops
    app.state.lifecycle = lifecycle      # serve() sets draining, /health and run() read it
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


def _bool(text: str) -> bool:
    """An argparse type: true/false, yes/no, on/off, 1/0 (any case)."""
    value = {"true": True, "yes": True, "on": True, "1": True,
             "false": False, "no": False, "off": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, at least 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _add_engine_flags(ap: argparse.ArgumentParser) -> None:
    """One --flag per EngineConfig field (but model), typed from its annotation and
    explained by its docstring's Args entry; a flag not given leaves the field's default."""
    hints = typing.get_type_hints(EngineConfig)
    docs = {m[1]: " ".join(m[2].split()) for m in
            re.finditer(r"^ {8}(\w+): (.*?)(?=^ {8}\w+: |\Z)", EngineConfig.__doc__, re.M | re.S)}
    group = ap.add_argument_group("engine", "EngineConfig fields (nanopaged/config.py)")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        flag = "--" + f.name.replace("_", "-")
        text = f"{docs.get(f.name, '')} (default {f.default})".replace("%", "%%")
        if kinds == [bool]:             # --flag, --flag true|false, --no-flag
            group.add_argument(flag, nargs="?", const=True, type=_bool, default=argparse.SUPPRESS,
                               metavar="BOOL", help=f"{text}; --no-{flag[2:]} is --{flag[2:]} false")
            group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            kind = next((t for t in (int, float) if t in kinds), str)
            group.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                               help=text)


def parse_args(argv=None) -> argparse.Namespace:
    """The server's flags and EngineConfig's; an engine flag not given is absent from the
    namespace. Exits 2 on a bad flag (argparse)."""
    ap = argparse.ArgumentParser(prog="python -m nanopaged.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a local Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3) (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/; open the "
                    "dashboard as /dashboard?key=KEY, which trades the key for an HttpOnly cookie and "
                    "redirects to /dashboard (the access log shows any key= as key=REDACTED)")
    ap.add_argument("--served-model-name", default=None,
                    help="the name clients send as 'model' (default: --model, or "
                         f"{DEFAULT_MODEL_NAME} for the default model)")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                    help="larger request bodies get a 413")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--health-timeout", type=_seconds, default=HEALTH_TIMEOUT_S, metavar="S",
                    help="GET /health is a 503 once the engine core has said nothing for S seconds "
                         "(it is pinged every S/4, at most 1 s); more than the longest step. /health "
                         "itself answers at once (default %(default)g)")
    ap.add_argument("--shutdown-timeout", type=_seconds, default=launcher.DEFAULT_SHUTDOWN_TIMEOUT_S,
                    metavar="S", help="after SIGTERM / SIGINT, seconds the running requests have to "
                    "finish before they are aborted (a stream's last event is then an error, then "
                    "[DONE]) (default %(default)g)")
    ap.add_argument("--dashboard-show-text", action="store_true",
                    help="the dashboard (GET /dashboard) shows prompt and output text; without it, "
                         "request ids and token counts only")
    ap.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                    help="turn GET /dashboard and /dashboard/events off (404)")
    _add_engine_flags(ap)
    return ap.parse_args(argv)


def ready_line(args: argparse.Namespace, name: str, app: FastAPI) -> str:
    """The line logged once the server listens: its URL and model, and the pages a
    person opens in a browser: the dashboard (not with --no-dashboard; with --api-key
    its URL needs ?key=, and the key itself is never logged) and the API's docs."""
    url = f"http://{args.host}:{args.port}"
    pages = []
    if args.dashboard:
        pages.append(f"the dashboard at {url}/dashboard" + ("?key=<api-key>" if args.api_key else ""))
    if app.docs_url:
        pages.append(f"the API docs at {url}{app.docs_url}")
    return f"ready on {url} (model {name!r})" + (": " + ", ".join(pages) if pages else "")


async def serve(args: argparse.Namespace) -> int:
    """Start the engine core, then serve until SIGINT / SIGTERM (returns 0) or the core's
    death (returns 1); the core is shut down after (launcher.py)."""
    import uvicorn

    own = {"model", "host", "port", "api_key", "served_model_name", "max_body_bytes", "log_level",
           "health_timeout", "shutdown_timeout", "dashboard", "dashboard_show_text"}
    engine_args = {k: v for k, v in vars(args).items() if k not in own}
    logger.info("starting the engine for %s (the HTTP server starts once it is ready)",
                args.model or f"the default model {DEFAULT_MODEL_NAME}")
    engine = AsyncLLM(model=args.model, **engine_args)
    try:
        name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        app = build_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                        health_timeout=args.health_timeout, dashboard=args.dashboard,
                        dashboard_show_text=args.dashboard_show_text)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=launcher.GRACE_AFTER_ABORT_S)
        auth.redact_access_log()            # after Config, which sets uvicorn's loggers up
        server = launcher.Server(config)

        async def say_ready():              # once the socket listens, not before
            while not server.started:
                await asyncio.sleep(0.05)
            logger.info("%s", ready_line(args, name, app))

        ready = asyncio.create_task(say_ready())
        status = await launcher.serve_http(server, engine, app.state.lifecycle, app.state.dashboard_hub,
                                           args.shutdown_timeout)
        ready.cancel()
        return status
    finally:
        engine.shutdown()


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM while the engine starts (serving, launcher.py
    handles the signal on the event loop), so that the half-started core is shut down. A
    BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def main(argv=None) -> int:
    """Entry point of `python -m nanopaged.serve` and `nanopaged-serve`. Returns 0 after
    SIGINT or SIGTERM (every request ended, the engine core stopped and its ipc folder
    removed), or 1 if the engine could not start (bad config or a failed start; the error
    is printed) or died while serving (so that a supervisor restarts the server).

    SIGTERM is how systemd, Docker and Kubernetes stop a service. Before the server
    listens, our handler turns it into an exception, as Ctrl-C is one already, so that a
    half-started core is shut down; once it listens, launcher.py drains on either."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # nanopaged's own lines (utils/log.py) at the same level, here and in the core process
    os.environ["NANOPAGED_LOGGING_LEVEL"] = args.log_level.upper()
    logging.getLogger("nanopaged").setLevel(args.log_level.upper())
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return asyncio.run(serve(args))
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"nanopaged.entrypoints.openai.api_server: error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated):
        logger.info("shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
