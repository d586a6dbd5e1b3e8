"""The live dashboard's server side (issue 27; the page itself is tested in Chromium
elsewhere): GET /dashboard, its static files, and GET /dashboard/events, the server-sent
events of the engine's snapshots.

In process, no engine: a viewer's mailbox keeps only the newest snapshot and counts the
ones it skipped, a quiet stream sends keep-alive comments, --no-dashboard is a 404. Then
two real servers (test_serve.py's Server) under a bounded load of requests: the stream
shows used blocks during the load and a pool all free (or free-cached) after it; no text
by default, text with --dashboard-show-text; with --api-key the page and the stream need
the key (the header, or the cookie that /dashboard?key= sets: test_serve_input.py tests
that flow); and a stalled viewer (a socket that never reads) neither
stops the load nor grows the server's memory: its updates are dropped and counted.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time

import httpx
import psutil
import pytest

from nanopaged.dashboard import serving as serving_dashboard
from nanopaged.entrypoints.openai.api_server import build_app, parse_args, ready_line
from nanopaged.dashboard.messages import (DashboardRequest, DashboardSequence, DashboardSnapshot, DashboardStage, DashboardStep)
from nanopaged.dashboard.sampler import DashboardSampler
from nanopaged.dashboard.serving import DashboardHub, LatestOnly, snapshot_json

from serve_harness import KEY, TINY_ARGS, FakeEngine, Server

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["Hello, my name is", "The capital of France is", "Paged attention splits", "The KV cache"]


# -- in process ------------------------------------------------------------------------------

def test_snapshot_json_is_the_json_of_asdict_with_every_nested_part():
    """snapshot_json's shortcut (vars of each part) writes what dataclasses.asdict would:
    requests with their sequences, steps, and pipeline stage rows."""
    snap = DashboardSnapshot(
        step=4, time=1.5, block_size=4, num_gpu_blocks=2, num_cpu_blocks=1, gpu_ref_count=[1, 0],
        gpu_cached=[False, True], gpu_owners=[["a"], []], cpu_owners={0: "b"},
        requests=[DashboardRequest("a", "running", 3, 1, [DashboardSequence(0, [0], False, 3, 4)])],
        running=["a"], waiting=[], swapped=["b"], steps=[DashboardStep(4, in_flight=[{"request_ids": ["a"],
                                                                                      "seq_ids": [0]}])],
        pipeline_parallel_size=2, in_flight=[{"request_ids": ["a"], "seq_ids": [0]}],
        stages=[DashboardStage(0, [0], "computing", 9, ["a"], [0]), DashboardStage(1, [1], "unknown")])
    assert json.loads(snapshot_json(snap)) == json.loads(json.dumps(dataclasses.asdict(snap)))


def test_a_mailbox_keeps_the_newest_and_counts_what_it_dropped():
    async def main():
        box = LatestOnly()
        for i in range(5):
            box.put(str(i))
        assert await box.get(1) == "4" and box.dropped == 4
        assert await box.get(0.01) is None                   # nothing new: a timeout
    asyncio.run(main())


def test_the_hub_subscribes_once_fans_out_and_keeps_alive(monkeypatch):
    from nanopaged.dashboard.messages import DashboardSnapshot
    monkeypatch.setattr(serving_dashboard, "KEEP_ALIVE_S", 0.05)
    from nanopaged.dashboard.messages import DashboardRequest, DashboardSequence, DashboardStep
    seq = DashboardSequence(seq_id=0, block_table=[0], on_cpu=False, num_computed_tokens=3, num_tokens=4)
    snap = DashboardSnapshot(step=3, time=1.0, block_size=4, num_gpu_blocks=2, num_cpu_blocks=0,
                             gpu_ref_count=[1, 0], gpu_cached=[False, True], gpu_owners=[["a"], []],
                             cpu_owners={}, requests=[DashboardRequest("a", "running", 3, 1, [seq])],
                             running=["a"], waiting=[], swapped=[],
                             steps=[DashboardStep(3, [{"request_id": "a", "seq_id": 0, "kind": "decode",
                                                       "num_tokens": 1}])], stats={"kv_usage": 0.5})

    async def main():
        engine = FakeEngine()
        hub = DashboardHub(engine, show_text=True)
        a, b = hub.events(), hub.events()
        assert await a.__anext__() == ": nanopaged dashboard\n\n"
        assert list(engine.watchers) == [serving_dashboard.WATCHER]   # subscribed once
        factory, callback = engine.watchers[serving_dashboard.WATCHER]
        assert factory is DashboardSampler
        callback(snap)
        assert json.loads((await a.__anext__())[6:]) == dataclasses.asdict(snap)
        await b.__anext__()                                       # joins: gets the latest at once
        assert (await b.__anext__()).startswith("data: {")
        assert await a.__anext__() == ": keep-alive\n\n"
        for _ in range(3):
            callback(snap)                                        # nobody reads: 2 dropped each
        assert hub.dropped == 4 and hub.num_snapshots == 4
        await a.aclose()
        assert engine.watchers                                    # b still watches
        await b.aclose()
        assert not engine.watchers and hub.dropped == 4
    asyncio.run(main())


def test_no_dashboard_is_404_and_the_flags_parse():
    from starlette.testclient import TestClient
    args = parse_args(["--no-dashboard"])
    assert args.dashboard is False and args.dashboard_show_text is False
    assert parse_args(["--dashboard-show-text"]).dashboard_show_text is True
    client = TestClient(build_app(FakeEngine(), "m", args=args))
    for path in ("/dashboard", "/dashboard/events", "/dashboard/static/dashboard.js"):
        assert client.get(path).status_code == 404, path
    client = TestClient(build_app(FakeEngine(), "m"))
    assert client.get("/dashboard/static/dashboard.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/dashboard/static/..%2Fprotocol.py").status_code == 404


@pytest.mark.parametrize("flags", [[], ["--api-key", KEY], ["--no-dashboard"]])
def test_the_ready_line_names_the_pages_and_each_one_answers(flags):
    """The "ready on ..." line names the dashboard (with --api-key: the ?key= it needs,
    never the key; not at all with --no-dashboard) and /docs, and each URL it names
    answers 200 (the key filled in)."""
    import re
    from starlette.testclient import TestClient
    args = parse_args(["--port", "8123", *flags])
    app = build_app(FakeEngine(), "m", api_key=args.api_key, args=args)
    line = ready_line(args, "m", app)
    assert line.startswith("ready on http://127.0.0.1:8123 (model 'm')"), line
    urls = [u.rstrip(",") for u in re.findall(r"http://\S+", line)][1:]
    assert [u.split("?")[0] for u in urls] == ["http://127.0.0.1:8123/dashboard"] * args.dashboard + [
        "http://127.0.0.1:8123/docs"], line
    assert ("?key=<api-key>" in line) == (args.api_key is not None) and KEY not in line, line
    client = TestClient(app)
    for url in urls:
        assert client.get(url.replace("<api-key>", KEY)).status_code == 200, url


# -- real servers -----------------------------------------------------------------------------

def _stop(server: Server) -> None:
    alive = server.stop()
    assert server.proc.returncode == 0 and not alive, f"exit {server.proc.returncode}, left behind: {alive}"
    assert server.left_in_tmp == [], server.left_in_tmp


def _metric(url: str, name: str, headers=None) -> float:
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _watch(url: str, snapshots: list, headers=None) -> None:
    """A viewer: read the stream, keep every snapshot (parsed), until cancelled."""
    async with httpx.AsyncClient(timeout=None, headers=headers) as client:
        async with client.stream("GET", url) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    snapshots.append(json.loads(line[6:]))


async def _load(url: str, rounds: int, concurrency: int, max_tokens: int, headers=None) -> None:
    """rounds x concurrency streamed completions, each round waiting for the last."""
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        for r in range(rounds):
            async def one(i):
                body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)] + f" {r} {i}",
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
            await asyncio.gather(*(one(i) for i in range(concurrency)))


async def _until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return predicate()


def _all_free(snap: dict) -> bool:
    return not snap["requests"] and all(r == 0 for r in snap["gpu_ref_count"]) and not any(snap["gpu_owners"])


def _stalled_viewer(server: Server) -> socket.socket:
    """A client that asks for the stream and never reads: a small receive buffer, so the
    server's socket fills after a few snapshots."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    return sock


