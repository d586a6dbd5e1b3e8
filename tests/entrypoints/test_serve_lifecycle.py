"""How a server ends (entrypoints/openai/launcher.py), each on a server of its own
(test_serve.py's Server: the tiny model, 127.0.0.1, a free port, a private TMPDIR):

- its engine core dies (SIGKILL): the clients in flight get a short 500 or a last error
  event (no traceback, no path), the log says why in one ERROR line, and the server
  exits with status 1 within seconds, so a supervisor restarts it;
- SIGTERM with 6 streams in flight: every client gets a final event and `data: [DONE]`,
  a request sent while it drains is a 503, the status is 0, no traceback in the log;
- Ctrl-C twice, idle, to the whole process group as a terminal sends it: no traceback,
  exit 0.
Then, in process: a 500 (a bug, a dead core) never carries a traceback or a file path.
Every test checks that the server's EngineCore and its ipc folder are gone.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from nanopaged.entrypoints.openai import serving
from nanopaged.utils.proc import EngineDeadError

from serve_harness import TINY_ARGS, Server

pytestmark = pytest.mark.timeout(240)

LONG = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
CORE_TRACEBACK = ('the EngineCore process (pid 7) died: Traceback (most recent call last):\n'
                  '  File "/home/me/nanopaged/worker/model_runner.py", line 9, in compute_logits\n'
                  'RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory\n')


def _no_traceback_or_path(text: str) -> bool:
    return "Traceback" not in text and ".py" not in text and not re.search(r"(^|[\s'\"(])/\w", text)


def _ended(server: Server, children: list[psutil.Process]) -> None:
    """The core process and its ipc folder are gone (the server has exited)."""
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {alive}"
    assert os.listdir(server.tmpdir) == [], "the core's ipc folder was left behind"


def _events(response) -> list[str]:
    """The `data:` lines of a stream, to its end."""
    return [line for line in response.iter_lines() if line.startswith("data:")]


def test_a_dead_core_ends_the_server_with_status_1(tiny_model_dir):
    """The core killed (SIGKILL) under a stream and a whole request: the stream ends with
    an error event saying "the engine core has died" and [DONE], the whole request is a
    500 saying so, neither with a traceback or a path; the log has one ERROR line with
    the cause; the server exits with status 1 within 10 s (it used to stay up, a zombie
    answering 500 to everything). The core is frozen (SIGSTOP) once the stream has its
    first event, and the whole request sent to it then, so that it is surely in flight
    when the core dies."""
    server = Server(tiny_model_dir, *TINY_ARGS)
    try:
        children = server.children()
        (core,) = children
        whole: list[httpx.Response] = []
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                core.suspend()
                asker = threading.Thread(target=lambda: whole.append(
                    httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)), daemon=True)
                asker.start()
                time.sleep(1.0)                       # the request waits on the frozen core
                core.kill()
                t0 = time.monotonic()
                rest = [line for line in lines if line.startswith("data:")]
        asker.join(timeout=30)
        assert server.proc.wait(timeout=10) == 1
        assert time.monotonic() - t0 < 10
        last = json.loads(rest[-2][6:])                # (on a stalled machine it may have finished)
        assert rest[-1] == "data: [DONE]", rest[-2:]
        assert last.get("error", {}).get("message") == "the engine core has died" or \
            last["choices"][0]["finish_reason"] == "length", last
        assert whole and whole[0].status_code == 500, whole
        assert whole[0].json()["error"]["message"] == "the engine core has died"
        # an error event carries no traceback or path (a finished stream's chunk names the model's folder)
        assert "error" not in last or _no_traceback_or_path(rest[-2])
        assert _no_traceback_or_path(whole[0].text), whole[0].text
        log = server.output()
        cause = [line for line in log.splitlines() if line.startswith("ERROR") and "exit status 1" in line]
        assert len(cause) == 1 and "killed by SIGKILL" in cause[0], log
        _ended(server, children)
    finally:
        server.stop()


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT", "SIGINT")])
def test_sigterm_with_6_streams_ends_each_with_an_event_and_done(tiny_model_dir, signals):
    """Issue 34, field case C73 (streams at shutdown): SIGTERM with 6 streams in flight;
    again with two SIGINTs 50 ms apart (the second skips the wait: the streams are
    aborted at once, and the server may be gone before a late request). The server stops admitting (a new
    request and /health are 503s), gives the running requests --shutdown-timeout (1 s
    here) to finish, then aborts the rest: a stream gets a last error event ("shutting
    down") and `data: [DONE]` (uvicorn used to cut them after 5 s, mid-body, logging
    CancelledError), a whole response a 503. The core is frozen (SIGSTOP) once every
    stream has its first event, as a core too slow to finish in time, and resumed once
    every client has its end; a whole request sent to the frozen core is surely still
    running at the signal (a stream may have finished first on a stalled machine: then
    it ends as usual). Exit status 0, no traceback in the log, nothing left behind."""
    server = Server(tiny_model_dir, *TINY_ARGS, "--log-level", "info", "--shutdown-timeout", "1")
    (core,) = children = server.children()

    async def first_event(lines):
        async for line in lines:
            if line.startswith("data:"):
                return line

    async def rest(lines):
        return [line async for line in lines if line.startswith("data:")]

    async def six_streams():
        """(each stream's data lines, the whole request's response, the late one's, /health's status)."""
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c, contextlib.AsyncExitStack() as opened:
            # all 6 sent at once, so they run in the same steps
            responses = await asyncio.gather(*[opened.enter_async_context(
                c.stream("POST", "/v1/completions", json=dict(LONG, stream=True))) for _ in range(6)])
            lines = [r.aiter_lines() for r in responses]
            firsts = await asyncio.gather(*[first_event(it) for it in lines])
            try:
                core.suspend()
                whole = asyncio.ensure_future(c.post("/v1/completions", json=LONG))
                await asyncio.sleep(1.0)                  # it waits on the frozen core
                server.proc.send_signal(getattr(signal, signals[0]))
                for name in signals[1:]:
                    await asyncio.sleep(0.05)
                    server.proc.send_signal(getattr(signal, name))
                late = health = None
                if len(signals) == 1:
                    await asyncio.sleep(0.3)
                    late = await c.post("/v1/completions", json=LONG)
                    health = (await c.get("/health")).status_code
                ends = await asyncio.wait_for(asyncio.gather(*[rest(it) for it in lines]), 30)
                whole = await asyncio.wait_for(whole, 30)
            finally:
                core.resume()
            return [[f] + e for f, e in zip(firsts, ends)], whole, late, health

    try:
        streams, whole, late, health = asyncio.run(six_streams())
        assert server.proc.wait(timeout=30) == 0
        for r in (whole, late) if late is not None else (whole,):
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        assert health in (503, None)
        aborted = 0
        for events in streams:
            assert events[-1] == "data: [DONE]", events[-3:]
            last = json.loads(events[-2][6:])
            if "error" in last:
                assert "shutting down" in last["error"]["message"], last
                aborted += 1
            else:
                assert last["choices"][0]["finish_reason"] == "length", last
        log = server.output()
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert f"aborting {aborted + 1} request(s)" in log, (aborted, log)
        _ended(server, children)
    finally:
        server.stop()


def test_ctrl_c_twice_idle_exits_0_without_a_traceback(tiny_model_dir):
    """Two quick SIGINTs to the server's process group (a terminal's Ctrl-C reaches the
    EngineCore too, which used to die with a KeyboardInterrupt traceback, and the server
    printed `ERROR: Traceback ... KeyboardInterrupt`): exit 0, no traceback."""
    server = Server(tiny_model_dir, *TINY_ARGS, new_session=True)
    try:
        children = server.children()
        os.killpg(server.proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(timeout=30) == 0, server.output()
        log = server.output()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        _ended(server, children)
    finally:
        server.stop()


# -- in process --------------------------------------------------------------------------------

def test_the_timeout_flags_take_seconds(capsys):
    """--health-timeout and --shutdown-timeout: 5 s each by default, any number of
    seconds >= 0; a negative one exits 2 naming the flag and the value."""
    from nanopaged.entrypoints.openai.api_server import parse_args
    args = parse_args([])
    assert (args.health_timeout, args.shutdown_timeout) == (5.0, 5.0)
    assert parse_args(["--shutdown-timeout", "0", "--health-timeout", "0.5"]).shutdown_timeout == 0
    with pytest.raises(SystemExit) as e:
        parse_args(["--shutdown-timeout", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--shutdown-timeout" in err and "got '-1'" in err, err


# -- in process: what a 500 says --------------------------------------------------------------

class _FailingEngine:
    """What build_app's request path uses of an AsyncLLM; generate raises `error`."""

    errored = False
    tokenizer = None

    def __init__(self, error: Exception) -> None:
        self.error = error

    def get_stats(self):
        return {}

    def generate(self, prompt, params, request_id):
        async def fail():
            raise self.error
            yield
        return fail()


