"""The dashboard as a feature of the HTTP server: its flags, its routes, its /metrics
series, its pages in the ready line, and its streams ended when the server stops.

The server finds this class through its table of server features
(entrypoints/openai/server_features.py) and imports it when it builds its parser, so the
server names no dashboard module and serves without this package. Nothing here imports
the server: its errors are FastAPI's HTTPException (the server's handlers give them
OpenAI's error body), and its browser pages are plain attributes that the server's key
check reads (auth.py).

    --no-dashboard            GET /dashboard... are 404s
    --dashboard-show-text     the snapshots carry prompt and output text
"""
from __future__ import annotations

import argparse

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.background import BackgroundTask

from .serving import DashboardHub, page_file

router = APIRouter()


@router.get("/dashboard")
async def dashboard_page():
    return HTMLResponse(page_file("index.html")[0])


@router.get("/dashboard/static/{name}")
async def dashboard_static(name: str):
    found = page_file(name)
    if found is None:
        raise HTTPException(404, f"no dashboard file {name!r}")
    return Response(found[0], media_type=found[1])


@router.get("/dashboard/events")
async def dashboard_events(request: Request):
    """The dashboard's server-sent events (serving.py, DashboardHub)."""
    if request.app.state.engine.errored:
        raise HTTPException(500, "the engine core has died")
    events = request.app.state.dashboard_hub.events()
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class DashboardCollector:
    """The dashboard's /metrics series: its viewers and the snapshots they skipped."""

    def __init__(self, hub: DashboardHub, model_name: str) -> None:
        self.hub, self.model_name = hub, model_name

    def collect(self):
        viewers = GaugeMetricFamily("nanopaged:dashboard_viewers", "Dashboard streams open (GET /dashboard/events).",
                                    labels=["model_name"])
        viewers.add_metric([self.model_name], len(self.hub.viewers))
        dropped = CounterMetricFamily("nanopaged:dashboard_dropped_updates",
                                      "Dashboard snapshots a viewer skipped: it had not read the one before.",
                                      labels=["model_name"])
        dropped.add_metric([self.model_name], self.hub.dropped)
        sent = CounterMetricFamily("nanopaged:dashboard_snapshots", "Dashboard snapshots received from the engine.",
                                   labels=["model_name"])
        sent.add_metric([self.model_name], self.hub.num_snapshots)
        yield viewers
        yield dropped
        yield sent


class DashboardServer:
    """The live dashboard in `python -m nanopaged.serve` (the server's row "dashboard").

    Browser pages under --api-key (auth.py reads these): a browser opens `key_pages`
    with ?key=KEY once and gets the cookie `cookie` (Path `cookie_path`) in exchange;
    `guarded` need that cookie or the Bearer header.

    Args:
        engine: the AsyncLLM served.
        args: the parsed flags (`dashboard`, `dashboard_show_text` read).
    """
    name = "dashboard"
    cookie = "nanopaged_dashboard"
    cookie_path = "/dashboard"
    key_pages = ("/dashboard", "/dashboard/")
    guarded = ("/dashboard", "/dashboard/", "/dashboard/events")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dashboard-show-text", action="store_true",
                            help="the dashboard (GET /dashboard) shows prompt and output text; without it, "
                                 "request ids and token counts only")
        parser.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                            help="turn GET /dashboard and /dashboard/events off (404)")

    @staticmethod
    def enabled(args: argparse.Namespace) -> bool:
        return args.dashboard

    def __init__(self, engine, args: argparse.Namespace) -> None:
        self.hub = DashboardHub(engine, args.dashboard_show_text)

    def mount(self, app: FastAPI, model_name: str) -> None:
        """The routes on `app`, the hub in `app.state.dashboard_hub` (the events route
        reads it), the series in `app.state.metrics`' registry."""
        app.state.dashboard_hub = self.hub
        app.include_router(router)
        app.state.metrics.registry.register(DashboardCollector(self.hub, model_name))

    def ready_pages(self, url: str, api_key: str | None) -> list[str]:
        return [f"the dashboard at {url}/dashboard" + ("?key=<api-key>" if api_key else "")]

    def close(self) -> None:
        """The server is stopping: every viewer's stream ends (DashboardHub.close)."""
        self.hub.close()
