"""The course cannot rot: every ```python block of chapters/*.md runs, and prints what it says.

Each chapter is one test. Its ```python blocks run in order in one fresh namespace, with
the repository root as the working directory, exactly as a reader pasting them into
`python` started there would run them. A plain ``` block that directly follows a python
block (nothing but blank lines between them) is that block's expected output: what the
block printed must equal it (trailing spaces ignored). A failure names the chapter, the
block number and the line of the chapter it starts on.

Other tests check that every module of nanopaged/ is explained in some chapter, and that
the chapters follow the split of issue 35: a base chapter lists only base files, and a
feature's chapter names its package's files and shows the hook it overrides.
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


# The chapters of the base engine, and each feature's chapter (its package below nanopaged/).
BASE_CHAPTERS = [p for p in CHAPTERS if re.match(r"(0[1-9]|11)[a-z]?-", p.name)]
EXTENSION_CHAPTERS = {"10": "beam_search", "16": "async_sched", "17": "multiproc",
                      "18": "structured_output", "19": "spec_decode", "20": "pipeline",
                      "21": "quantization", "22": "lora"}
BASE_FOLDERS = {"core", "worker", "engine", "model", "layers", "utils", "entrypoints", "trace", "exercises"}


def feature_modules(package: str) -> list[str]:
    """A feature package and every module in it, dotted."""
    folder = ROOT / "nanopaged" / package
    return [f"nanopaged.{package}"] + [f"nanopaged.{package}.{p.stem}" for p in sorted(folder.glob("*.py"))
                                       if p.name != "__init__.py"]


FEATURE_PACKAGES = sorted(p.parent.name for p in (ROOT / "nanopaged").glob("*/__init__.py")
                          if p.parent.name not in BASE_FOLDERS)


def files_paragraph(text: str) -> str:
    """A chapter's opening "Files:" (or "File:") paragraph: from that line to the first
    blank line; "" when there is none."""
    m = re.search(r"^Files?:.*?(?=\n[ \t]*\n|\Z)", text, re.S | re.M)
    return m.group(0) if m else ""


def module_pattern(module: str) -> re.Pattern:
    """Where a text names `module` (dotted) as a path: nanopaged.beam_search.scheduler as
    `nanopaged/beam_search/scheduler.py`, `beam_search/scheduler.py` or `scheduler.py` (not
    `core/scheduler.py`); a package as its folder (`nanopaged/spec_decode/` or `spec_decode/`)."""
    parts = module.split(".")
    leaf = "/" if (ROOT / Path(*parts)).is_dir() else ".py"
    tails = ["/".join(parts[i:]) + leaf for i in range(len(parts))]
    return re.compile(r"(?<![\w/])(?:" + "|".join(map(re.escape, tails)) + r")")


def named_modules(text: str, modules) -> list[str]:
    return [m for m in modules if module_pattern(m).search(text)]


def hook_section(text: str) -> str:
    """The "## The hook" (or "## The hooks") section of a chapter, heading to next heading."""
    m = re.search(r"^## The hooks?[ \t]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1) if m else ""


def test_module_pattern():
    p = module_pattern("nanopaged.beam_search.scheduler")
    assert p.search("`nanopaged/beam_search/scheduler.py` (x)") and p.search("see `beam_search/scheduler.py`")
    assert p.search("see `scheduler.py`") and not p.search("core/scheduler.py")
    assert not p.search("my_beam_search/scheduler.py") and not p.search("nanopaged.beam_search.scheduler")
    assert module_pattern("nanopaged.spec_decode").search("`nanopaged/spec_decode/` (")
    assert module_pattern("nanopaged.spec_decode").search("spec_decode/scheduler.py")
    assert not module_pattern("nanopaged.spec_decode").search("core/spec_decode.py")
    assert files_paragraph("# t\n\nFiles: a,\nb.\n\nprose") == "Files: a,\nb."


@pytest.mark.parametrize("chapter", BASE_CHAPTERS, ids=lambda p: p.name)
def test_base_chapter_lists_only_base_files(chapter):
    """Chapters 01-09 and 11 read the base engine: their Files paragraph names no module
    of a later feature (a package beside the base folders)."""
    files = files_paragraph(chapter.read_text())
    assert files, f"{chapter.name} has no Files: paragraph"
    every = [m for package in FEATURE_PACKAGES for m in feature_modules(package)]
    assert not named_modules(files, every), \
        f"{chapter.name}'s Files paragraph names feature modules {named_modules(files, every)}"


@pytest.mark.parametrize("number", sorted(EXTENSION_CHAPTERS))
def test_extension_chapter_shows_its_hook(number):
    """A feature's chapter names its package's files in its Files paragraph and has a
    "## The hook(s)" section whose python snippet imports the package and prints what
    it overrides (checked against the block under it, by test_chapter_snippets_run), and
    says how the class is built (`Composition`, features.py)."""
    (chapter,) = [p for p in CHAPTERS if p.name.startswith(number + "-")]
    modules = feature_modules(EXTENSION_CHAPTERS[number])
    text = chapter.read_text()
    assert named_modules(files_paragraph(text), modules), \
        f"{chapter.name}'s Files paragraph names none of {modules}"
    section = hook_section(text)
    assert section, f"{chapter.name} has no '## The hook' section"
    blocks = python_blocks(section)
    assert any(expected is not None and any(m in code for m in modules) for _, code, expected in blocks), \
        f"{chapter.name}'s hook section has no python snippet importing one of {modules} with its output"
    assert "Composition" in section, f"{chapter.name}'s hook section does not say how the class is built"
