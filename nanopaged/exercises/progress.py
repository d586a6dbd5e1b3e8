"""A student's way through the course, for `python -m nanopaged.exercise` (runner.py):
which exercise files passed their check, and where the chapters are.

A `check` that passes records the file's sha256 in its folder's .passed.json, so `list`
says `passed` for as long as the file is the version that passed (an edit makes it
`started` again, until the next check; a failing check forgets it). The chapters are a
checkout's chapters/, or in an installed package nanopaged/_chapters/ (pyproject.toml
copies them there, so a wheel carries them); `start` and `list` print where.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

PASSED_FILE = ".passed.json"   # beside the exercise files: {file name: sha256 of the version that passed}
PACKAGE_DIR = Path(__file__).resolve().parents[1]       # nanopaged/


def chapters_dir() -> Path:
    """The course's chapters: nanopaged/_chapters/ in an installed package (pyproject.toml
    copies chapters/ there), else the checkout's chapters/ beside the package."""
    installed = PACKAGE_DIR / "_chapters"
    return installed if installed.is_dir() else PACKAGE_DIR.parent / "chapters"


def chapter_path(exercise) -> str:
    """Where the exercise's chapter is, as a student would type it: relative to the
    current folder when it is below it (chapters/02-block-manager.md in a checkout),
    else absolute."""
    path = chapters_dir() / exercise.CHAPTER
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _passed_record(folder: Path) -> dict[str, str]:
    """{file name: sha256 of the version that passed its check} ({} if none or unreadable)."""
    try:
        record = json.loads((folder / PASSED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def record_check(path: Path, passed: bool) -> None:
    """Remember (or forget) that the file at `path`, as it is now, passed its check."""
    record = _passed_record(path.parent)
    if passed:
        record[path.name] = _digest(path)
    elif record.pop(path.name, None) is None:
        return
    tmp = path.parent / (PASSED_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path.parent / PASSED_FILE)      # whole or not at all


def state(path: Path) -> str:
    """An exercise file's state for `list`: 'not started' (no file), 'passed' (the file
    is the version whose check passed) or 'started'."""
    if not path.exists():
        return "not started"
    return "passed" if _passed_record(path.parent).get(path.name) == _digest(path) else "started"
