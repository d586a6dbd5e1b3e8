"""Child-process plumbing shared by the EngineCore process (engine/engine_core_client.py)
and the tensor-parallel workers (worker/executor.py): the error a front end gets when
its core is gone, dying with the parent, and saying how a child ended.
vLLM keeps EngineDeadError in a leaf `vllm/v1/engine/exceptions.py` for the same reason:
the layers below the engine raise it without importing the engine.
"""
from __future__ import annotations

import signal
import sys


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
