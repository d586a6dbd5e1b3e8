"""LLMEngine: the synchronous engine, a thin loop over vLLM v1's three parts.

    Processor         request in: check, tokenize          -> EngineCoreRequest
    EngineCore        schedule, forward, sample, append     -> EngineCoreOutputs
    OutputProcessor   detokenize, stop strings, logprobs    -> RequestOutput

`step()` is one turn of that loop:

    core_outputs = self.core_client.get_output()                 # one core step: tokens out
    processed = self.output_processor.process_outputs(core_outputs)   # text out
    self.core_client.stop_sequences(processed.seqs_to_stop)      # a stop string matched

The core sits behind an EngineCoreClient (engine_core_client.py): here the in-process
one, which calls EngineCore.step(); AsyncLLM's runs the core in a process of its own.

Requests come in with `add_request`, which checks them completely before the core does
any work for them (a bad request raises and leaves no trace), and leave when they finish
or are aborted, at which point all their blocks go back to the pool. Observers added
with `add_observer` hear what each step does, as events (events.py).
vLLM: `vllm/v1/engine/llm_engine.py`.
"""
from __future__ import annotations

import logging
from typing import Iterable

from ..config import EngineConfig
from ..events import Observer, Observers
from ..features import Composition
from ..outputs import RequestOutput
from .arg_utils import create_engine_config
from .engine_core import EngineCore
from .engine_core_client import InprocClient
from .output_processor import OutputProcessor
from .processor import Processor

logger = logging.getLogger(__name__)

# the front end's parts (the core's are EngineCore.part_bases)
FRONT_END = {"processor": Processor, "output_processor": OutputProcessor}


class LLMEngine:
    """The engine: add requests, call step() until none are left.

    Args:
        config: an EngineConfig (LLM builds one from its keyword arguments); the engine
            keeps its resolved copy as `config` (arg_utils.create_engine_config).

    Attributes:
        processor, engine_core, output_processor: the three parts.
        tokenizer: the model's transformers tokenizer.
        scheduler, block_manager, model_runner: the core's, for tests and the tracer.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config, self.model_path, self.model_config = create_engine_config(config)   # resolved once
        self.composition = Composition.of(self.config)     # which classes serve each part: decided once
        self.processor = self.composition.build(Processor, "processor").from_config(
            self.config, self.model_path, self.model_config)
        for line in self.composition.describe(FRONT_END):
            logger.info("%s", line)
        self.tokenizer, self.eos_token_ids = self.processor.tokenizer, self.processor.eos_token_ids
        self.observers = Observers()
        core_cls = self.composition.build(EngineCore, "engine_core")
        self.engine_core = core_cls(self.config, self.model_path, self.model_config, self.observers,
                                    self.composition)
        self.core_client = InprocClient(self.engine_core)     # AsyncLLM's runs it in a process
        self.output_processor = self.composition.build(OutputProcessor, "output_processor")(self.tokenizer)

    def describe(self) -> list[str]:
        """Which classes serve each part, one line each, the base first (what the start
        log says): e.g. "scheduler: Scheduler <- StructuredOutputScheduler <- BeamSearchScheduler"."""
        return self.composition.describe(FRONT_END) + self.engine_core.describe()

    # the core's parts, for tests, the tracer and the bench
    scheduler = property(lambda self: self.engine_core.scheduler)
    block_manager = property(lambda self: self.engine_core.block_manager)
    model_runner = property(lambda self: self.engine_core.model_runner)
    attn_backend = property(lambda self: self.engine_core.attn_backend)
    weights = property(lambda self: self.engine_core.weights)        # WeightsInfo
    requests = property(lambda self: self.engine_core.scheduler.requests,
                        doc="request_id -> SequenceGroup of every unfinished request")
    num_steps = property(lambda self: self.engine_core.num_steps)
    num_generated_tokens = property(lambda self: self.engine_core.scheduler.num_generated_tokens)

    def add_request(self, request_id: str, prompt, sampling_params=None, lora_request=None) -> None:
        """Queue a request. All checks happen here, before any work is done for it.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized with the model's tokenizer), a list of token ids, or a
                chat as a list of {"role", "content"} dicts (the chat template applies).
            sampling_params: a SamplingParams (default SamplingParams()), or a
                BeamSearchParams for a beam-search request.
            lora_request: the LoRA adapter it runs with (a LoRARequest; needs
                enable_lora=True), or None for the base model.

        Raises:
            ValueError: duplicate request_id; empty prompt; a token id outside the
                vocabulary; a prompt of max_model_len tokens or more (no room for an
                output token); a prompt needing more KV blocks than the whole pool; a
                SamplingParams the model cannot honour; a lora_request that cannot be
                served (no enable_lora, or a bad adapter folder: named with the field).
                The engine is unchanged and keeps serving.
            TypeError: prompt or sampling_params of the wrong type.
        """
        request, prompt_text = self.processor.process_inputs(request_id, prompt, sampling_params,
                                                             lora_request=lora_request)
        self.core_client.add_request(request)
        self.output_processor.add_request(request, prompt_text, request.sampling_params.n)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop request(s) wherever they are and free their blocks. Unknown ids are ignored.
        An aborted request gets no final RequestOutput (as vLLM's offline engine)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.core_client.abort_requests(ids)
        self.output_processor.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward step. Returns the RequestOutputs of the requests
        that made progress in it, as their SamplingParams.output_kind asks."""
        processed = self.output_processor.process_outputs(self.core_client.get_output())
        if processed.seqs_to_stop:
            self.core_client.stop_sequences(processed.seqs_to_stop)
        return processed.request_outputs

    def add_observer(self, observer: Observer) -> None:
        """Call observer(event) for every event from now on (events.py lists them). Events
        are published synchronously, in the order things happen, from inside add_request,
        step and abort_request; an observer must not change the engine.
        Raises TypeError if observer is not callable."""
        if not callable(observer):
            raise TypeError(f"observer must be callable (it is called with each event), got {observer!r}")
        self.observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        """Stop calling observer. Raises ValueError if it was not added."""
        self.observers.remove(observer)

    def shutdown(self) -> None:
        """Stop the core's workers (tensor-parallel processes, if any). Idempotent; the
        engine cannot step afterwards. Also happens on garbage collection and exit."""
        self.core_client.shutdown()

    def get_stats(self) -> dict[str, int]:
        """Counters for monitoring and tests: pool occupancy, queue sizes, work done."""
        return self.engine_core.get_stats()