@pytest.mark.parametrize("error, status, message", [
    (OSError(2, "No such file or directory", "/home/me/.cache/nanopaged/secret.bin"), 500,
     "internal server error (FileNotFoundError)"),
    (EngineDeadError(CORE_TRACEBACK), 500, "the engine core has died"),
])
def test_a_500_carries_no_traceback_or_path(error, status, message):
    """A bug (the `_bug` handler) and a dead core: the client gets a short message; the
    traceback and the paths stay in the server's log."""
    from starlette.testclient import TestClient
    from nanopaged.entrypoints.openai.api_server import build_app
    client = TestClient(build_app(_FailingEngine(error), "m"), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == status and r.json()["error"]["message"] == message, r.text
    assert _no_traceback_or_path(r.text), r.text


def test_the_log_gives_a_dead_cores_cause_in_one_line():
    """The watchdog's ERROR line: the core's header and its exception, not the traceback."""
    from nanopaged.entrypoints.openai.launcher import one_line
    assert one_line(CORE_TRACEBACK) == ("the EngineCore process (pid 7) died: RuntimeError: [enforce fail at "
                                        "alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory")
    assert one_line("the EngineCore process (pid 7) died: killed by SIGKILL") == \
        "the EngineCore process (pid 7) died: killed by SIGKILL"


def test_a_stream_error_event_carries_no_traceback_or_path():
    """An exception after a stream started becomes its last event, then [DONE]: a dead
    core's says so in one short sentence, a bug's names only the exception's type."""
    async def lines(error):
        yield "data: {}\n\n"
        raise error

    async def collect(error):
        return [line async for line in serving.guarded_stream(lines(error))]

    for error, status, message in ((EngineDeadError(CORE_TRACEBACK), 500, "the engine core has died"),
                                   (KeyError("/home/me/x.py"), 500, "internal server error (KeyError)"),
                                   (serving.ShuttingDown("the server is shutting down"), 503,
                                    "the server is shutting down")):
        got = asyncio.run(collect(error))
        assert got[-1] == "data: [DONE]\n\n"
        err = json.loads(got[-2][6:])["error"]
        assert err["message"] == message and err["type"] == "server_error", (status, err)
        assert _no_traceback_or_path(got[-2])
