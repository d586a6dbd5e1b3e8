"""Executors: how the EngineCore reaches its workers (one per rank of the
tensor_parallel_size x pipeline_parallel_size grid).

The EngineCore calls `executor.execute_model(scheduler_output)` once a step and gets one
ModelRunnerOutput back, whatever the number of ranks (vLLM v1's Executor,
`vllm/v1/executor/`); with `non_blocking=True` it gets a Future of it at once, so that
several batches can be in flight (pipeline parallelism; vLLM's `non_blocking`). Creating
one starts its workers with their weights loaded; the EngineCore then asks what memory
is left (`determine_available_memory`) and gives them their KV pools
(`initialize_kv_cache`). Three kinds:

- UniProcExecutor: one Worker in this process (one rank, the default).
- MultiprocExecutor: one process per rank (multiproc/executor.py, a feature of its own).
- ExternalLauncherExecutor: for `torchrun` (vLLM's "external_launcher"): each of the N
  processes torchrun starts runs the whole engine with one Worker, in torchrun's process
  group; every copy schedules the same way, so nothing is sent. Spans machines.
"""
from __future__ import annotations

import atexit
import os
import weakref
from concurrent.futures import Future

import torch

from ..layers.backends import TorchOps
from ..messages import ModelRunnerOutput, PreemptionCosts, SchedulerOutput
from ..features import Composition
from .worker import Worker, init_process_group


class Executor:
    """Runs the model on the workers. Subclasses give collective_rpc."""

    @staticmethod
    def base_class(config) -> type["Executor"]:
        """The base engine's executor for config.parallel_config.executor_backend ("uni" or
        "external_launcher"; "mp", one process per rank, is a feature's: multiproc/)."""
        return ExternalLauncherExecutor if config.parallel_config.executor_backend == "external_launcher" else UniProcExecutor

    @staticmethod
    def create(config, model_path, model_config, ops: TorchOps, composition) -> "Executor":
        """The executor the composition chose (features.py: the base's, or the worker
        processes' MultiprocExecutor), its workers started with their weights loaded and
        no KV pool yet (initialize_kv_cache makes it).
        ops: the kernels the engine chose (layers/backends.get_ops)."""
        kind = composition.build(Executor.base_class(config), "executor")
        return kind(config, model_path, model_config, ops)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call Worker.<method>(*args) on every rank; their results in rank order."""
        raise NotImplementedError

    def determine_available_memory(self) -> list[int]:
        """Per rank, the bytes it can give its KV pool, measured with its weights loaded
        (Worker.determine_available_memory)."""
        return self.collective_rpc("determine_available_memory")

    def initialize_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Give every rank a KV pool of num_gpu_blocks blocks and a swap pool of
        num_cpu_blocks (Worker.initialize_kv_cache); before this, no step can run."""
        self.collective_rpc("initialize_kv_cache", (num_gpu_blocks, num_cpu_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_blocking: bool = False) -> ModelRunnerOutput | None | Future:
        """One step on every rank; rank 0's ModelRunnerOutput, or None when the step has
        structured-output rows: then sample_tokens finishes it. non_blocking: a Future
        of it (here the step has run already; MultiprocExecutor returns at once)."""
        return self._maybe_future(self.collective_rpc, "execute_model", (scheduler_output,), non_blocking)

    def sample_tokens(self, sampling_input, non_blocking: bool = False) -> ModelRunnerOutput | Future:
        """Sample the step execute_model left waiting, with what its rows waited for
        (sampling_input: a feature's message, e.g. structured outputs' GrammarOutput with
        the rows' token masks), on every rank; rank 0's ModelRunnerOutput (non_blocking:
        a Future of it)."""
        return self._maybe_future(self.collective_rpc, "sample_tokens", (sampling_input,), non_blocking)

    @staticmethod
    def _maybe_future(rpc, method: str, args: tuple, non_blocking: bool):
        if not non_blocking:
            return rpc(method, args)[0]
        future = Future()
        try:
            future.set_result(rpc(method, args)[0])
        except Exception as e:           # raised by the Future's result(), as a remote step's would be
            future.set_exception(e)
        return future

    def measure_preemption_costs(self) -> PreemptionCosts:
        """Rank 0's measurement (every rank runs it: the timed forward is collective)."""
        return self.collective_rpc("measure_preemption_costs")[0]

    def get_comm_stats(self) -> list[dict]:
        """Per rank: seconds in collectives and their count (plus, with processes, the
        seconds spent receiving control messages and executing steps)."""
        return self.collective_rpc("get_comm_stats")

    def check_health(self) -> None:
        """Raise EngineDeadError if the workers can no longer step; the engine process
        calls it while idle (vLLM's name). Here: nothing to check."""

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


def combine_stage_costs(costs: list[PreemptionCosts], tensor_parallel_size: int) -> PreemptionCosts:
    """The grid's preemption costs from every rank's (rank order, tp inner): each stage
    recomputes its own layers one after the other (the seconds per token add up) and
    swaps its own blocks at the same time as the others (the slowest stage's seconds
    per block). One stage: its first rank's costs unchanged."""
    stages = costs[::tensor_parallel_size]
    if len(stages) == 1:
        return stages[0]
    return PreemptionCosts(seconds_per_block_swap=max(c.seconds_per_block_swap for c in stages),
                           seconds_per_token_recompute=sum(c.seconds_per_token_recompute for c in stages))


class UniProcExecutor(Executor):
    """One Worker in this process: the whole model, no communication.

    Attributes:
        driver_worker: the Worker (its model_runner is the engine's).
    """

    def __init__(self, config, model_path, model_config, ops: TorchOps,
                 rank: int = 0, world_size: int = 1, process_group=None) -> None:
        self.driver_worker = Composition.of(config).build(Worker, "worker")(config, model_path, model_config, ops=ops, rank=rank, world_size=world_size,
                                    process_group=process_group)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(self.driver_worker, method)(*args)]


