"""Worker: one rank of the tp x pp grid: its device, shard of the model (its KV heads
under tensor parallelism, its layers under pipeline parallelism), KV cache and model
runner.

Every rank gets the same SchedulerOutput and runs the same step; the ranks of a stage
meet only in the model's collectives (layers/parallel.py), and every rank samples the
same tokens from the same gathered logits (chapter 17). The stages of a pipeline pass
their hidden states on (pipeline/hop.py); only the last stage samples. At start a
rank loads its shard and measures the memory left for its KV pool
(`determine_available_memory`); the EngineCore takes the smallest answer and sizes
every pool (`initialize_kv_cache`).
vLLM: `vllm/v1/worker/gpu_worker.py`, `cpu_worker.py`.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch

from ..features import Composition
from ..messages import ModelRunnerOutput, PreemptionCosts, SchedulerOutput, WeightsInfo
from ..model.config import ModelConfig
from ..model.model_loader import load_model, weights_source
from ..layers.backends import TorchOps
from ..layers.groups import make_parallel_groups
from .model_runner import ModelRunner

# Seconds a collective may wait for the other ranks before it raises (gloo and NCCL):
# a rank that died or hangs turns into an error here, not an endless wait.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("NANOPAGED_COLLECTIVE_TIMEOUT_S", "60"))

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 1 << 30          # 1 GiB, at most 25% of free memory (see config.py)
_CUDA_KV_FRACTION = 0.9                  # of the device memory left free by the weights


def init_process_group(rank: int, world_size: int, init_method: str | None, device: torch.device,
                       store=None):
    """Join the torch.distributed group of all the ranks (gloo on the CPU,
    NCCL on CUDA) and return it. `init_method`: "env://" under torchrun, else a
    "tcp://127.0.0.1:PORT" or "file://PATH" rendezvous the executor chose; or None and
    a `store` (node 0's TCPStore: multiproc/multinode.py)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "gloo" and init_method not in ("env://", None):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")    # one machine: the loopback
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), store=store)
    return dist.group.WORLD


