"""The package's layout rules (issue 23), read from the source.

Imports run downward only:

    entrypoints / trace / exercises  ->  engine  ->  core, worker  ->  model  ->  layers
        ->  the vocabulary (config, sampling_params, outputs, messages, dashboard_messages, events) and utils

`core` and `worker` never import each other, and no module imports itself back through
others (no import circles). Every import statement counts, also one inside a function or
under `if TYPE_CHECKING:`: a student reading a file should never have to look upward.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanopaged"

VOCABULARY = {"config", "sampling_params", "outputs", "messages", "dashboard_messages", "events"}
# extensions: the table of later features, named by strings (it imports them by name only)
RANKS = {"utils": 0, **{name: 0 for name in VOCABULARY}, "extensions": 0, "layers": 1, "model": 2, "core": 3,
         "worker": 3, "engine": 4, "entrypoints": 5, "trace": 5, "exercises": 5}
SHIMS = {"chat", "serve", "exercise", "__main__"}       # `python -m nanopaged.X` doors: the top


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def group(module: str) -> str:
    """The layer a module belongs to: its first name below nanopaged ("" for the
    package itself, the public API, which sits with the entry layer)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def rank(module: str) -> int:
    g = group(module)
    return 5 if g == "" or g in SHIMS else RANKS[g]


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported nanopaged module, line, at module level) for every import in module."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    # module level: the body, and inside a module-level `if` (`if TYPE_CHECKING:` too)
    top_level = {id(node) for node in tree.body}
    top_level |= {id(n) for node in tree.body if isinstance(node, ast.If) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from pkg import module` imports the module; `from module import name` the module
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "nanopaged" and target != module:
                found.append((target, node.lineno, id(node) in top_level))
    return found


def test_every_import_runs_downward():
    upward = []
    for module in sorted(MODULES):
        for target, line, _ in imports(module):
            if group(target) == group(module):
                continue
            same_rank_allowed = rank(module) in (0, 5)          # the vocabulary; the entry layer
            if rank(target) > rank(module) or (rank(target) == rank(module) and not same_rank_allowed):
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert upward == [], "\n".join(upward)


def test_no_import_circles():
    graph = {m: {t for t, _, top in imports(m) if top and t in MODULES} for m in MODULES}
    # a module imports its package's __init__ too (Python runs it first), but that is not
    # an edge a reader follows: count only what the source names
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(m):                      # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in graph[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                t = stack.pop()
                on_stack.discard(t)
                component.append(t)
                if t == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert circles == []


def test_the_rules_can_see_a_violation(tmp_path, monkeypatch):
    """The checker itself: an upward import and a circle planted in a copy are found."""
    import shutil
    copy = tmp_path / "nanopaged"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "core" / "block_table.py", "a") as f:
        f.write("\nfrom ..worker import sampler\n")
    with open(copy / "messages.py", "a") as f:
        f.write("\nfrom . import events\n")
    with open(copy / "events.py", "a") as f:
        f.write("\nfrom . import messages\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {module_name(p): p for p in copy.rglob("*.py")})
    with pytest.raises(AssertionError, match="block_table.py.*imports nanopaged.worker.sampler"):
        test_every_import_runs_downward()
    with pytest.raises(AssertionError, match="nanopaged.events"):
        test_no_import_circles()


@pytest.mark.parametrize("layer", sorted(RANKS))
def test_each_layer_is_a_package_or_a_vocabulary_module(layer):
    assert f"nanopaged.{layer}" in MODULES, f"nanopaged/{layer} is missing"


TESTS = Path(__file__).resolve().parent
REPOSITORY_TESTS = {"test_layout.py", "test_packaging.py", "test_repo.py"}


def test_tests_mirror_the_package():
    """A test lives in the folder of the layer it checks (tests/core/ for nanopaged/core/,
    ...; tests/course/ for the chapters and exercises), so a reader finds a file's tests
    by its path. The top level keeps only the shared helpers and the repository's own
    promises (the layout, packaging, the README's commands)."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - (set(RANKS) - VOCABULARY - {"utils"}) - {"course"} == set(), "test folders that name no layer"
    top = {p.name for p in TESTS.glob("test_*.py")}
    assert top == REPOSITORY_TESTS, f"tests at the top level that belong in a layer's folder: {top - REPOSITORY_TESTS}"
    for folder in folders:
        assert list((TESTS / folder).rglob("test_*.py")), f"tests/{folder} holds no tests"


# -- sizes (issue 35): the base a student reads first stays small and feature-free --------------

BASE_PARTS = {"core/scheduler.py": 300, "worker/model_runner.py": 300}
FEATURE_WORDS = ["draft", "spec_", "speculative", "placeholder", "grammar", "structured_output", "beam",
                 "async_scheduling", "proposer"]
MAX_MODULE_LINES = 400


@pytest.mark.parametrize("path", sorted(BASE_PARTS))
def test_the_base_scheduler_and_runner_are_short_and_name_no_later_feature(path):
    text = (PACKAGE / path).read_text()
    assert len(text.splitlines()) <= BASE_PARTS[path], f"{path}: {len(text.splitlines())} lines"
    named = [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
             if any(w in line.lower() for w in FEATURE_WORDS)]
    assert named == [], f"{path} names a later feature:\n" + "\n".join(named)


def test_no_isinstance_on_a_proposer_class():
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in PACKAGE.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "isinstance(" in line and "proposer" in line.lower()]
    assert found == []


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}

