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
