"""EngineCore: the engine's inner loop, tokens in and tokens out.

It owns the scheduler (with the block manager) and the executor (the workers and their
model runners), and no tokenizer. One `step()` is one forward over one batch (the
PagedAttention paper §4.5; vLLM v1's `EngineCore.step`):

    scheduler_output = self.scheduler.schedule()                    # who runs, which blocks
    runner_output = self.executor.execute_model(scheduler_output)   # copy, forward, sample
    return self.scheduler.update_from_output(scheduler_output, runner_output)   # append, stop, free

Everything in and out is a message of messages.py, so the core can run in a process of
its own behind a client (engine_core_client.py). Later features subclass it
(features.py): async scheduling (async_sched/engine_core.py), structured outputs' second
sampling call. vLLM: `vllm/v1/engine/core.py`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..events import Observers
from ..features import Composition
from ..messages import EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput, SchedulerOutput, WeightsInfo
from ..model.config import ModelConfig
from ..model.registry import get_model_class
from ..worker.executor import Executor
from ..layers.backends import get_ops
from ..worker.model_runner import ModelRunner
from ..worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + block manager + model runner. Build it with
    Composition.of(config).build(EngineCore, "engine_core") for the config's features.

    Args:
        config: a resolved EngineConfig (arg_utils.create_engine_config: the model
            checked to split over tensor_parallel_size, every None filled in).
        model_path: the local Hugging Face folder of the model.
        model_config: its ModelConfig.
        observers: where the scheduler and block manager publish events (events.py).
        composition: which classes serve each part (features.py); default
            Composition.of(config). Logged once, here.

    `weights` (a WeightsInfo): the bytes the workers' weights hold, by format, asked of
    every rank once at start.
    """

    def __init__(self, config: EngineConfig, model_path, model_config: ModelConfig,
                 observers: Observers | None = None, composition: Composition | None = None) -> None:
        self.config, self.model_config = config, model_config
        self.composition = Composition.of(config) if composition is None else composition
        for line in self.composition.describe(self.part_bases(model_config)):
            logger.info("%s", line)
        if self.composition.missing:
            logger.info("not composed, their packages do not import: %s", ", ".join(self.composition.missing))
        self.attn_backend = get_ops(config.attention_backend, config.torch_device)
        # the workers load their weights first; only then is the KV pool sized
        self.executor = Executor.create(config, model_path, model_config, self.attn_backend, self.composition)
        try:
            num_gpu_blocks, num_cpu_blocks = self._initialize_kv_caches()
            # what the ranks' weights hold resident, by format (the tracer and dashboard show it)
            self.weights: WeightsInfo = WeightsInfo.combine(self.executor.collective_rpc("describe_weights"))
        except BaseException:
            self.executor.shutdown()
            raise
        self.observers = Observers() if observers is None else observers
        self.block_manager = BlockManager(num_gpu_blocks, config.cache_config.block_size, config.cache_config.enable_prefix_caching,
                                          num_cpu_blocks, self.observers)
        costs = self.executor.measure_preemption_costs() if config.scheduler_config.preemption_mode == "auto" else None
        self.scheduler = self.composition.build(Scheduler, "scheduler")(config, self.block_manager, costs=costs)
        self.num_steps = 0
        self.start_time = time.monotonic()        # when the core started: an observer's time origin

    def part_bases(self, model_config: ModelConfig) -> dict[str, type]:
        """Each part's base class (the model's: its family's), for describe(). (The
        processor and the output processor are the front end's: LLMEngine.describe adds
        their lines.)"""
        return {"engine_core": EngineCore, "scheduler": Scheduler,
                "executor": Executor.base_class(self.config), "worker": Worker, "model_runner": ModelRunner,
                "model": get_model_class(model_config.architecture)}

    def describe(self) -> list[str]:
        """Which classes serve each of the core's parts, one line each, the base first."""
        return self.composition.describe(self.part_bases(self.model_config))

    @property
    def model_runner(self) -> ModelRunner:
        """The ModelRunner, when it lives in this process (tensor_parallel_size 1 or
        torchrun). Raises AttributeError when the runners are in worker processes."""
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise AttributeError("the model runners live in the worker processes "
                                 f"(tensor_parallel_size={self.config.parallel_config.tensor_parallel_size}, 'mp')")
        return worker.model_runner

    def shutdown(self) -> None:
        """Stop the executor's workers (idempotent); the core cannot step afterwards."""
        self.executor.shutdown()

    def _initialize_kv_caches(self) -> tuple[int, int]:
        """Size the KV pools and have every worker allocate them; returns
        (num_gpu_blocks, num_cpu_blocks) per rank (vLLM v1's
        EngineCore._initialize_kv_caches). The workers have their weights loaded by now,
        so the memory they report is what is really left: config.cache_config.num_gpu_blocks when
        set, else the smallest number of blocks any rank's memory holds (a rank's block
        holds its own KV heads only: Worker.kv_cache_bytes_per_block). The swap pool:
        config.cache_config.num_cpu_blocks, else swap_space GiB of blocks.

        Raises:
            ValueError: a rank's memory holds not even one block.
        """
        c = self.config.cache_config
        per_block = self.executor.collective_rpc("kv_cache_bytes_per_block")     # per rank
        num_gpu_blocks = c.num_gpu_blocks
        if num_gpu_blocks is None:
            available = self.executor.determine_available_memory()
            num_gpu_blocks = min(budget // size for budget, size in zip(available, per_block))
            if num_gpu_blocks < 1:
                raise ValueError(f"the memory for the KV cache ({min(available)} bytes: kv_cache_memory_bytes, "
                                 f"or what the weights left) is smaller than one KV block ({max(per_block)} bytes)")
        num_cpu_blocks = (c.num_cpu_blocks if c.num_cpu_blocks is not None
                          else min(int(c.swap_space * (1 << 30)) // size for size in per_block))
        self.executor.initialize_kv_cache(num_gpu_blocks, num_cpu_blocks)
        kernel = {"torch": "the PyTorch reference", "cpu": "the C++ CPU kernel", "cuda": "the CUDA kernel"}
        size = num_gpu_blocks * per_block[0]
        unit = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if size >= s or u == "KiB")
        logger.info("KV cache: %d blocks of %d tokens (%.1f %s%s), swap pool %d blocks; dtype %s, attention: %s",
                    num_gpu_blocks, c.block_size, size / unit[1], unit[0], " per rank" if len(per_block) > 1 else "",
                    num_cpu_blocks, self.config.dtype, kernel.get(self.attn_backend.name, self.attn_backend.name))
        return num_gpu_blocks, num_cpu_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (request_id in use, or a prompt that needs
        more KV blocks than the whole pool); the core is then unchanged."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        """Stop requests wherever they are and free their blocks. Unknown ids are ignored."""
        self.scheduler.abort_requests(list(request_ids))

    def stop_sequences(self, seqs: list[tuple[str, int]]) -> None:
        """Finish (request_id, index) sequences whose stop string matched."""
        self.scheduler.stop_sequences(seqs)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, take in its output. An exception in the forward
        propagates from here, and the engine stays usable."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        if runner_output is None:            # its rows sample in a second call
            runner_output = self._deferred_sampling(scheduler_output)()
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _deferred_sampling(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput] | None:
        """Hook: the call that samples a step whose forward stopped before sampling (its
        rows wait for something made after the schedule: structured outputs' masks), or
        None when the forward samples itself."""
        return None

    def get_stats(self) -> dict[str, int | float]:
        """Counters for monitoring and tests: pool occupancy, queue sizes, work done."""
        bm, s = self.block_manager, self.scheduler
        return {
            "num_total_gpu_blocks": bm.num_gpu_blocks,
            "num_free_gpu_blocks": bm.get_num_free_gpu_blocks(),
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_preemptions": s.num_preemptions,
            "num_preemptions_swap": s.num_preemptions_swap,
            "num_preemptions_recompute": s.num_preemptions_recompute,
            "num_total_cpu_blocks": bm.num_cpu_blocks,
            "num_free_cpu_blocks": bm.get_num_free_cpu_blocks(),
            "num_swapped": len(s.swapped),
            "num_steps": self.num_steps,
            "num_generated_tokens": s.num_generated_tokens,
            "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_copy_on_write": bm.num_copy_on_write,
        }
