"""How big nanopaged is, folder by folder: `python -m nanopaged.utils.size` prints a
markdown table of nanopaged/'s Python: the base (the vocabulary modules at nanopaged/*.py,
utils and the base layers), each later feature's package, and the entry layer.

*Code lines* hold code: not blank, not only a comment, not part of a docstring.
*Physical lines* are all of them.
"""
from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

from .cli import quiet_broken_pipe

PACKAGE = Path(__file__).resolve().parents[1]
BASE = ["vocabulary", "utils", "layers", "model", "core", "worker", "engine"]  # vocabulary: nanopaged/*.py
ENTRY = ["entrypoints", "trace", "exercises"]


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


def features(package: Path = PACKAGE) -> list[str]:
    """The later features' packages: every package below nanopaged/ that is neither a
    base layer nor the entry layer."""
    return sorted(p.name for p in package.iterdir() if (p / "__init__.py").exists()
                  and p.name not in {*BASE, *ENTRY})


def folder_size(folder: str, package: Path = PACKAGE) -> tuple[int, int, int]:
    """(files, code lines, physical lines) of one folder's Python ("vocabulary": the
    modules at nanopaged/*.py)."""
    files = sorted(package.glob("*.py")) if folder == "vocabulary" else sorted((package / folder).rglob("*.py"))
    texts = [f.read_text() for f in files]
    return len(files), sum(code_lines(t) for t in texts), sum(len(t.splitlines()) for t in texts)


def size_table(package: Path = PACKAGE) -> str:
    """The markdown table: a row per folder and a row per part (the base, the features,
    the entry layer), then the whole package."""
    rows = ["| folder | files | code lines | physical lines |", "|---|---:|---:|---:|"]
    total = [0, 0, 0]
    for part, folders in (("the base", BASE), ("the features", features(package)), ("the entry layer", ENTRY)):
        sizes = [folder_size(f, package) for f in folders]
        rows += [f"| {f} | {n} | {c:,} | {p:,} |" for f, (n, c, p) in zip(folders, sizes)]
        sums = [sum(s[i] for s in sizes) for i in range(3)]
        rows.append(f"| **{part}** | **{sums[0]}** | **{sums[1]:,}** | **{sums[2]:,}** |")
        total = [t + s for t, s in zip(total, sums)]
    rows.append(f"| **nanopaged** | **{total[0]}** | **{total[1]:,}** | **{total[2]:,}** |")
    return "\n".join(rows)


@quiet_broken_pipe
def main() -> int:
    print(size_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
