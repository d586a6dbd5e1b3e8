"""Child-process plumbing shared by the EngineCore process (engine/engine_core_client.py)
and the tensor-parallel workers (worker/executor.py), written once: the error a front
end gets when its core is gone, spawning a child and waiting until it is ready, dying
with the parent, stopping children, and saying how a child ended.
vLLM keeps EngineDeadError in a leaf `vllm/v1/engine/exceptions.py` for the same reason:
the layers below the engine raise it without importing the engine.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; no request can finish (vLLM's name). The
    message says why when the core could tell (its traceback), else its exit code."""


def die_with_parent() -> None:
    """On Linux, ask the kernel to SIGKILL this process when its parent dies (the
    one-second parent check covers other systems)."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except OSError:
            pass


def exit_reason(returncode: int) -> str:
    """How a child ended, for an error message: the signal that killed it, or its exit code."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"it exited with code {returncode}"


# -- a child process: spawn, ready pipe, stop ------------------------------------------
# Both kinds of child (the EngineCore process, a tensor-parallel worker) are a fresh
# interpreter (not fork: torch's threads do not survive it; not multiprocessing's spawn:
# it re-runs the user's __main__), told its settings on stdin, answering on a pipe of its
# own once it is ready (its model loaded) or why it is not (its traceback).

def spawn_child(entry: str, settings: object) -> tuple[subprocess.Popen, int]:
    """Start `python -c "from <module> import <Class>; <Class>.main()"` for entry
    "module:Class", hand it (settings, the ready pipe's write end) on stdin; returns
    the process and the ready pipe's read end (close it after wait_ready)."""
    module, cls = entry.split(":")
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", f"from {module} import {cls}; {cls}.main()"],
                                stdin=subprocess.PIPE, pass_fds=(ready_w,))
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    try:
        proc.stdin.write(pickle.dumps((settings, ready_w)))
        proc.stdin.close()
    except BaseException:              # e.g. it died at once (BrokenPipeError): leave nothing
        proc.kill()
        proc.wait()
        os.close(ready_r)
        raise
    return proc, ready_r


def wait_ready(children: dict[int, tuple[str, subprocess.Popen]], timeout_s: float,
               check=None) -> dict[int, object]:
    """Wait until every child (ready fd -> (its name for messages, its process)) said it
    is ready; returns fd -> the payload it sent with "ready". check: called at least
    each second while waiting; what it raises ends the wait (another host's failure).

    Raises:
        RuntimeError: one did not answer within timeout_s, exited first (how: its exit
            code or signal), or failed (its traceback in the message).
    """
    deadline = time.monotonic() + timeout_s
    waiting, payloads = dict(children), {}
    while waiting:
        left = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(list(waiting), [], [], left if check is None else min(left, 1.0))
        if not ready and check is not None and left > 1.0:
            check()
            continue
        if not ready:
            names = ", ".join(name for name, _ in waiting.values())
            raise RuntimeError(f"{names} did not start within {timeout_s:.0f} s")
        for fd in ready:
            name, proc = waiting.pop(fd)
            with os.fdopen(os.dup(fd), "rb") as f:
                try:
                    status, payloads[fd] = pickle.load(f)
                except EOFError:
                    raise RuntimeError(f"{name} exited at start ({exit_reason(proc.wait(5))})") from None
            if status != "ready":
                raise RuntimeError(f"{name} failed to start:\n{payloads[fd]}")
    return payloads


def read_settings() -> tuple[object, int]:
    """The child's side of spawn_child: (settings, ready fd) from stdin. Also asks to die
    with the parent (die_with_parent) and ignores SIGINT: Ctrl-C in a terminal reaches
    the whole process group, and it is the parent that decides when its children stop
    (it would otherwise die mid-step with a KeyboardInterrupt traceback)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return pickle.load(sys.stdin.buffer)


def report_ready(ready_fd: int, start):
    """The child's side of wait_ready: run start() (build what the child serves); send
    ("ready", its second value) on the pipe and return its first, or send ("failed", the
    traceback) and exit with status 1."""
    with os.fdopen(ready_fd, "wb") as ready:
        try:
            served, payload = start()
            pickle.dump(("ready", payload), ready)
            return served
        except BaseException:
            pickle.dump(("failed", traceback.format_exc()), ready)
            ready.flush()
            os._exit(1)


def stop_processes(procs: list[subprocess.Popen], wait_s: float = 5.0) -> None:
    """End procs that are still running: wait_s for them to go by themselves (the caller
    asked them already), then terminate, then kill, waiting wait_s after each."""
    for stop in (None, "terminate", "kill"):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            if stop:
                getattr(p, stop)()
        end = time.monotonic() + wait_s
        for p in alive:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return


def exit_child(exit_code: int) -> None:
    """Leave a child process: flush, then os._exit (skip interpreter teardown, where
    torch's and gloo's threads can hang)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
