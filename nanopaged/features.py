"""Features: which classes serve each part of the engine, decided once from the config.

The base engine (core/, worker/, engine/, model/, layers/) runs alone. Every later
feature is one package beside it (spec_decode/, pipeline/, ...) whose classes subclass
a base part and override its hooks. This table is the one place that names them: per
feature, when a config turns it on, and its subclass of each part it joins.

`Composition.of(config)` reads the table once. The engine builds each part as the base
class with the enabled features' subclasses in front of it (Python's method order, each
override calling super(), so two features that override one hook compose), names the
built class for what it holds, and logs the whole composition at start, e.g. by default:

    scheduler: BeamSearchStructuredOutputScheduler = Scheduler <- StructuredOutputScheduler <- BeamSearchScheduler

`LLM(...).engine.composition` is the same object, and `LLM(...).engine.describe()` returns
those lines. A name in this table is data, not an import:
the base is handed a qualified name and resolves it (`resolve`) without naming any
feature, as vLLM's `SchedulerConfig.get_scheduler_cls` resolves `scheduler_cls`.

Beam search and structured outputs are per request: the engine is built before any
request arrives, so they are composed in whenever their packages import (vLLM, too,
serves both without a flag), and a request that asks for one when its package is missing
is refused by name. CPU graphs are on by default for a single rank, as CUDA graphs are in
vLLM (`enforce_eager=True` turns them off); a replay gives the eager step's bits, so
without their package the engine runs eager. These three are `optional`: composed when
their packages import. Any other feature a config turns on must import.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from .config import EngineConfig

PARTS = ("processor", "output_processor", "engine_core", "scheduler", "executor", "worker", "model_runner", "model")
# a built class's name: the features' class names less this suffix, then the base's name
_SUFFIX = {"processor": "Processor", "output_processor": "OutputProcessor", "engine_core": "EngineCore",
           "scheduler": "Scheduler", "executor": "Executor", "worker": "Worker", "model_runner": "ModelRunner", "model": "Model"}


@dataclass(frozen=True)
class Feature:
    """One later feature.

    name: what the log and errors call it; package: its folder below nanopaged/;
    on: does this config turn it on; parts: part -> "module:Class" inside the package,
    the subclass of that part's base class (for "executor", the class that replaces the
    base's: an executor is chosen, not stacked); optional: composed only when its
    package imports (the engine serves the same without it); model_folder: "module:function" that finds
    the model's local folder when this feature reads the weights in a format of its own
    (function(model) -> Path), else None; resolve_config: "module:function" that
    finishes a resolved config for this feature (function(config, model_path,
    model_config) -> config, e.g. a draft model's folder), else None.
    """
    name: str
    package: str
    on: Callable[[EngineConfig], bool]
    parts: dict[str, str]
    optional: bool = False
    model_folder: str | None = None
    resolve_config: str | None = None


# In method order: the first is outermost. Pipeline parallelism is built on async
# scheduling (its classes subclass those), so with pp > 1 the plain async row is off.
FEATURES: list[Feature] = [
    Feature("pipeline parallelism", "pipeline", lambda c: c.parallel_config.pipeline_parallel_size > 1,
            {"scheduler": "scheduler:PipelineScheduler", "engine_core": "engine_core:PipelineEngineCore",
             "model_runner": "model_runner:PipelineModelRunner", "model": "stage_model:PipelineStageModel"}),
    Feature("async scheduling", "async_sched",
            lambda c: c.scheduler_config.async_scheduling and c.parallel_config.pipeline_parallel_size == 1,
            {"scheduler": "scheduler:AsyncScheduler", "engine_core": "engine_core:AsyncEngineCore",
             "model_runner": "model_runner:AsyncModelRunner"}),
    Feature("speculative decoding", "spec_decode", lambda c: c.speculative_config is not None,
            {"scheduler": "scheduler:SpecDecodeScheduler", "engine_core": "engine_core:SpecDecodeEngineCore",
             "worker": "worker:SpecDecodeWorker", "model_runner": "model_runner:SpecDecodeModelRunner"},
            resolve_config="config:resolve_draft"),
    Feature("beam search", "beam_search", lambda c: True,
            {"processor": "processor:BeamSearchProcessor",
             "output_processor": "output_processor:BeamSearchOutputProcessor",
             "scheduler": "scheduler:BeamSearchScheduler"},
            optional=True),
    Feature("structured outputs", "structured_output", lambda c: True,
            {"processor": "processor:StructuredOutputProcessor",
             "scheduler": "scheduler:StructuredOutputScheduler",
             "engine_core": "engine_core:StructuredOutputEngineCore",
             "model_runner": "model_runner:StructuredOutputModelRunner"}, optional=True),
    # int8 activations run on GGUF's packed weights: its class goes in front of GGUF's
    Feature("int8 activations", "quantization", lambda c: c.quant_config.activation_quantization == "int8",
            {"model": "gguf_a8:Int8ActivationsModel"}),
    Feature("GGUF weights", "quantization", lambda c: c.quant_config.quantization == "gguf",
            {"model": "gguf_loader:GGUFQuantizedModel"}, model_folder="gguf_loader:resolve_gguf_model"),
    Feature("int8 weights", "quantization", lambda c: c.quant_config.quantization == "int8",
            {"model": "int8:Int8QuantizedModel"}),
    # adapters add to whatever the base projections are (float, GGUF or int8 weights)
    Feature("LoRA adapters", "lora", lambda c: c.lora_config is not None,
            {"processor": "processor:LoRAProcessor", "scheduler": "scheduler:LoRAScheduler",
             "worker": "worker:LoRAWorker", "model_runner": "model_runner:LoRAModelRunner",
             "model": "model:LoRAModel"}),
    # decode steps replayed without the Python: last, nearest the base's forward
    Feature("CPU graphs", "cpu_graph",
            lambda c: not c.enforce_eager and c.parallel_config.world_size == 1 and c.attention_backend != "torch",
            {"model_runner": "model_runner:CPUGraphModelRunner"}, optional=True),
    Feature("worker processes", "multiproc", lambda c: c.parallel_config.executor_backend == "mp",
            {"executor": "executor:MultiprocExecutor"}),
]


def resolve(qualname: str) -> type:
    """The class a "nanopaged.package.module:Class" name names (ImportError if it cannot
    be imported)."""
    module, _, name = qualname.partition(":")
    return getattr(importlib.import_module(module), name)


def qualname(feature: Feature, part: str) -> str:
    return f"{__package__}.{feature.package}.{feature.parts[part]}"


def available(feature: Feature) -> bool:
    """Does every class of `feature` import? (An optional feature is composed only then.)"""
    try:
        for part in feature.parts:
            resolve(qualname(feature, part))
    except ImportError:
        return False
    return True


def model_folder(config: EngineConfig) -> Callable | None:
    """The function that finds the model's folder for this config's weight format (a
    feature's model_folder), or None when model_loader.resolve_model does."""
    for feature in FEATURES:
        if feature.on(config) and feature.model_folder is not None:
            return resolve(f"{__package__}.{feature.package}.{feature.model_folder}")
    return None


def resolve_features(config: EngineConfig, model_path, model_config) -> EngineConfig:
    """config finished by each enabled feature's resolve_config, in FEATURES' order."""
    for feature in FEATURES:
        if feature.on(config) and feature.resolve_config is not None:
            config = resolve(f"{__package__}.{feature.package}.{feature.resolve_config}")(
                config, model_path, model_config)
    return config


def importable(config: EngineConfig) -> bool:
    """Does every feature this config turns on import? (The default model runs from its
    GGUF file when the GGUF feature is there, else from its float folder: arg_utils.py.)"""
    return all(available(f) for f in FEATURES if f.on(config))


@dataclass(frozen=True)
class Composition:
    """The features a config turns on, and for each part the qualified names of their
    classes, outermost first. Build it with `Composition.of(config)`.

    features: the names of the features on, in FEATURES' order (an optional feature
    whose package does not import is left out, and `missing` names it).
    """
    features: tuple[str, ...] = ()
    parts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    missing: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: EngineConfig) -> "Composition":
        """Raises:
            ImportError: a feature the config turns on (not an optional one) cannot be
                imported.
        """
        names, parts, missing = [], {part: [] for part in PARTS}, []
        for feature in FEATURES:
            if not feature.on(config):
                continue
            if feature.optional and not available(feature):
                missing.append(feature.name)
                continue
            names.append(feature.name)
            for part in feature.parts:
                parts[part].append(qualname(feature, part))
        return cls(tuple(names), {p: tuple(q) for p, q in parts.items()}, tuple(missing))

    def build(self, base: type, part: str) -> type:
        """`base` with this composition's classes for `part` in front, named for what it
        holds (e.g. BeamSearchStructuredOutputScheduler); `base` itself when no feature
        joins it, and a feature's class itself when it is the only one (it already says
        what it holds). For "executor", the feature's class replaces `base`."""
        classes = [resolve(q) for q in self.parts.get(part, ())]
        if not classes:
            return base
        if part == "executor" or (len(classes) == 1 and issubclass(classes[0], base)):
            return classes[0]
        name = "".join(c.__name__.removesuffix(_SUFFIX[part]) for c in classes) + base.__name__
        built = type(name, (*classes, base), {"__module__": __name__})
        built.__doc__ = f"Built by features.py for this config: {chain(built, base)}.\n\n{base.__doc__ or ''}"
        return built

    def describe(self, bases: dict[str, type]) -> list[str]:
        """One line per part: the class that serves it, and the chain it is built of,
        read from its method order, the base first and each class after it overriding
        the one before: "scheduler: BeamSearchStructuredOutputScheduler = Scheduler <-
        StructuredOutputScheduler <- BeamSearchScheduler"."""
        lines = []
        for part, base in bases.items():
            built = self.build(base, part)
            if built is base or part == "executor":
                lines.append(f"{part}: {built.__name__}")
            else:
                lines.append(f"{part}: {built.__name__} = {chain(built, base)}")
        return lines


def chain(built: type, base: type) -> str:
    """The chain "Base <- Feature1 <- Feature2": the classes of `built`'s method order
    that are not the base's own (a feature that subclasses another brings it along), base
    first, each overriding the one before."""
    own = [c for c in built.__mro__ if c not in base.__mro__ and c.__module__ != __name__]
    return " <- ".join(c.__name__ for c in [base, *reversed(own)])
