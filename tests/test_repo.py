"""Promises the repository makes to a newcomer: the README's two commands, CI, and the
command that prints the README's size table."""
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