@pytest.mark.timeout(420)
def test_dashboard_under_load_with_a_key_and_a_stalled_viewer(tiny_model_dir):
    # a big pool (32768 blocks): each snapshot is ~0.4 MB of JSON, so a server that
    # queued them for the stalled viewer would grow by tens of MB during the load
    server = Server(tiny_model_dir, "--api-key", KEY, "--served-model-name", "tiny", *TINY_ARGS,
                    "--num-gpu-blocks", "32768")
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        url = server.url
        assert httpx.get(url + "/dashboard").status_code == 401
        assert httpx.get(url + "/dashboard", params={"key": "wrong"}).status_code == 401
        assert httpx.get(url + "/dashboard/events", timeout=10).status_code == 401
        page = httpx.get(url + "/dashboard", params={"key": KEY}, follow_redirects=True)   # via the cookie
        assert page.status_code == 200 and "<html" in page.text
        assert httpx.get(url + "/dashboard", headers=auth).status_code == 200
        assert httpx.get(url + "/dashboard/static/dashboard.js").status_code == 200
        assert httpx.get(url + "/v1/models", params={"key": KEY}).status_code == 401   # ?key= is the dashboard's only

        stalled = _stalled_viewer(server)
        snapshots: list[dict] = []

        async def main():
            viewer = asyncio.create_task(_watch(url + "/dashboard/events", snapshots, auth))
            assert await _until(lambda: snapshots, 30)              # the idle state, at once
            assert _all_free(snapshots[0])
            assert await _until(lambda: _metric(url, "nanopaged:dashboard_viewers") == 2, 10)
            await _load(url, 1, 8, 16, auth)                        # warm-up
            rss = psutil.Process(server.proc.pid).memory_info().rss
            made = _metric(url, "nanopaged:dashboard_snapshots_total")
            started = time.monotonic()
            for _ in range(30):          # until 60 snapshots (~15 MB) went past the stalled viewer
                await _load(url, 1, 8, 64, auth)
                if _metric(url, "nanopaged:dashboard_snapshots_total") - made >= 60:
                    break
            took = time.monotonic() - started
            assert await _until(lambda: _all_free(snapshots[-1]), 10)
            viewer.cancel()
            return rss, made, took

        rss_before, made_before, took = asyncio.run(main())
        grown = psutil.Process(server.proc.pid).memory_info().rss - rss_before
        made = _metric(url, "nanopaged:dashboard_snapshots_total") - made_before
        dropped = _metric(url, "nanopaged:dashboard_dropped_updates_total")
        print(f"load {took:.1f} s, {made:.0f} snapshots of ~{len(json.dumps(snapshots[-1])) / 1e6:.2f} MB, "
              f"stalled viewer dropped {dropped:.0f}, server RSS grew {grown / 1e6:.1f} MB")
        assert any(any(s["gpu_owners"]) and s["requests"] for s in snapshots)      # used blocks during the load
        assert any(r["status"] == "running" for s in snapshots for r in s["requests"])
        assert all(r["prompt"] is None and r["output"] is None for s in snapshots for r in s["requests"])
        assert made >= 60 and dropped >= made / 2        # the stalled viewer skipped most of them
        assert grown < 10e6, f"server RSS grew {grown / 1e6:.1f} MB"    # queued, they would be ~15 MB
        assert _metric(url, "nanopaged:dashboard_viewers") == 1                     # the stalled one
        stalled.close()
        assert asyncio.run(_until(lambda: _metric(url, "nanopaged:dashboard_viewers") == 0, 10))
    finally:
        _stop(server)