def _leave_group() -> None:
    """Destroy torch.distributed's groups, then let gloo's worker threads finish.

    A gloo thread drops its reference to a finished collective (and so to the tensor it
    reduced, a Python object) just after the caller's wait() returned; if the
    interpreter is already finalizing, that thread cannot take the GIL, is ended mid-
    destructor and the process aborts ("terminate called without an active exception",
    seen under load). The pause hands the GIL to those threads before the exit."""
    import time

    import torch.distributed as dist

    dist.destroy_process_group()
    time.sleep(0.2)


class ExternalLauncherExecutor(UniProcExecutor):
    """One Worker per process, the processes started by torchrun (vLLM's
    "external_launcher"): rank and size from torchrun's RANK and WORLD_SIZE.

    Every process runs the whole engine with the same inputs; anything measured (the
    memory left for the KV pool, the preemption costs) is agreed on first, so that all
    copies schedule the same way.

    Raises:
        ValueError: not under torchrun, or WORLD_SIZE != the grid's size (tp x pp).
    """

    def __init__(self, config, model_path, model_config, ops: TorchOps) -> None:
        import torch.distributed as dist

        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("distributed_executor_backend='external_launcher' runs under torchrun "
                             "(RANK and WORLD_SIZE are not set)")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != config.parallel_config.world_size:
            raise ValueError(f"torchrun started WORLD_SIZE={world} processes but "
                             f"tensor_parallel_size={config.parallel_config.tensor_parallel_size}")
        device = config.torch_device
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        owns_group = not dist.is_initialized()
        group = init_process_group(rank, world, "env://", device) if owns_group else dist.group.WORLD
        # Leave the group before the interpreter ends (shutdown, `del llm` or exit): a
        # gloo group still alive at exit can abort the process (SIGABRT) after its work.
        # atexit runs its handlers last registered first, so registering here, after the
        # group exists, leaves it before the handlers torch registered earlier tear down
        # what it uses (a finalizer alone runs from weakref's one atexit hook, which
        # may have been registered before them).
        self._finalizer = weakref.finalize(self, _leave_group) if owns_group else None
        if owns_group:
            atexit.register(self._finalizer)
        self.group, self.device = group, device
        super().__init__(config, model_path, model_config, ops, rank, world, group)

    def determine_available_memory(self) -> list[int]:
        """The least memory any process has left (one all-reduce), so that every copy
        of the engine sizes the same KV pool."""
        import torch.distributed as dist

        # on the rank's device: an NCCL group takes CUDA tensors only
        agreed = torch.tensor(super().determine_available_memory(), dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return [int(agreed[0])]

    def shutdown(self) -> None:
        """Leave torchrun's process group, if this executor joined it (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()

    def measure_preemption_costs(self) -> PreemptionCosts:
        import torch.distributed as dist

        costs = [self.driver_worker.measure_preemption_costs()]
        dist.broadcast_object_list(costs, src=0, group=self.group)      # rank 0's, everywhere
        return costs[0]
