"""What every `python -m nanopaged.X` command line shares: a reader that stops reading
(`python -m nanopaged.exercise hint 2 | head -3`) ends the command quietly.

When the reader of a pipe exits, the next write to it fails with EPIPE; Python ignores
SIGPIPE, so the write raises BrokenPipeError, a traceback follows, and if the output
was still in stdout's buffer, the flush at exit prints one more ("Exception ignored
in ... BrokenPipeError"). Python's documentation (the signal module, "Note on
SIGPIPE") gives the cure used here: catch BrokenPipeError around main, then point stdout
at /dev/null so the flush at exit writes nowhere, and exit with status 1.
"""
from __future__ import annotations

import functools
import os
import sys


def quiet_broken_pipe(main):
    """Wrap a command line's `main` (returning an exit status): stdout is flushed before
    it returns or raises (so a closed pipe shows up here, not at exit), and a
    BrokenPipeError becomes exit status 1 with nothing printed."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            try:
                return main(*args, **kwargs)
            finally:                 # argparse's --help exits by SystemExit: flushed too
                if sys.stdout is not None:
                    sys.stdout.flush()
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (AttributeError, ValueError, OSError):     # a stdout with no file behind it
                sys.stdout = None
            return 1
    return wrapper
