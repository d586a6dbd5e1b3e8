"""bench.py's `--results-entry`: the run printed as an entry of benchmarks/RESULTS.md, so
adding an entry is a paste. An entry holds the date, the machine (CPU, flags, load),
the dtype and threads, the exact command and commit, the tables the sections printed,
the rest of their output as printed, and a line where the one paragraph on what it shows
goes: the numbers come from the run, the reading from whoever ran it.

    python bench.py --sections throughput,chat --results-entry "one package per feature, after"

Every section's output is recorded (the sections print as before, and `recorded_run`
keeps a copy), so the flag works for each of them. What a child process writes to the
terminal itself (a server's log) is not recorded; the sections' own summaries are.
"""
from __future__ import annotations

import io
import shlex
import subprocess
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

PARAGRAPH = "(One paragraph: what this run shows, and what it does not.)"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table as RESULTS.md writes them: the header, the rule, a line per row."""
    row = lambda cells: "| " + " | ".join(str(cell) for cell in cells) + " |"
    return "\n".join([row(header), "|" + "---|" * len(header), *map(row, rows)])


def results_entry(title: str, output: str, *, machine: str, flags: str, dtype: str, threads: int,
                  command: str, revision: str, now: datetime) -> str:
    """The entry, in RESULTS.md's form. `output` is what the sections printed: its markdown
    tables (lines that start with "|", indented or not) are kept as tables, every other
    line goes in a text block beneath them, as printed."""
    tables, rest, in_table = [], [], False
    for line in output.splitlines():
        is_row = line.lstrip().startswith("|")
        if is_row and not in_table and tables:
            tables.append("")                          # a blank line between two tables
        if is_row:
            tables.append(line.strip())
        else:
            rest.append(line.rstrip())
        in_table = is_row
    text = "\n".join(rest).strip("\n")
    parts = [f"## {now:%Y-%m-%d}: {title}", "",
             f"- **Machine:** {machine}; {flags}; dtype {dtype}; "
             f"{threads} torch thread{'s' if threads != 1 else ''}.",
             f"- **Command:** `{command}` ({now:%H:%M} UTC, commit {revision}).", ""]
    if tables:
        parts += [*tables, ""]
    if text:
        parts += ["```text", text, "```", ""]
    return "\n".join([*parts, PARAGRAPH]) + "\n"


def commit() -> str:
    """This checkout's commit, and whether tracked files differ from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        head, changes = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "not recorded"
    return head + (" with uncommitted changes" if changes else "")


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, terminal):
        self.terminal, self.copy = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.terminal.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.terminal.flush()


@contextmanager
def recorded_run(title: str, dtype: str):
    """The sections run inside it print as usual; once they have all ended, the entry is
    printed. The machine line (with its load average) is read before they start."""
    from .common import cpu_flags
    from .tp import machine

    at_start, now = machine(), datetime.now(timezone.utc)
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield
    finally:
        sys.stdout = tee.terminal
    print("\n" + results_entry(title, tee.copy.getvalue(), machine=at_start, flags=cpu_flags(), dtype=dtype,
                               threads=torch.get_num_threads(), command=shlex.join(["python", "bench.py", *sys.argv[1:]]),
                               revision=commit(), now=now))
