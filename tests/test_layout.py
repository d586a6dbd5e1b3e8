"""The package's layout rules, read from the source.

Imports run downward only:

    entrypoints / trace / exercises  ->  every later feature  ->  engine  ->  core, worker
        ->  model  ->  layers  ->  the vocabulary (config, sampling_params, lora_request,
        outputs, messages, events, features) and utils

The base is layers, model, core, worker and engine, with the vocabulary and utils under
them. Every later feature (async scheduling, speculative decoding, beam search,
structured outputs, pipeline parallelism, quantization, the dashboard, CPU graphs, the
worker processes) is one package beside the base folders and sits above the whole base:
it may import any base module and another feature, and the base imports no feature.
`core` and `worker` never import each other, and no module imports itself back through
others (no import circles).

Every import counts: at module level, inside a function, under `if TYPE_CHECKING:`, and
an `importlib.import_module("nanopaged...")` or `__import__("nanopaged...")` whose name
is a string literal. A student reading a file should never have to look upward.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanopaged"

VOCABULARY = {"config", "sampling_params", "outputs", "messages", "events", "lora_request"}
# features: the composition table, which names each feature's classes by strings (it
# imports them by computed name only, never by a literal)
BASE = {"layers": 1, "model": 2, "core": 3, "worker": 3, "engine": 4}
# every other package below nanopaged/ is a later feature: above the whole base (it may
# import any base layer, and the base never imports it), below the entry layer
FEATURES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
                  and p.name not in {*BASE, "utils", "entrypoints", "trace", "exercises"})
RANKS = {"utils": 0, **{name: 0 for name in VOCABULARY}, "features": 0, **BASE,
         **{name: 4.5 for name in FEATURES}, "entrypoints": 5, "trace": 5, "exercises": 5}
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


def rank(module: str) -> float:
    g = group(module)
    return 5 if g == "" or g in SHIMS else RANKS[g]


def _relative(package: str, level: int, name: str) -> str:
    """`from <level dots><name> import ...` inside `package`, as an absolute name."""
    base = package.split(".")[:len(package.split(".")) - level + 1]
    return ".".join(base + ([name] if name else []))


def _literal_import(node: ast.Call, module: str, package: str) -> str | None:
    """The module an `importlib.import_module("...")` / `import_module("...")` /
    `__import__("...")` call names by a string literal (relative only with a `package`
    of `__package__` or `__name__`), else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    text = first.value
    if not text.startswith("."):
        return text
    anchor = node.args[1] if name == "import_module" and len(node.args) > 1 else \
        next((k.value for k in node.keywords if k.arg == "package"), None)
    if not isinstance(anchor, ast.Name) or anchor.id not in ("__package__", "__name__"):
        return None
    level = len(text) - len(text.lstrip("."))
    return _relative(package if anchor.id == "__package__" else module, level, text[level:])


