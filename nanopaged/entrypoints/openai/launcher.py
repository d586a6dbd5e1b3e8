"""The server's life: serve until told to stop or until the engine core dies, and end
every request on purpose either way. vLLM: `vllm/entrypoints/launcher.py` (serve_http,
its NoSignalServer, watchdog_loop and terminate_if_errored).

    serve_http(server, engine, lifecycle, features, shutdown_timeout)  ->  exit status

Three things happen while uvicorn serves:

- The heartbeat. AsyncLLM pings the core every `heartbeat_interval(--health-timeout)`
  and stamps the time of every message it reads from it. GET /health answers from the
  age of that stamp (`Lifecycle.health_problem`) and never waits: a frozen core is a
  503 once it has been silent for --health-timeout, a busy one a 200 (each step's
  outputs are a sign of life).
- The watchdog. Every 0.2 s it asks whether the core process is gone. If it is (killed,
  or an exception inside a step), it logs one ERROR line with the cause and stops the
  server with exit status 1, so that a supervisor (systemd, Docker, Kubernetes)
  restarts it. The clients in flight are told "the engine core has died" (a 500, or a
  stream's last error event), with no traceback: that stays in the log.
- The signals. SIGTERM and SIGINT are handled on the event loop (uvicorn's own handlers
  are off, as vLLM's NoSignalServer), so no KeyboardInterrupt lands in whatever code
  runs. The first one drains: new requests get a 503 and so does /health, the server's
  features close (the dashboard's streams end), and the running requests have
  --shutdown-timeout seconds to finish. Then the rest are aborted: an open stream gets a
  last `data: {"error": ...}` event and `data: [DONE]`, a whole response a 503. Then
  uvicorn closes the connections, the caller shuts the core down, and the status is 0.
  A second signal cuts the wait short.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import uvicorn

from .serving import ShuttingDown

logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")

WATCHDOG_INTERVAL_S = 0.2        # how soon a dead core is noticed (vLLM checks every 5 s)
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
GRACE_AFTER_ABORT_S = 5.0        # uvicorn's wait for the aborted responses to be written


def heartbeat_interval(health_timeout: float) -> float:
    """Seconds between the heartbeat's pings: a quarter of the health timeout (at most
    1 s, at least 0.05 s), so an idle live core is never near the limit."""
    return max(0.05, min(1.0, health_timeout / 4))


def one_line(reason: str) -> str:
    """A dead core's reason in one line: the header and the traceback's last line (the
    exception), e.g. "the EngineCore process (pid 7) died: RuntimeError: boom"."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else reason
    head = lines[0].removesuffix("Traceback (most recent call last):").strip()
    return f"{head} {lines[-1]}"


class Server(uvicorn.Server):
    """uvicorn without its own SIGINT / SIGTERM handlers: serve_http drains first, and
    uvicorn's would re-raise the signal once done (vLLM's NoSignalServer)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Lifecycle:
    """What the app asks about the server's state (app.state.lifecycle).

    Args:
        engine: the AsyncLLM.
        health_timeout: seconds of silence from the core after which /health is a 503.

    Attributes:
        draining: a stop was asked for: new requests are 503s.
    """

    def __init__(self, engine, health_timeout: float) -> None:
        self.engine, self.health_timeout = engine, health_timeout
        self.draining = False

    def health_problem(self) -> str | None:
        """Why GET /health is a 503 now, or None for a 200. Never waits."""
        if self.engine.errored:
            return "the engine core has died"
        if self.draining:
            return "the server is shutting down"
        silent = self.engine.seconds_since_heard()
        if silent > self.health_timeout:
            return f"the engine core has said nothing for {silent:.1f} s (--health-timeout {self.health_timeout:g})"
        return None


async def serve_http(server: Server, engine, lifecycle: Lifecycle, features: list, shutdown_timeout: float) -> int:
    """Serve until SIGTERM / SIGINT (returns 0 once every request has ended) or the
    engine core's death (returns 1). The caller shuts the engine down after.

    Args:
        features: the app's server features, closed when the server stops (the dashboard's
            streams end).
        shutdown_timeout: seconds the running requests have to finish after a signal.
    """
    loop = asyncio.get_running_loop()
    stop, cut_short = asyncio.Event(), asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.info("%s again: aborting the running requests now", sig.name)
            cut_short.set()
        else:
            logger.info("%s: shutting down", sig.name)
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    engine.start_heartbeat(heartbeat_interval(lifecycle.health_timeout))
    died: list[str] = []

    async def watchdog():
        while not engine.errored:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        died.append(one_line(engine.engine_core.dead_reason or "it exited"))
        logger.error("the engine core has died (%s): stopping the server with exit status 1, "
                     "so that its supervisor can restart it", died[0])
        stop.set()
        cut_short.set()                     # nothing left to wait for: its requests have failed

    async def drain():
        await stop.wait()
        lifecycle.draining = True
        for feature in features:
            feature.close()
        running = engine.running_request_ids()
        if running and not cut_short.is_set():
            logger.info("waiting up to %g s (--shutdown-timeout) for %d running request(s) to finish",
                        shutdown_timeout, len(running))
        await _wait_for_requests(server, engine, shutdown_timeout, cut_short)
        left = engine.running_request_ids()
        if left and not engine.errored:
            why = "on a second signal" if cut_short.is_set() else f"after --shutdown-timeout {shutdown_timeout:g} s"
            logger.warning("aborting %d request(s) still running %s", len(left), why)
            await engine.abort(left, ShuttingDown("the server is shutting down: the request was aborted"))
        server.should_exit = True

    tasks = [loop.create_task(watchdog()), loop.create_task(drain())]
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
    logger.info("shut down")
    return 1 if died else 0


async def _wait_for_requests(server: Server, engine, timeout: float, cut_short: asyncio.Event) -> None:
    """Until no HTTP request is being served and no generate loop runs, timeout seconds
    at most, or until cut_short is set."""
    deadline = time.monotonic() + timeout
    while (server.server_state.tasks or engine.running_request_ids()) and not cut_short.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(cut_short.wait(), min(0.05, remaining))
