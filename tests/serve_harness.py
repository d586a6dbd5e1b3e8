"""Shared by the tests that start a server (tests/entrypoints, tests/dashboard, tests/multiproc):
a real `python -m nanopaged.serve` process on a free port, its flags for the tiny model, and a
stand-in for the AsyncLLM that the dashboard's hub uses."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types

import httpx
import psutil



KEY = "sk-test-key"
# recompute-only preemption, no swap pool: the start skips measuring swap vs recompute (~5 s)
TINY_ARGS = ["--block-size", "4", "--num-gpu-blocks", "256", "--attention-backend", "torch",
             "--preemption-mode", "recompute", "--num-cpu-blocks", "0", "--dtype", "float32"]
TINY_ENGINE = dict(block_size=4, num_gpu_blocks=256, attention_backend="torch",
                   preemption_mode="recompute", num_cpu_blocks=0, dtype="float32")
PROMPTS = ["Hello, my name is", "The capital of France is", "Paged attention splits"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m nanopaged.serve` subprocess; `url` is its base URL. new_session: in a
    process group of its own (with its EngineCore), as a terminal's job whose Ctrl-C
    reaches every process of the group."""

    def __init__(self, model, *args: str, startup_s: float = 180.0, new_session: bool = False) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # a private TMPDIR: the engine core's ipc folder (nanopaged-*) is made there, so a
        # test can see that shutting down removed it
        self.tmpdir = tempfile.mkdtemp(prefix="serve-test-")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TMPDIR=self.tmpdir)
        # its log goes to a file: a pipe nobody reads would block the server once full
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanopaged.serve", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=new_session)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                shutil.rmtree(self.tmpdir, ignore_errors=True)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy within {startup_s} s")

    def output(self) -> str:
        """Everything the server has logged so far."""
        self.log.seek(0)
        return self.log.read()

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> list[psutil.Process]:
        """SIGTERM, wait, SIGKILL if needed; returns the children that are still alive."""
        children = self.children()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(children, timeout=10)
        self.left_in_tmp = sorted(os.listdir(self.tmpdir))
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return alive


@contextlib.contextmanager
def running_server(model, *args: str, **kwargs):
    """A Server for the length of a `with` block (a module fixture's body), stopped after
    it and checked to have exited 0 with no child left behind."""
    server = Server(model, *args, **kwargs)
    try:
        yield server
    finally:
        alive = server.stop()
    assert server.proc.returncode == 0 and not alive, f"exit status {server.proc.returncode}, left behind: {alive}"



class FakeEngine:
    """What DashboardHub uses of an AsyncLLM: its watchers of the core process, and the
    front end's state a snapshot's text comes from (no requests here)."""

    errored = False
    tokenizer = None

    def __init__(self):
        self.watchers = {}                                  # name -> (factory, callback)
        self.output_processor = types.SimpleNamespace(request_states={})

    def watch(self, name, factory, callback):
        self.watchers[name] = (factory, callback)

    def unwatch(self, name):
        self.watchers.pop(name, None)


