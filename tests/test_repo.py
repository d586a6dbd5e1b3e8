"""Promises the repository makes to a newcomer: the README's two commands, CI, the
command that prints the README's size table, and prose that a reader can follow without
our issue tracker or a calendar."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()[:12]
    return [l.strip() for l in lines if l.startswith("    ") and l.strip()]


def test_readme_opens_with_the_two_commands():
    chat, tests = readme_commands()
    assert chat.endswith("python -m nanopaged.chat") and "pip install torch==2.13.0" in chat
    assert tests.endswith("python -m pytest") and "'.[test]'" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_the_size_command_counts_what_a_reader_reads():
    """`python -m nanopaged.utils.size` (the README's size table): code lines are not
    blank, not only a comment, not a docstring; a row for every folder."""
    from nanopaged.utils.size import BASE, ENTRY, code_lines, features, size_table

    source = '"""Module doc\nover two lines."""\nimport os  # why\n\n# a comment\n\n' \
             'def f(x):\n    """Doc."""\n    return (x +\n            1)\n'
    assert code_lines(source) == 4          # import, def, and the two lines of the return
    rows = [line.split(" | ")[0].removeprefix("| ") for line in size_table().splitlines()[2:]]
    assert [r for r in rows if not r.startswith("**")] == [*BASE, *features(), *ENTRY]


# A reader cannot open our issues or field-case notes, and a date says when, not why: the
# measurements live in benchmarks/RESULTS.md; field-case ids stay in test names only.
POINTER = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b[Ii]ssue \d+|\bC\d{2,}\b")
TEXT_SUFFIXES = {".py", ".md", ".cpp", ".cu", ".h", ".toml", ".txt", ".html", ".js", ".css"}


def pointer_hits(paths, root: Path = ROOT) -> list[str]:
    """`file:line: match` for every date, `issue N` or `C36`-style pointer in `paths`."""
    return [f"{p.relative_to(root)}:{i}: {m.group(0)}"
            for p in paths for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            for m in POINTER.finditer(line)]


def test_no_dates_or_issue_pointers_in_code_chapters_or_readme():
    """The code (nanopaged/, kernels/), the course (chapters/), the user docs (docs/),
    README.md and bench.py say what a thing does and name the test that checks it: no
    date, no `issue 34`, no `C36` (a capital C only, so torch's `c10::` is fine). Dates
    live in benchmarks/RESULTS.md. Binary files (the figures) are skipped."""
    files = [ROOT / "README.md", ROOT / "bench.py"] + [
        p for folder in ("nanopaged", "kernels", "chapters", "docs") for p in sorted((ROOT / folder).rglob("*"))
        if p.is_file() and p.suffix in TEXT_SUFFIXES]
    hits = pointer_hits(files)
    assert not hits, "dates or pointers a reader cannot follow:\n" + "\n".join(hits)


def test_the_pointer_rule_sees_each_kind_and_nothing_else(tmp_path):
    (tmp_path / "x.py").write_text("# fine: c10::BFloat16, CUDA 12.4, vLLM's issue #27462, C3, 12026-12-031\n"
                                   "# 2026-12-03 and issue 34\n# Issue 22\n# field case C36\n")
    assert pointer_hits([tmp_path / "x.py"], tmp_path) == [
        "x.py:2: 2026-12-03", "x.py:2: issue 34", "x.py:3: Issue 22", "x.py:4: C36"]
