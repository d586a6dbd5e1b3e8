"""The base scheduler stands alone (issue 35): core/scheduler.py is short and names none
of the later features, which join it as subclasses at its hooks (extensions.py); the
engine core imports none of them either."""
import ast
import re
from pathlib import Path

import pytest

from nanopaged import extensions
from nanopaged.config import EngineConfig
from nanopaged.core.scheduler import Scheduler
from nanopaged.engine.engine_core import EngineCore

PACKAGE = Path(__file__).resolve().parents[2] / "nanopaged"
FEATURE_WORDS = re.compile(r"draft|spec|placeholder|grammar|beam|async|in.flight", re.IGNORECASE)


@pytest.mark.parametrize("path", ["core/scheduler.py", "core/runner_view.py", "core/request_queues.py"])
def test_the_base_scheduler_names_no_later_feature(path):
    text = (PACKAGE / path).read_text()
    assert [line for line in text.splitlines() if FEATURE_WORDS.search(line)] == []


def test_the_base_scheduler_is_at_most_300_lines():
    assert len((PACKAGE / "core/scheduler.py").read_text().splitlines()) <= 300


def test_the_engine_core_imports_no_feature_module():
    tree = ast.parse((PACKAGE / "engine/engine_core.py").read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    assert [m for m in imported if FEATURE_WORDS.search(m) or "structured" in m] == []


def test_each_feature_is_a_subclass_built_in_front_of_the_base():
    config = EngineConfig(async_scheduling=True, speculative_config={"method": "ngram"})
    for base, part in ((Scheduler, "scheduler"), (EngineCore, "engine_core")):
        cls = extensions.build_class(base, part, config)
        features = [c for c in cls.__mro__[1:] if c is not base and issubclass(c, base)]
        assert [c.__module__ for c in features] == [extensions.PARTS[part][name].partition(":")[0]
                                                    for name, on in extensions.ENABLED.items()
                                                    if name in extensions.PARTS[part] and on(config)]
    # pipeline parallelism is built on async scheduling: its classes subclass the async ones
    config = EngineConfig(pipeline_parallel_size=2, async_scheduling=True)
    mro = extensions.build_class(Scheduler, "scheduler", config).__mro__
    assert [c.__module__.rpartition(".")[2] for c in mro[1:5]] == [
        "pipeline_scheduler", "async_scheduler", "beam_search", "structured_output_scheduler"]