def imports(module: str) -> list[tuple[str, int]]:
    """(imported nanopaged module, line) for every import in module: at module level,
    inside a function or an `if` (`if TYPE_CHECKING:` too), and a string literal given
    to importlib.import_module or __import__."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _relative(package, node.level, node.module) if node.level else node.module or ""
            # `from pkg import module` imports the module; `from module import name` the module
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        elif isinstance(node, ast.Call) and (target := _literal_import(node, module, package)) is not None:
            targets = [target]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "nanopaged" and target != module:
                found.append((target, node.lineno))
    return found


def test_every_import_runs_downward():
    upward = []
    for module in sorted(MODULES):
        for target, line in imports(module):
            if group(target) == group(module):
                continue
            same_rank_allowed = rank(module) in (0, 4.5, 5)     # the vocabulary; features; the entry layer
            if rank(target) > rank(module) or (rank(target) == rank(module) and not same_rank_allowed):
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert upward == [], "\n".join(upward)


def test_no_import_circles():
    # every edge counts (module level, in a function, under TYPE_CHECKING, an importlib
    # literal). A module imports its package's __init__ too (Python runs it first), but
    # that is not an edge a reader follows: count only what the source names
    graph = {m: {t for t, _ in imports(m) if t in MODULES} for m in MODULES}
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
    assert circles == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in sorted(circles))


def _planted_copy(tmp_path, monkeypatch, new: dict[str, str] | None = None,
                  appended: dict[str, str] | None = None) -> Path:
    """A copy of the package with `new` files written and `appended` text added to
    existing ones (paths below nanopaged/); the rules then read the copy."""
    import shutil
    copy = tmp_path / "nanopaged"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in (new or {}).items():
        (copy / name).write_text(text)
    for name, text in (appended or {}).items():
        with open(copy / name, "a") as f:
            f.write("\n" + text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {module_name(p): p for p in copy.rglob("*.py")})
    return copy


# each pair closes its circle with one kind of import, b's; a imports b at module level
CIRCLES = {
    "module_level": "from . import {a}\n",
    "in_function": "def f():\n    from . import {a}\n",
    "importlib_literal": "import importlib\n\nimportlib.import_module('nanopaged.utils.{a}')\n",
    "importlib_relative": "import importlib\n\n\ndef f():\n    return importlib.import_module('.{a}', __package__)\n",
    "dunder_import": "def f():\n    __import__('nanopaged.utils.{a}')\n",
    "type_checking": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from . import {a}\n",
}


def test_the_rules_see_a_circle_of_each_kind(tmp_path, monkeypatch):
    """The checker itself: a circle planted in a copy is found whichever kind of import
    closes it (and only the planted ones are)."""
    new = {}
    for kind, closing in CIRCLES.items():
        a, b = f"plant_{kind}_a", f"plant_{kind}_b"
        new[f"utils/{a}.py"] = f"from . import {b}\n"
        new[f"utils/{b}.py"] = closing.format(a=a)
    _planted_copy(tmp_path, monkeypatch, new)
    with pytest.raises(AssertionError) as caught:
        test_no_import_circles()
    found = [line.strip() for line in str(caught.value).splitlines() if "plant_" in line and "<->" in line]
    assert sorted(found) == sorted(f"nanopaged.utils.plant_{kind}_a <-> nanopaged.utils.plant_{kind}_b"
                                   for kind in CIRCLES)


# one upward import of each kind, planted in core/block_table.py (the core layer)
UPWARD = {
    "from ..worker import sampler": "nanopaged.worker.sampler",                     # module level, same rank
    "def _f():\n    from ..engine import llm_engine": "nanopaged.engine.llm_engine",  # in a function
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..pipeline import scheduler":
        "nanopaged.pipeline.scheduler",                                             # TYPE_CHECKING
    "import importlib\ndef _g():\n    importlib.import_module('nanopaged.spec_decode.scheduler')":
        "nanopaged.spec_decode.scheduler",                                          # importlib, absolute
    "def _h():\n    importlib.import_module('..beam_search.scheduler', package=__package__)":
        "nanopaged.beam_search.scheduler",                                          # importlib, relative
    "def _i():\n    __import__('nanopaged.dashboard.sampler')": "nanopaged.dashboard.sampler",  # __import__
}


def test_the_rules_see_an_upward_import_of_each_kind(tmp_path, monkeypatch):
    """The checker itself: an upward import of each kind planted in a copy is found."""
    _planted_copy(tmp_path, monkeypatch, appended={"core/block_table.py": "\n".join(UPWARD) + "\n"})
    with pytest.raises(AssertionError) as caught:
        test_every_import_runs_downward()
    lines = [line.strip() for line in str(caught.value).splitlines()]
    found = [line.split(" imports ")[1] for line in lines if line.startswith("nanopaged/core/block_table.py:")]
    assert sorted(found) == sorted(UPWARD.values())


# `--headless` serves no API: it runs the worker processes' node in place of a server, so
# that one function of api_server.py is the multiproc package's door
HEADLESS_DOOR = {"nanopaged.multiproc.headless", "nanopaged.quantization.gguf_loader"}


def test_the_server_finds_its_features_through_its_table():
    """The HTTP server (entrypoints/openai) imports no feature package: a feature's flags,
    routes and series come through server_features.py's table, by qualified name."""
    found = [(m, name, line) for m in MODULES if m.startswith("nanopaged.entrypoints.openai")
             for name, line in imports(m) if group(name) in FEATURES and name not in HEADLESS_DOOR]
    assert not found, found


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


# -- the base a student reads first names no later feature ---------------------------------

BASE_PARTS = ["core/scheduler.py", "worker/model_runner.py"]
BASE_RECORDS = ["core/sequence.py", "core/scheduler_output.py", "messages.py", "worker/model_input.py"]
FEATURE_WORDS = ["draft", "spec_", "speculative", "placeholder", "grammar", "structured_output", "beam",
                 "async_scheduling", "proposer", "lora", "adapter"]


def feature_words(path: str) -> list[str]:
    """The lines of nanopaged/`path` that name a later feature (FEATURE_WORDS)."""
    return [f"{i}: {line.strip()}" for i, line in enumerate((PACKAGE / path).read_text().splitlines(), 1)
            if any(w in line.lower() for w in FEATURE_WORDS)]


@pytest.mark.parametrize("path", BASE_PARTS)
def test_the_base_scheduler_and_runner_name_no_later_feature(path):
    named = feature_words(path)
    assert named == [], f"{path} names a later feature:\n" + "\n".join(named)


@pytest.mark.parametrize("path", BASE_RECORDS)
def test_the_base_records_name_no_later_feature(path):
    """A request's record (Sequence), the scheduler's record of a step
    (ScheduledSequence), the messages between the engine's parts and a forward's input
    (ModelInput) carry the base's state only: a feature keeps its own beside them."""
    named = feature_words(path)
    assert named == [], f"{path} names a later feature:\n" + "\n".join(named)


def test_no_isinstance_on_a_proposer_class():
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in PACKAGE.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "isinstance(" in line and "proposer" in line.lower()]
    assert found == []
