"""Promises the repository makes to a newcomer: the README's two commands and CI."""
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