class Worker:
    """One rank: model shard, KV cache and ModelRunner.

    Args:
        config: the resolved EngineConfig.
        model_path, model_config: the model folder and its ModelConfig.
        ops: the kernels the engine chose (layers/backends.get_ops).
        rank, world_size: this global rank (pp_rank * tp + tp_rank) of tp x pp ranks.
        process_group: the ProcessGroup of all ranks (None at world_size 1); the
            stage's TPGroup and the pipeline's PPGroup are made from it
            (make_parallel_groups).

    Raises:
        ValueError: world_size is not tensor_parallel_size x pipeline_parallel_size, or
            the model does not split over them.
    """

    def __init__(self, config, model_path, model_config: ModelConfig, *, ops: TorchOps, rank: int = 0,
                 world_size: int = 1, process_group=None) -> None:
        self.config, self.ops, self.rank, self.world_size = config, ops, rank, world_size
        device = config.torch_device
        if device.type == "cuda" and world_size > 1:
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        self.device = device
        tp_size, pp_size = config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size
        if world_size != tp_size * pp_size:
            raise ValueError(f"world_size={world_size} but tensor_parallel_size={tp_size} x "
                             f"pipeline_parallel_size={pp_size} = {tp_size * pp_size}")
        self.composition = Composition.of(config)          # which classes serve the model and runner
        self.tp, self.pp = make_parallel_groups(rank, tp_size, pp_size, process_group, device=device)
        if rank == 0:
            logger.info("loading weights from %s (%s, %s%s)", weights_source(model_path), config.dtype, device,
                        f", {tp_size} tensor-parallel x {pp_size} pipeline ranks" if world_size > 1 else "")
        start = time.perf_counter()
        self.model = load_model(model_path, config.torch_dtype, device, config.max_model_len, self.tp, self.pp,
                                model_class=lambda family: self.composition.build(family, "model"))
        if rank == 0:
            logger.info("weights loaded in %.1f s: %s", time.perf_counter() - start,
                        weights_info(self.model).describe())
        self.extra_models = self._load_extra_models()
        self.model_runner: ModelRunner | None = None       # made by initialize_kv_cache

    def _load_extra_models(self) -> dict:
        """Hook: models that run beside this one on the same block tables, by the runner's
        keyword for them (spec_decode/worker.py: the draft model). Loaded with the
        weights, before the KV pool is sized, so their KV blocks are counted."""
        return {}

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes on this rank (its KV heads, its stage's layers), K
        and V; with extra models, their blocks of the same tokens too (they share the tables)."""
        return sum(ModelRunner.kv_cache_bytes_per_block(m.config, self.config.cache_config.block_size, self.config.torch_dtype,
                                                        m.num_local_kv_heads, m.num_kv_cache_layers)
                   for m in (self.model, *self.extra_models.values()))

    def determine_available_memory(self) -> int:
        """Bytes this rank can give its KV pool, measured now that its weights are on
        the device (vLLM v1's Worker.determine_available_memory): config's
        kv_cache_memory_bytes when set; else on CUDA 90% of the device's free memory
        (after torch's cache of freed blocks is emptied), on the CPU min(1 GiB, 25% of
        the host's available memory)."""
        if self.config.cache_config.kv_cache_memory_bytes is not None:
            return self.config.cache_config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * _CUDA_KV_FRACTION)
        return min(_DEFAULT_CPU_KV_BYTES, _free_host_memory() // 4)

    def describe_weights(self) -> WeightsInfo:
        """The bytes this rank's weights hold resident, by format (its model and its
        extra models)."""
        return WeightsInfo.combine([weights_info(m) for m in (self.model, *self.extra_models.values())])

    def initialize_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Build this rank's model runner, with its KV pool of num_gpu_blocks blocks (the
        EngineCore's choice) and swap pool of num_cpu_blocks; the class is the base with
        the config's features in front (features.py)."""
        runner_class = self.composition.build(ModelRunner, "model_runner")
        self.model_runner = runner_class(self.config, self.model, num_gpu_blocks=num_gpu_blocks,
                                         num_cpu_blocks=num_cpu_blocks, ops=self.ops, **self.extra_models)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step on this rank (every rank of a stage computes the same
        ModelRunnerOutput; a stage before the last an empty one); None when its
        structured-output rows wait for sample_tokens."""
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, sampling_input) -> ModelRunnerOutput:
        """Sample the step execute_model left waiting, with what its rows waited for
        (sampling_input: a feature's message, e.g. structured outputs' GrammarOutput)."""
        return self.model_runner.sample_tokens(sampling_input)

    def measure_preemption_costs(self) -> PreemptionCosts:
        """ModelRunner.measure_preemption_costs on this rank (every rank must run it:
        its timed prefill goes through the collectives)."""
        return self.model_runner.measure_preemption_costs()

    def time_group_broadcast(self, message, iters: int = 20) -> float:
        """Seconds per broadcast of `message` from rank 0 to every rank over the process
        group (torch.distributed.broadcast_object_list): the other way to deliver the
        control message, measured by bench.py --sections tp against the executor's
        pyzmq push. Every rank must call it."""
        import torch.distributed as dist

        dist.barrier(group=self.tp.process_group)
        start = time.perf_counter()
        for _ in range(iters):
            box = [message if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.tp.process_group)
        return (time.perf_counter() - start) / iters

    def get_comm_stats(self) -> dict[str, float]:
        """Seconds and count of this rank's collectives so far, and its pipeline hops'
        (PPGroup.stats: pp_send_seconds, pp_recv_seconds, pp_bytes_sent, pp_num_hops)."""
        return {"comm_seconds": self.tp.comm_seconds, "num_collectives": self.tp.num_collectives,
                **self.pp.stats()}


def weights_info(model: torch.nn.Module) -> WeightsInfo:
    """The model's resident weights by format: its parameters by dtype, plus what each
    quantized layer's quant_method holds (its `bytes_by_format()`)."""
    held: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        held[name] = held.get(name, 0) + p.numel() * p.element_size()
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is None:
            continue
        for name, size in method.bytes_by_format().items():
            held[name] = held.get(name, 0) + size
    return WeightsInfo(held)


def _free_host_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (8 GiB if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
