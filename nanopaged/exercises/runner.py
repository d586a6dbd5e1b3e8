"""python -m nanopaged.exercise: the course's exercises, with checkers.

    python -m nanopaged.exercise list          # every exercise: not started, started or passed
    python -m nanopaged.exercise start N       # make exercises/exNN_*.py, the stub to fill
    python -m nanopaged.exercise check N       # run its checks against your code
    python -m nanopaged.exercise hint N        # the chapter's hint
    python -m nanopaged.exercise reset N       # put the stub back (your file is kept as .bak)

How your code meets the engine: an exercise names one real function of the engine
(say `BlockTable.slots`). `start` writes a file with that function's signature and
docstring and no body. `check` loads your file in the namespace of the engine module the
function comes from (so its imports and helpers are there), puts your function in place
of the engine's (on its class, or in every module that imported it), runs the
exercise's checks (the real engine, on a tiny random model, around your function), and
puts the engine's own back. Each check names a property in words; a failing one says
what it saw. Prediction questions (exercise 0) have no function: you write your answer
in the file, and the check runs the engine and compares.

Files go in ./exercises/ (or --dir). Nothing under nanopaged/ is changed. progress.py
keeps which files passed their check (for `list`) and finds the chapters.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import logging
import signal
import shlex
import sys
import textwrap
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ..utils.cli import quiet_broken_pipe
from . import SWAPS, all_exercises
from .progress import chapter_path, record_check, state

DEFAULT_DIR = "exercises"      # ./exercises/, where `start` writes unless --dir says
CHECK_TIMEOUT_S = 120          # a check taking longer is a failure (an endless loop?)


# -- the student's file --------------------------------------------------------------------------

def resolve(target: str):
    """("module:Class.name" or "module:name") -> (module, owner class or None, name, the
    engine's function)."""
    module_name, qualname = target.split(":")
    module = importlib.import_module(module_name)
    owner = None
    *classes, name = qualname.split(".")
    for cls in classes:
        owner = getattr(owner or module, cls)
    original = (owner.__dict__ if owner is not None else module.__dict__)[name]
    return module, owner, name, original


def _function_source(original) -> str:
    """The engine function's source, dedented to module level."""
    func = original.fget if isinstance(original, property) else getattr(original, "__func__", original)
    return textwrap.dedent(inspect.getsource(func))


def targets(exercise) -> list[str]:
    """The exercise's TARGETS ("module:qualname" each; [] for a prediction question)."""
    return list(exercise.TARGETS or [])


def _stub_of(target: str, number: int) -> str:
    """One target function with its signature and docstring, its body a raise."""
    source = _function_source(resolve(target)[3])
    func = ast.parse(source).body[0]
    lines = [line for line in source.splitlines() if not line.lstrip().startswith("@")]
    shift = len(func.decorator_list)                      # lines dropped above the def
    has_doc = ast.get_docstring(func) is not None
    end = (func.body[0].end_lineno if has_doc else func.body[0].lineno - 1) - shift
    indent = " " * func.body[0].col_offset
    stub = "\n".join(lines[:end]) + f'\n{indent}raise NotImplementedError("exercise {number}: write this")\n'
    if _is_generator(func):          # keep it one, or `for`/`async for` over it fails first
        stub += f"{indent}yield  # never reached: it makes this a generator, as the engine's is\n"
    return stub


def _is_generator(func: ast.AST) -> bool:
    """Whether a def's own body yields (not counting functions defined inside it)."""
    todo = list(func.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def command(name: str, exercise, folder: Path | str = DEFAULT_DIR) -> str:
    """The command line that runs `name` (check, start, ...) on this exercise, with the
    --dir its files are in when that is not the default."""
    where = "" if str(folder) == DEFAULT_DIR else f" --dir {shlex.quote(str(folder))}"
    return f"python -m nanopaged.exercise{where} {name} {exercise.NUMBER}"


def stub_source(exercise, folder: Path | str = DEFAULT_DIR) -> str:
    """The file `start` writes: the task, then each target function with its docstring
    and a body that raises NotImplementedError (or, for a prediction question, the
    answer template)."""
    header = f'"""Exercise {exercise.NUMBER} · {exercise.TITLE} (chapters/{exercise.CHAPTER})\n\n'
    header += textwrap.dedent(exercise.TASK).strip() + "\n\n"
    if not targets(exercise):
        return header + (f"Write your answers below, then run: {command('check', exercise, folder)}\n"
                         '"""\n\n' + textwrap.dedent(exercise.QUESTION).lstrip())
    module = targets(exercise)[0].split(":")[0]
    header += (f"This file runs in the namespace of {module} (its imports and helpers are\n"
               f"there). Check it with: {command('check', exercise, folder)}\n" + '"""\n\n')
    return header + "\n\n".join(_stub_of(t, exercise.NUMBER) for t in targets(exercise))


def reference_source(exercise) -> str:
    """The engine's own functions, as a file `check` accepts (CI checks it passes)."""
    functions = ["\n".join(line for line in _function_source(resolve(t)[3]).splitlines()
                           if not line.lstrip().startswith("@")) for t in targets(exercise)]
    return (f'"""The reference solution of exercise {exercise.NUMBER}: the engine\'s own code."""\n\n'
            + "\n\n\n".join(functions) + "\n")


def load_student_functions(exercise, path: Path) -> list:
    """Run the student's file in a copy of the (first) target module's namespace; returns
    the functions it defines under the targets' names, in TARGETS order. Raises what the
    file raises (SyntaxError, NameError, ...)."""
    module = resolve(targets(exercise)[0])[0]
    names = [resolve(t)[2] for t in targets(exercise)]
    namespace = {k: v for k, v in vars(module).items() if k not in names}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    missing = [n for n in names if not callable(namespace.get(n))]
    if missing:
        raise NameError(f"{path.name} must define {', '.join(missing)}")
    return [namespace[n] for n in names]


@contextmanager
def swapped_in(exercise, functions: list):
    """The engine runs `functions` instead of the exercise's targets inside the block:
    each set on its class (kept a staticmethod / property if the original was one), or,
    for a module function, in every nanopaged module that holds the original."""
    undo, registered = [], False
    try:
        for target, func in zip(targets(exercise), functions):
            module, owner, name, original = resolve(target)
            if owner is not None:
                if isinstance(original, staticmethod):
                    func = staticmethod(func)
                elif isinstance(original, property):
                    func = property(func, original.fset)
                holders = [owner]
            else:
                holders = [m for m_name, m in list(sys.modules.items()) if m_name.startswith("nanopaged")
                           and m is not None and getattr(m, name, None) is original]
            for holder in holders:
                setattr(holder, name, func)
                undo.append((holder, name, original, func))
        SWAPS.extend(undo)
        registered = True
        yield
    finally:
        for holder, name, original, _ in reversed(undo):
            setattr(holder, name, original)
        if registered:
            del SWAPS[len(SWAPS) - len(undo):]


# -- running the checks -----------------------------------------------------------------------

@contextmanager
def _time_limit(seconds: int):
    if not hasattr(signal, "SIGALRM") or sys.modules["threading"].current_thread().name != "MainThread":
        yield
        return

    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s (an endless loop?)")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_checks(exercise, path: Path) -> list[tuple[str, str | None]]:
    """(property, None if it holds else why not) for each of the exercise's checks,
    with the student's file at `path` in place of the engine's function."""
    doc = [(c.__doc__ or c.__name__).strip().splitlines()[0] for c in exercise.CHECKS]
    try:
        if not targets(exercise):
            arg = exercise.answer(path.read_text())
            context = nullcontext()
        else:
            arg = None
            context = swapped_in(exercise, load_student_functions(exercise, path))
    except Exception as e:
        return [(d, f"your file did not load: {_short(e, path)}") for d in doc]
    results = []
    with context, _one_torch_thread():
        for check, words in zip(exercise.CHECKS, doc):
            try:
                with _time_limit(CHECK_TIMEOUT_S):
                    check(arg) if not targets(exercise) else check()
                results.append((words, None))
            except NotImplementedError:
                results.append((words, "not written yet (the stub still raises NotImplementedError)"))
            except AssertionError as e:
                results.append((words, str(e) or "an assertion failed"))
            except Exception as e:
                if _from_stub(e):        # the engine wrapped it (say, as a ValueError of the loader)
                    results.append((words, "not written yet (the stub still raises NotImplementedError)"))
                else:
                    results.append((words, f"it raised {_short(e, path)}"))
    return results


def _from_stub(e: BaseException) -> bool:
    """Whether an exception was caused by a NotImplementedError (its __cause__ or
    __context__ chain), as the engine's own error for a stub it called."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, NotImplementedError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def _one_torch_thread():
    """The checks run the tiny model: one torch thread. A second one only waits for a
    core when the machine is busy, and a tiny model's ops are too small to share;
    tests/course/test_chapters.py does the same."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _short(e: BaseException, path: Path) -> str:
    """`Type: message`, plus the line of the student's file it came from, if any."""
    where = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
    at = f" (at {path.name} line {where[-1].lineno}: {where[-1].line})" if where else ""
    return f"{type(e).__name__}: {e}{at}"


# -- the command line ---------------------------------------------------------------------------

def exercise_file(exercise, folder: Path) -> Path:
    slug = exercise.__name__.rsplit(".", 1)[-1]
    return folder / (f"{slug}.txt" if not targets(exercise) else f"{slug}.py")


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module doc). Returns the exit status: 0, or 1 when a check
    fails or the command cannot run."""
    ap = argparse.ArgumentParser(prog="python -m nanopaged.exercise", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["list", "start", "check", "hint", "reset"])
    ap.add_argument("number", nargs="?", type=int)
    ap.add_argument("--dir", default=DEFAULT_DIR, help=f"where your exercise files are (default ./{DEFAULT_DIR})")
    args = ap.parse_args(argv)
    quiet, level = logging.getLogger("nanopaged"), logging.getLogger("nanopaged").level
    quiet.setLevel(logging.WARNING)              # the checks' engines start quietly
    try:
        return _command(args)
    finally:
        quiet.setLevel(level)                    # main() called in a process that goes on: as it was


def _command(args: argparse.Namespace) -> int:
    exercises = all_exercises()
    folder = Path(args.dir)
    if args.command == "list":
        width = max(len(ex.TITLE) for ex in exercises.values())
        for n, ex in exercises.items():
            print(f"{n:3}  {state(exercise_file(ex, folder)):<11}  {ex.TITLE:<{width}}  {chapter_path(ex)}")
        return 0
    if args.number is None:
        print(f"`{args.command}` needs an exercise number (0 to {max(exercises)}): "
              f"python -m nanopaged.exercise {args.command} N; `list` shows them", file=sys.stderr)
        return 1
    if args.number not in exercises:
        print(f"exercise number must be one of {', '.join(map(str, exercises))}, got {args.number}",
              file=sys.stderr)
        return 1
    ex = exercises[args.number]
    path = exercise_file(ex, folder)
    if args.command == "hint":
        print(textwrap.dedent(ex.HINT).strip())
        return 0
    if args.command in ("start", "reset"):
        if path.exists() and args.command == "start":
            print(f"{path} exists already: edit it, or `{command('reset', ex, folder)}` for a fresh stub")
            return 0
        folder.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.read_text() != stub_source(ex, folder):     # an untouched stub: no .bak
            path.rename(path.with_suffix(path.suffix + ".bak"))
            print(f"your version is kept in {path.with_suffix(path.suffix + '.bak')}")
        path.write_text(stub_source(ex, folder))
        print(f"wrote {path}: {ex.TITLE}. Read {chapter_path(ex)}, fill it in, then "
              f"`{command('check', ex, folder)}`")
        return 0
    if not path.exists():
        print(f"{path} does not exist: run `{command('start', ex, folder)}` first",
              file=sys.stderr)
        return 1
    results = run_checks(ex, path)
    for words, why in results:
        print(f"{'PASS' if why is None else 'FAIL'}  {words}")
        if why is not None:
            print(textwrap.indent(why, "      "))
    passed = sum(why is None for _, why in results)
    record_check(path, passed == len(results))
    print(f"{passed} of {len(results)} checks pass" + (": done!" if passed == len(results) else ""))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
