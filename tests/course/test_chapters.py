"""The course cannot rot: every ```python block of chapters/*.md runs, and prints what it says.

Each chapter is one test. Its ```python blocks run in order in one fresh namespace, with
the repository root as the working directory, exactly as a reader pasting them into
`python` started there would run them. A plain ``` block that directly follows a python
block (nothing but blank lines between them) is that block's expected output: what the
block printed must equal it (trailing spaces ignored). A failure names the chapter, the
block number and the line of the chapter it starts on.

A second test checks that every module of nanopaged/ is explained in some chapter.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))

# A fenced block: its info string (language) and its body. Fences start a line.
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, expected output or None) of each ```python block of `text`."""
    fences = list(_FENCE.finditer(text))
    blocks = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        expected = None
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        if nxt is not None and nxt.group(1) == "" and not text[m.end():nxt.start()].strip():
            expected = nxt.group(2)
        blocks.append((text.count("\n", 0, m.start()) + 1, m.group(2), expected))
    return blocks


def _normalize(out: str) -> str:
    return "\n".join(line.rstrip() for line in out.strip("\n").splitlines())


@pytest.fixture
def chapter_env(monkeypatch, tmp_path):
    """Repo root as cwd; tempfile's folders under tmp_path; sys.path and torch's thread
    count restored afterwards.

    One torch thread: the snippets use tiny tensors, and on a small machine that is
    busy with something else a second thread makes every op wait for a core (we
    measured a tiny-model step going from ~2 ms to ~170 ms).
    """
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_chapter_snippets_run(chapter, chapter_env):
    blocks = python_blocks(chapter.read_text())
    assert blocks, f"{chapter.name} has no ```python block"
    namespace: dict = {"__name__": f"chapter_{chapter.stem.replace('-', '_')}"}
    for number, (line, code, expected) in enumerate(blocks, start=1):
        where = f"{chapter.name}, python block {number} (line {line})"
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                exec(compile(code, f"<{where}>", "exec"), namespace)
        except Exception:
            pytest.fail(f"{where} raised:\n{traceback.format_exc()}", pytrace=False)
        if expected is not None and _normalize(stdout.getvalue()) != _normalize(expected):
            pytest.fail(f"{where} printed:\n{stdout.getvalue()}\nbut the chapter shows:\n{expected}",
                        pytrace=False)


def test_every_module_appears_in_a_chapter():
    text = "\n".join(p.read_text() for p in CHAPTERS)
    modules = sorted(p.name for p in (ROOT / "nanopaged").rglob("*.py")
                     if p.stem not in ("__init__", "__main__"))
    missing = [m for m in modules if m not in text]
    assert not missing, f"no chapter mentions {missing}"


def test_python_blocks_parser():
    text = ("intro\n```python\nprint(1)\n```\n\n```\n1\n```\n"
            "```python\nx = 2\n```\ntext between\n```\nnot output\n```\n")
    assert python_blocks(text) == [(2, "print(1)\n", "1\n"), (9, "x = 2\n", None)]
