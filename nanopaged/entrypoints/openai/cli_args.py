"""The server's command line: its own flags, its features' (server_features.py), then
the engine's, which chat and trace share (engine/arg_utils.py). vLLM: `vllm/entrypoints/openai/cli_args.py`."""
from __future__ import annotations

import argparse

from ...engine.arg_utils import add_cli_args
from ...engine.async_llm import HEALTH_TIMEOUT_S
from .launcher import DEFAULT_SHUTDOWN_TIMEOUT_S
from .middleware import DEFAULT_MAX_BODY_BYTES
from .server_features import add_server_feature_args

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"   # what model=None serves


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, at least 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def make_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nanopaged.serve",
                                 description="An OpenAI-compatible HTTP server on FastAPI + uvicorn.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/; open a browser page "
                    "(the dashboard) as /dashboard?key=KEY, which trades the key for an HttpOnly cookie "
                    "and redirects to /dashboard (the access log shows any key= as key=REDACTED)")
    ap.add_argument("--served-model-name", default=None,
                    help=f"the name clients send as 'model' (default: --model, or {DEFAULT_MODEL_NAME})")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                    help="larger request bodies get a 413 (default %(default)d)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--health-timeout", type=_seconds, default=HEALTH_TIMEOUT_S, metavar="S",
                    help="GET /health is a 503 once the engine core has said nothing for S seconds "
                         "(it is pinged every S/4, at most 1 s); more than the longest step. /health "
                         "itself answers at once (default %(default)g)")
    ap.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                    help="after SIGTERM / SIGINT, seconds the running requests have to finish before "
                         "they are aborted (a stream's last event is then an error, then [DONE]) "
                         "(default %(default)g)")
    add_server_feature_args(ap)         # the dashboard's flags, when its package imports
    ap.add_argument("--headless", action="store_true",
                    help="with --nnodes > 1 on a node other than 0: serve no API, start this node's "
                         "ranks for node 0's engine and exit when it ends (give the same --model, "
                         "sizes, --nnodes, --master-addr, --master-port, node 0's cluster secret "
                         "(--cluster-secret-file), and this node's --node-rank)")
    add_cli_args(ap)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The server's flags and the engine's; an engine flag not given is absent from the
    namespace. Exits 2 on a bad flag (argparse)."""
    return make_arg_parser().parse_args(argv)
