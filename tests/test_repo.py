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


# -- the README's size claims, computed (issue 35) ------------------------------------------

import ast      # noqa: E402
import io       # noqa: E402
import re       # noqa: E402
import tokenize  # noqa: E402

PACKAGE = ROOT / "nanopaged"
SIZE_LAYERS = ["vocabulary", "utils", "layers", "model", "core", "worker", "engine", "entrypoints",
               "trace", "exercises"]


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def size_table() -> dict[str, tuple[int, int, int]]:
    """layer -> (files, code lines, physical lines) of nanopaged/'s Python."""
    table = {}
    for layer in SIZE_LAYERS:
        files = sorted(PACKAGE.glob("*.py")) if layer == "vocabulary" else sorted((PACKAGE / layer).rglob("*.py"))
        texts = [f.read_text() for f in files]
        table[layer] = (len(files), sum(code_lines(t) for t in texts), sum(len(t.splitlines()) for t in texts))
    return table


def base_size() -> tuple[int, int, int]:
    """(files, code lines, physical lines) of the base engine: the engine's layers without
    the modules of its extensions (nanopaged/extensions.py MODULES)."""
    from nanopaged import extensions
    names = [m.removeprefix("nanopaged.").replace(".", "/") for ms in extensions.MODULES.values() for m in ms]
    extension_files = {f for n in names for f in [PACKAGE / f"{n}.py", *(PACKAGE / n).rglob("*.py")]}
    files = [f for f in [*PACKAGE.glob("*.py"), *(f for layer in SIZE_LAYERS[1:] if layer not in ("trace", "exercises")
                                                for f in (PACKAGE / layer).rglob("*.py"))]
             if f not in extension_files]
    texts = [f.read_text() for f in files]
    return len(files), sum(code_lines(t) for t in texts), sum(len(t.splitlines()) for t in texts)


def size_markdown(table) -> str:
    rows = ["| layer | files | code lines | physical lines |", "|---|---:|---:|---:|"]
    rows += [f"| {layer} | {f} | {c:,} | {p:,} |" for layer, (f, c, p) in table.items()]
    engine = [table[layer] for layer in SIZE_LAYERS if layer not in ("trace", "exercises")]
    rows.append(f"| **the engine** (all but trace, exercises) | {sum(e[0] for e in engine)} | "
                f"{sum(e[1] for e in engine):,} | {sum(e[2] for e in engine):,} |")
    f, c, p = base_size()
    rows.append(f"| **the base engine** (the engine without its extensions) | {f} | {c:,} | {p:,} |")
    return "\n".join(rows)


def test_code_lines_counts_what_a_reader_reads():
    source = '"""Module doc\nover two lines."""\nimport os  # why\n\n# a comment\n\n' \
             'def f(x):\n    """Doc."""\n    return (x +\n            1)\n'
    assert code_lines(source) == 4          # import, def, and the two lines of the return


def test_the_readme_size_table_is_computed():
    """The table under "## Size" is this test's output; the intro's round figures too."""
    readme = (ROOT / "README.md").read_text()
    table = size_table()
    expected = size_markdown(table)
    assert expected in readme, "README.md's size table is stale; it should read:\n\n" + expected
    engine = [table[layer] for layer in SIZE_LAYERS if layer not in ("trace", "exercises")]
    code, physical = sum(e[1] for e in engine), sum(e[2] for e in engine)
    claim = re.search(r"about\s+([\d,]+)\s+lines\s+of\s+code\s+\(([\d,]+)\s+lines\s+with\s+their\s+docstrings", readme)
    assert claim, "the README's intro names the engine's size"
    assert [int(g.replace(",", "")) for g in claim.groups()] == [round(code, -2), round(physical, -2)]
    base = re.search(r"the\s+base\s+engine\s+alone\s+is\s+about\s+([\d,]+)\s+lines\s+of\s+code", readme)
    assert base and int(base.group(1).replace(",", "")) == round(base_size()[1], -2)
