"""Every command line ends quietly when its reader goes away (`... | head -3`):
nanopaged/utils/cli.py's quiet_broken_pipe around each main.

The reader here is a pipe whose read end is closed before the command starts, so every
write fails (a real `head` that exits early is the same, only sometimes: output that
fits in the pipe's buffer before `head` exits never fails). Both with stdout buffered
(Python's default for a pipe: the error came at the flush at exit, "Exception ignored
... BrokenPipeError") and unbuffered (PYTHONUNBUFFERED=1: a traceback at the print).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COMMANDS = {
    "exercise hint": ["-m", "nanopaged.exercise", "hint", "2"],
    "exercise list": ["-m", "nanopaged.exercise", "list"],
    "exercise start": ["-m", "nanopaged.exercise", "start", "1"],
    "exercise check": ["-m", "nanopaged.exercise", "check", "1"],
    "exercise reset": ["-m", "nanopaged.exercise", "reset", "1"],
    "chat --help": ["-m", "nanopaged.chat", "--help"],
    "serve --help": ["-m", "nanopaged.serve", "--help"],
    "trace --help": ["-m", "nanopaged.trace", "--help"],
}


def run_into_a_closed_pipe(args: list[str], cwd: Path, unbuffered: bool) -> subprocess.CompletedProcess:
    read, write = os.pipe()
    os.close(read)                       # the reader is gone before the first byte
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TMPDIR=str(cwd),
               **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    try:
        return subprocess.run([sys.executable, *args], stdout=write, stderr=subprocess.PIPE, text=True,
                              cwd=cwd, env=env, timeout=240)
    finally:
        os.close(write)


# unbuffered: the commands whose output a reader cut short most likely (the rest only
# differ in where the write fails)
CASES = [(name, False) for name in COMMANDS] + [(name, True) for name in ("exercise hint", "chat --help",
                                                                          "trace --help")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, unbuffered", CASES, ids=[f"{n}-{'unbuffered' if u else 'buffered'}" for n, u in CASES])
def test_a_reader_that_stops_early_gets_no_traceback(name, unbuffered, tmp_path):
    if name in ("exercise check", "exercise reset"):          # the stub `start 1` writes
        from nanopaged.exercises import all_exercises
        from nanopaged.exercises.runner import exercise_file, stub_source
        (tmp_path / "exercises").mkdir()
        exercise_file(all_exercises()[1], tmp_path / "exercises").write_text(stub_source(all_exercises()[1]))
    done = run_into_a_closed_pipe(COMMANDS[name], tmp_path, unbuffered)
    assert "BrokenPipeError" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    # 1: the write failed (Python's documented status); 0: argparse's --help, which
    # ignores a failed write itself, when nothing was left for the flush at exit
    assert done.stderr == "" and done.returncode in (0, 1), (done.returncode, done.stderr)


@pytest.mark.timeout(300)
def test_a_trace_into_a_closed_pipe_ends_quietly(tmp_path, tiny_model_dir):
    """A traced run writes a screenful per step: the reader left at the first one. (rich,
    which draws the trace, already ends a broken pipe as quiet_broken_pipe does; this
    keeps it so.)"""
    done = run_into_a_closed_pipe(["-m", "nanopaged.trace", "--model", str(tiny_model_dir), "--scenario", "cow",
                                   "--no-pause"], tmp_path, unbuffered=False)
    assert "BrokenPipeError" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
