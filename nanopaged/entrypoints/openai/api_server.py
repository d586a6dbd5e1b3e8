"""An OpenAI-compatible HTTP server: `python -m nanopaged.serve`, on FastAPI + uvicorn.
vLLM: `vllm/entrypoints/openai/api_server.py`.

    python -m nanopaged.serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...
        [the engine's flags: --model PATH --block-size 16 --max-model-len N ...]

Endpoints (routes.py): GET /v1/models, POST /v1/completions and /v1/chat/completions
(server-sent events with "stream": true), GET /health, GET /metrics (metrics.py), GET /docs,
and what the server's features add (server_features.py: the dashboard's page and stream;
LoRA adapters as models, and their load and unload).
Errors are OpenAI's JSON body (exception_handlers.py); the key, the body's size and
depth are checked first (middleware.py, auth.py). The engine core runs in its own
process, so the event loop never waits for a forward pass. How the server stops
(SIGTERM, SIGINT, the core's death: exit status 1) is launcher.py's.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from fastapi import FastAPI

from ...engine.arg_utils import default_model_weights, engine_kwargs
from ...engine.async_llm import HEALTH_TIMEOUT_S, AsyncLLM
from . import auth, launcher
from .cli_args import DEFAULT_MODEL_NAME, parse_args
from .exception_handlers import add_exception_handlers
from .metrics import ServerMetrics
from .middleware import DEFAULT_MAX_BODY_BYTES, RequestGuard
from .routes import router
from .server_features import build_server_features

logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")


def build_app(engine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              health_timeout: float = HEALTH_TIMEOUT_S, args: argparse.Namespace | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an AsyncLLM) as `served_model_name`.

    Args:
        api_key: if set, /v1/ and the features' browser pages need it (auth.py).
        max_body_bytes: larger request bodies get a 413.
        health_timeout: seconds of silence from the core after which GET /health is a 503.
        args: the parsed flags that turn the server's features on and set them up
            (server_features.py; None: their defaults, e.g. the dashboard on).
    """
    app = FastAPI(title="nanopaged", docs_url="/docs", redoc_url=None)     # /docs: Swagger UI, as vLLM
    state = app.state
    state.engine, state.served_model_name = engine, served_model_name
    state.lifecycle = launcher.Lifecycle(engine, health_timeout)      # serve() drains it; /health reads it
    state.metrics = ServerMetrics(engine, served_model_name)
    state.server_features = build_server_features(engine, args if args is not None else parse_args([]))
    add_exception_handlers(app)
    app.include_router(router)
    for feature in state.server_features:
        feature.mount(app, served_model_name)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes,
                       browser_pages=state.server_features)
    return app


def ready_line(args: argparse.Namespace, name: str, app: FastAPI) -> str:
    """The line logged once the server listens: its URL, model, and the pages to open
    (the features', e.g. the dashboard with ?key=<api-key> under --api-key, never the
    key; the API docs)."""
    url = f"http://{args.host}:{args.port}"
    pages = [page for feature in app.state.server_features for page in feature.ready_pages(url, args.api_key)]
    if app.docs_url:
        pages.append(f"the API docs at {url}{app.docs_url}")
    return f"ready on {url} (model {name!r})" + (": " + ", ".join(pages) if pages else "")


async def serve(args: argparse.Namespace) -> int:
    """Start the engine core, then serve until SIGINT / SIGTERM (returns 0) or the core's
    death (returns 1); the core is shut down after (launcher.py)."""
    import uvicorn

    logger.info("starting the engine for %s (the HTTP server starts once it is ready)",
                args.model or f"the default model {DEFAULT_MODEL_NAME}")
    engine = AsyncLLM(**engine_kwargs(args))
    try:
        name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        app = build_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                        health_timeout=args.health_timeout, args=args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=launcher.GRACE_AFTER_ABORT_S)
        auth.redact_access_log()            # after Config, which sets uvicorn's loggers up
        server = launcher.Server(config)

        async def say_ready():              # once the socket listens, not before
            while not server.started:
                await asyncio.sleep(0.05)
            logger.info("%s", ready_line(args, name, app))

        ready = asyncio.create_task(say_ready())
        status = await launcher.serve_http(server, engine, app.state.lifecycle, app.state.server_features,
                                           args.shutdown_timeout)
        ready.cancel()
        return status
    finally:
        engine.shutdown()


def serve_headless(args: argparse.Namespace) -> int:
    """`--headless`: this node's ranks for node 0's engine, no API (multiproc/headless.py).
    Returns their exit status. Raises ValueError / RuntimeError as run_headless."""
    from ...config import EngineConfig
    from ...model.config import ModelConfig
    from ...model.model_loader import resolve_model
    from ...multiproc.headless import run_headless

    config = default_model_weights(EngineConfig(**engine_kwargs(args)))
    if config.parallel_config.nnodes == 1:
        raise ValueError("--headless is for a node of a multi-node engine: give --nnodes > 1")
    if config.quant_config.quantization == "gguf":           # the folder made for the GGUF file
        from ...quantization.gguf_loader import resolve_gguf_model as resolve_model
    model_path = resolve_model(config.model)
    logger.info("node %d of %d: joining node 0 at %s:%s", config.parallel_config.node_rank, config.parallel_config.nnodes,
                config.parallel_config.master_addr, config.parallel_config.master_port)
    return run_headless(config, model_path, ModelConfig.from_pretrained(model_path))


class Terminated(BaseException):
    """SIGTERM while the engine starts, raised in the main thread so the half-started
    core is shut down. A BaseException, like KeyboardInterrupt, so no `except Exception`
    swallows it. (Once serving, launcher.py handles the signal on the event loop.)"""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def main(argv=None) -> int:
    """`python -m nanopaged.serve` and `nanopaged-serve`. Returns 0 after SIGINT or
    SIGTERM (every request ended, the core stopped), 1 if the engine could not start
    (the error printed) or died while serving, so that a supervisor restarts it.
    With --headless: serve_headless's status."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # nanopaged's own lines (utils/log.py) at the same level, here and in the core process
    os.environ["NANOPAGED_LOGGING_LEVEL"] = args.log_level.upper()
    logging.getLogger("nanopaged").setLevel(args.log_level.upper())
    signal.signal(signal.SIGTERM, _raise_terminated)     # systemd, Docker and Kubernetes stop with it
    try:
        return serve_headless(args) if args.headless else asyncio.run(serve(args))
    except (ValueError, TypeError, OSError, RuntimeError) as e:     # OSError: a bad model path, a port in use
        print(f"nanopaged.entrypoints.openai.api_server: error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated):
        logger.info("shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
