"""Extensions: every feature after the base engine, joined to it at named hooks.

The base engine (block pool and manager, scheduler, runner view, input batch, model
runner, sampler, models, engine core, LLM) runs alone. A later feature is a subclass of
a base part that overrides some of its hooks, in a file of its own, e.g.

    class AsyncScheduler(Scheduler):        # core/async_scheduler.py
        def _after_schedule(self, step, samples, out): ...

The engine builds each part once, from the config, as the base class with the enabled
extensions' subclasses in front of it (Python's method order, each override calling
super()), so two features that override the same hook compose. vLLM picks its scheduler
class from the config the same way (`SchedulerConfig.scheduler_cls`; the async one is
`vllm/v1/core/sched/async_scheduler.py`).

Per-request features (beam search, structured outputs) are on whenever their module
imports; without it, a request that asks for one is refused by name.
"""
from __future__ import annotations

import importlib
from typing import Callable

# extension name -> does this config turn it on? (per-request features: always)
# (pipeline parallelism is built on async scheduling, its classes subclass those: with
# pp > 1 the plain async entries are off, whatever config.async_scheduling says)
ENABLED: dict[str, Callable] = {
    "pipeline_parallel": lambda config: config.pipeline_parallel_size > 1,
    "async_scheduling": lambda config: config.async_scheduling and config.pipeline_parallel_size == 1,
    "speculative_decoding": lambda config: config.speculative_config is not None,
    "beam_search": lambda config: True,
    "structured_outputs": lambda config: True,
    "activation_quantization": lambda config: config.activation_quantization == "int8",   # needs "gguf"
    "quantization": lambda config: config.quantization == "gguf",
    "int8_quantization": lambda config: config.quantization == "int8",
    # decode steps replayed without the Python (last: nearest the base's _forward)
    "cpu_graphs": lambda config: (not config.enforce_eager and config.world_size == 1
                                  and config.attention_backend != "torch"),
}
PER_REQUEST = {"beam_search", "structured_outputs"}

# part -> extension name -> "module:Class", the subclass of that part's base class
SCHEDULER: dict[str, str] = {
    "pipeline_parallel": "nanopaged.core.pipeline_scheduler:PipelineScheduler",
    "async_scheduling": "nanopaged.core.async_scheduler:AsyncScheduler",
    "speculative_decoding": "nanopaged.core.spec_decode:SpecDecodeScheduler",
    "beam_search": "nanopaged.core.beam_search:BeamSearchScheduler",
    "structured_outputs": "nanopaged.core.structured_output_scheduler:StructuredOutputScheduler",
}
MODEL_RUNNER: dict[str, str] = {
    "pipeline_parallel": "nanopaged.worker.pipeline_model_runner:PipelineModelRunner",
    "async_scheduling": "nanopaged.worker.async_model_runner:AsyncModelRunner",
    "speculative_decoding": "nanopaged.worker.spec_decode.spec_model_runner:SpecDecodeModelRunner",
    "structured_outputs": "nanopaged.worker.structured_output_runner:StructuredOutputModelRunner",
    "cpu_graphs": "nanopaged.worker.cpu_graph:CPUGraphModelRunner",
}
ENGINE_CORE: dict[str, str] = {
    "pipeline_parallel": "nanopaged.engine.pipeline_engine_core:PipelineEngineCore",
    "async_scheduling": "nanopaged.engine.async_engine_core:AsyncEngineCore",
    "speculative_decoding": "nanopaged.engine.spec_decode_core:SpecDecodeEngineCore",
    "structured_outputs": "nanopaged.engine.structured_output_core:StructuredOutputEngineCore",
}
# the model class of a family (model/registry.py): a stage holds only its layers
MODEL: dict[str, str] = {
    "pipeline_parallel": "nanopaged.model.pipeline_stage:PipelineStageModel",
    "activation_quantization": "nanopaged.layers.quantization.gguf_a8:Int8ActivationsModel",  # on gguf's
    "quantization": "nanopaged.model.gguf_loader:GGUFQuantizedModel",     # weights read packed
    "int8_quantization": "nanopaged.layers.quantization.int8:Int8QuantizedModel",   # quantized at load
}
PARTS = {"scheduler": SCHEDULER, "model_runner": MODEL_RUNNER, "engine_core": ENGINE_CORE, "model": MODEL}

# every module of each later feature, the classes above and what they use: the base
# engine imports none of them (tests/engine/test_base_engine.py blocks them all)
MODULES: dict[str, list[str]] = {
    "pipeline_parallel": ["nanopaged.core.pipeline_scheduler", "nanopaged.engine.pipeline_engine_core",
                          "nanopaged.worker.pipeline_model_runner", "nanopaged.model.pipeline_stage"],
    "async_scheduling": ["nanopaged.core.async_scheduler", "nanopaged.engine.async_engine_core",
                         "nanopaged.worker.async_model_runner"],
    "speculative_decoding": ["nanopaged.core.spec_decode", "nanopaged.engine.spec_decode_core",
                             "nanopaged.worker.spec_decode"],
    "beam_search": ["nanopaged.core.beam_search"],
    "structured_outputs": ["nanopaged.core.structured_output", "nanopaged.core.structured_output_scheduler",
                           "nanopaged.engine.structured_output_core", "nanopaged.worker.structured_output_runner"],
    "dashboard": ["nanopaged.engine.dashboard", "nanopaged.dashboard_messages"],
    "activation_quantization": ["nanopaged.layers.quantization.gguf_a8"],
    "quantization": ["nanopaged.model.gguf_loader", "nanopaged.layers.quantization"],
    "int8_quantization": ["nanopaged.layers.quantization.int8"],
    "cpu_graphs": ["nanopaged.worker.cpu_graph"],
    "worker_processes": ["nanopaged.worker.multiproc_executor", "nanopaged.worker.multinode",
                         "nanopaged.worker.headless", "nanopaged.worker.stage_progress"],
}


def _import(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def extension_classes(part: str, config) -> list[type]:
    """The enabled extensions' subclasses of `part`, in ENABLED's order.

    Raises:
        ImportError: an extension the config turns on (not a per-request one) is missing.
    """
    classes = []
    for name, path in PARTS[part].items():
        if not ENABLED[name](config):
            continue
        try:
            classes.append(_import(path))
        except ImportError:
            if name not in PER_REQUEST:
                raise
    return sorted(classes, key=lambda c: list(ENABLED).index(_name_of(part, c)))


def _name_of(part: str, cls: type) -> str:
    return next(n for n, p in PARTS[part].items() if p == f"{cls.__module__}:{cls.__qualname__}")


def build_class(base: type, part: str, config) -> type:
    """`base` with the enabled extensions of `part` in front: the class the engine builds."""
    classes = extension_classes(part, config)
    if not classes:
        return base
    return type(base.__name__, (*classes, base), {"__doc__": base.__doc__})


def available(name: str) -> bool:
    """Does every module of extension `name` import? (A per-request feature's check.)"""
    try:
        for paths in PARTS.values():
            if name in paths:
                _import(paths[name])
    except ImportError:
        return False
    return True