def test_dashboard_shows_text_only_with_the_flag(tiny_model_dir):
    server = Server(tiny_model_dir, "--served-model-name", "tiny", "--dashboard-show-text", *TINY_ARGS)
    try:
        assert httpx.get(server.url + "/dashboard").status_code == 200            # no --api-key: open
        snapshots: list[dict] = []

        async def main():
            viewer = asyncio.create_task(_watch(server.url + "/dashboard/events", snapshots))
            assert await _until(lambda: snapshots, 30)
            # a round's first step is shown at once (after a rest), its later ones at most
            # 5 times a second: long rounds, until a running request shows text (the first
            # token alone may decode to nothing yet: a partial character)
            for _ in range(20):
                await _load(server.url, 1, 4, 160)
                if any(r["status"] == "running" and r["output"] for s in snapshots for r in s["requests"]):
                    break
            assert await _until(lambda: _all_free(snapshots[-1]), 10)
            viewer.cancel()
        asyncio.run(main())
        shown = [r for s in snapshots for r in s["requests"] if r["status"] == "running"]
        assert shown and all(r["prompt"].startswith(tuple(PROMPTS)) for r in shown)
        assert any(r["output"] for r in shown)
        # a viewer still watching when the server is stopped: its stream is ended cleanly
        # (not cut off after uvicorn's graceful-shutdown timeout, with errors in the log)
        ended, opened = [], threading.Event()

        def watch():
            with httpx.stream("GET", server.url + "/dashboard/events", timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        opened.set()
            ended.append(True)
        viewer = threading.Thread(target=watch, daemon=True)
        viewer.start()
        assert opened.wait(30)
    finally:
        _stop(server)
    viewer.join(10)
    server.log.seek(0)
    log = server.log.read()
    assert ended == [True], "the open stream did not end cleanly"
    assert "graceful shutdown exceeded" not in log and "Exception in ASGI application" not in log, log
