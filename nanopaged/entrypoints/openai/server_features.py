"""The server's features: what a feature package adds to `python -m nanopaged.serve`
(flags, routes, /metrics series, browser pages), found through one table and imported
only when the server builds its parser. The server names no feature module, and with a
feature's package missing it serves without that feature (its flags are then unknown).

The engine's parts are composed the same way one floor down (nanopaged/features.py): a
row names a class by a qualified string, and `features.resolve` imports it.

A server feature is a class with (the dashboard's: dashboard/routes.py):

    name                        what the log calls it
    add_cli_args(parser)        its flags (static)
    enabled(args) -> bool       do the parsed flags turn it on (static)
    __init__(engine, args)      built once per app, from the AsyncLLM and the flags
    mount(app, model_name)      its routers on the app, its collectors on app.state.metrics
    ready_pages(url, api_key)   the pages the "ready on ..." line names (never the key)
    close()                     the server is stopping (before the running requests drain)
    cookie, cookie_path, key_pages, guarded
                                its browser pages under --api-key (auth.check_key), or
                                key_pages = guarded = () when it has none

and, where it serves models of its own besides the base model (LoRA adapters:
lora/serving.py), these two, which a feature without them does not define:

    request_kwargs(model_name) -> dict | None
                                the extra AsyncLLM.generate keywords of a request whose
                                OpenAI `model` is model_name; None: not a name it serves
    model_cards(base_name) -> list[dict]
                                its models in GET /v1/models, each ModelCard's fields
                                ({"id", "root", "parent"}), under the base model's name

A feature needs no base class: the server only calls these, so the feature's package
never imports the server.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from ...features import resolve

logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")


@dataclass(frozen=True)
class ServerFeatureRow:
    """name: the feature's name; cls: "package.module:Class" below nanopaged/."""
    name: str
    cls: str


SERVER_FEATURES: list[ServerFeatureRow] = [
    ServerFeatureRow("dashboard", "dashboard.routes:DashboardServer"),
    ServerFeatureRow("LoRA adapters", "lora.serving:LoRAServer"),
]


def load_server_features() -> list[type]:
    """The classes of SERVER_FEATURES whose packages import, in the table's order; a
    missing one is logged (at debug: a server without it is a supported setup)."""
    found = []
    for row in SERVER_FEATURES:
        try:
            found.append(resolve(f"{__package__.partition('.')[0]}.{row.cls}"))
        except ImportError as e:
            logger.debug("serving without the %s: %s", row.name, e)
    return found


def add_server_feature_args(parser: argparse.ArgumentParser) -> None:
    for cls in load_server_features():
        cls.add_cli_args(parser)


def build_server_features(engine, args: argparse.Namespace) -> list:
    """One instance per feature that `args` turns on."""
    return [cls(engine, args) for cls in load_server_features() if cls.enabled(args)]


def model_kwargs(features: list, base_name: str, model_name: str | None) -> dict | None:
    """The extra AsyncLLM.generate keywords for a request naming `model_name`: {} for the
    base model (or no name), a feature's request_kwargs for a name it serves, None for a
    name nobody serves (the caller's 404). vLLM: OpenAIServing._check_model and
    _maybe_get_adapters."""
    if model_name is None or model_name == base_name:
        return {}
    for feature in features:
        kwargs = feature.request_kwargs(model_name) if hasattr(feature, "request_kwargs") else None
        if kwargs is not None:
            return kwargs
    return None


def feature_model_cards(features: list, base_name: str) -> list[dict]:
    """The fields of the ModelCard of each model the features serve (model_cards)."""
    return [card for f in features if hasattr(f, "model_cards") for card in f.model_cards(base_name)]
