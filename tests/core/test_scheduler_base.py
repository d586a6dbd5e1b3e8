"""The base scheduler stands alone: core/scheduler.py names none of the later features,
which join it as subclasses at its hooks, composed from the config (features.py); the
engine core imports none of them either."""
import ast
import re
from pathlib import Path

import pytest

from nanopaged import features
from nanopaged.config import EngineConfig
from nanopaged.core.scheduler import Scheduler
from nanopaged.engine.engine_core import EngineCore

PACKAGE = Path(__file__).resolve().parents[2] / "nanopaged"
FEATURE_WORDS = re.compile(r"draft|spec|placeholder|grammar|beam|async|in.flight", re.IGNORECASE)


@pytest.mark.parametrize("path", ["core/scheduler.py", "core/runner_view.py", "core/request_queues.py"])
def test_the_base_scheduler_names_no_later_feature(path):
    text = (PACKAGE / path).read_text()
    assert [line for line in text.splitlines() if FEATURE_WORDS.search(line)] == []


def test_the_engine_core_imports_no_feature_module():
    tree = ast.parse((PACKAGE / "engine/engine_core.py").read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    assert [m for m in imported if FEATURE_WORDS.search(m) or "structured" in m] == []


def test_each_feature_is_a_subclass_built_in_front_of_the_base():
    config = EngineConfig(async_scheduling=True, speculative_config={"method": "ngram"})
    for base, part in ((Scheduler, "scheduler"), (EngineCore, "engine_core")):
        cls = features.Composition.of(config).build(base, part)
        joined = [c for c in cls.__mro__[1:] if c is not base and issubclass(c, base)]
        assert cls.__mro__[1] is joined[0]          # the built class adds nothing of its own
        assert [f"{c.__module__}:{c.__qualname__}" for c in joined] == [
            features.qualname(f, part) for f in features.FEATURES if part in f.parts and f.on(config)]
    # pipeline parallelism is built on async scheduling: its classes subclass the async ones
    config = EngineConfig(pipeline_parallel_size=2, async_scheduling=True)
    mro = features.Composition.of(config).build(Scheduler, "scheduler").__mro__
    assert [c.__module__.removeprefix("nanopaged.") for c in mro[1:5]] == [
        "pipeline.scheduler", "async_sched.scheduler", "beam_search.scheduler", "structured_output.scheduler"]


def test_a_composed_class_is_named_for_what_it_holds_and_the_log_says_it():
    config = EngineConfig(async_scheduling=True, enforce_eager=True)
    composition = features.Composition.of(config)
    assert composition.features == ("async scheduling", "beam search", "structured outputs")
    cls = composition.build(Scheduler, "scheduler")
    assert cls.__name__ == "AsyncBeamSearchStructuredOutputScheduler" and cls.__module__ == "nanopaged.features"
    assert cls.__doc__.startswith("Built by features.py for this config: Scheduler <- StructuredOutputScheduler")
    lines = composition.describe({"scheduler": Scheduler, "engine_core": EngineCore})
    assert lines == ["scheduler: AsyncBeamSearchStructuredOutputScheduler = Scheduler <- StructuredOutputScheduler "
                     "<- BeamSearchScheduler <- AsyncScheduler",
                     "engine_core: AsyncStructuredOutputEngineCore = EngineCore <- StructuredOutputEngineCore <- "
                     "AsyncEngineCore"]
    assert features.Composition.of(EngineConfig(enforce_eager=True)).build(EngineCore, "engine_core").__name__ \
        == "StructuredOutputEngineCore"
    # pipeline parallelism's classes subclass async scheduling's: the chain says so
    pp = features.Composition.of(EngineConfig(pipeline_parallel_size=2))
    assert pp.describe({"scheduler": Scheduler}) == [
        "scheduler: PipelineBeamSearchStructuredOutputScheduler = Scheduler <- StructuredOutputScheduler <- "
        "BeamSearchScheduler <- AsyncScheduler <- PipelineScheduler"]


def _hooks(base: type) -> list[str]:
    """The methods of `base` that its source calls hooks: a docstring that starts "Hook",
    or a name in the module docstring's list of hooks (the runner's)."""
    import inspect
    names = [n for n, f in vars(base).items() if callable(f) and (f.__doc__ or "").startswith("Hook")]
    listed = re.search(r"override the hooks\s*\((.*?)\)", inspect.getmodule(base).__doc__ or "", re.S)
    return names + (re.findall(r"`(\w+)`", listed.group(1)) if listed else [])


def _real_body(function) -> bool:
    """More than `pass`, a docstring, or a bare `return super()...` / `return <constant>`."""
    import inspect
    import textwrap
    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    def only_super(e):                  # super().name(...), nothing around it
        return isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and ast.unparse(e.func.value) == "super()"
    trivial = all(isinstance(s, ast.Pass) or (isinstance(s, (ast.Return, ast.Expr)) and (
        s.value is None or isinstance(s.value, ast.Constant) or only_super(s.value))) for s in body)
    return not trivial


def test_every_hook_has_a_feature_that_overrides_it_with_a_real_body():
    """A hook exists only where some feature needs it: for each base part, every hook is
    overridden by a class of the feature table, and is no no-op in every class that
    defines it (a `pass` that switches the base's body off is a real override)."""
    from nanopaged.engine.output_processor import OutputProcessor
    from nanopaged.engine.processor import Processor
    from nanopaged.worker.model_runner import ModelRunner
    from nanopaged.worker.worker import Worker
    classes = [features.resolve(features.qualname(f, part)) for f in features.FEATURES for part in f.parts]
    missing = []
    for base in (Scheduler, EngineCore, ModelRunner, Processor, OutputProcessor, Worker):
        hooks = _hooks(base)
        assert hooks, f"{base.__name__} names no hook"
        for hook in hooks:
            overriders = [c for c in classes if issubclass(c, base) and hook in vars(c)]
            if not overriders or not any(_real_body(vars(c)[hook]) for c in [base, *overriders]):
                missing.append(f"{base.__name__}.{hook}")
    assert missing == []
