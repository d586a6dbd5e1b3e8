"""CPU graphs: a decode step's kernel calls recorded once and replayed, without the module calls.

Once the matmuls are fast, the Python that drives a small decode step (module calls,
views, allocations around ~300 kernel calls) is a large share of it (chapter 12).
vLLM removes the same cost on a GPU with CUDA graphs (`vllm/v1/worker/
gpu_model_runner.py`, capture_model; `--enforce-eager` turns them off): it records a
decode step's kernel launches once per batch size, with the inputs in static buffers,
and later steps copy their inputs into those buffers and launch the record.

A CPUGraph is that idea on the CPU. Capturing runs the model's layers once for real
(`LlamaForCausalLM.forward_embeds`, from the embedded tokens to the final norm) while
  - every call into the compiled kernels (layers/backends.py's KernelOps calls its
    module `ops`) is appended to a list with its arguments: the same tensors, which the
    list keeps alive, so each output buffer and each view of it stays where it was;
  - every torch operation in between is seen too (a TorchDispatchMode): allocations and
    views are free to replay (their tensors persist); a copy (`.contiguous()`, `.to()`)
    is recorded as a `copy_` into the tensor it made, an in-place operation (a bias
    added with `add_`) as itself, and any other computation as itself with its result
    copied into the tensor it made the first time. A host read (`.item()`), a random
    draw or a collective cannot be replayed: that batch size runs eagerly.
The metadata's host lists (seq_lens_list, ...) refuse to be read while capturing: Python
that read them would be baked into the record with this step's values.
Replaying calls the recorded kernels in order on the same tensors (a Python loop over the
list, without the modules, views and allocations around it): the same arithmetic as the
eager step, bit for bit (tests/cpu_graph/test_cpu_graph.py compares them). A graph keeps its
step's intermediate tensors: about 1 MB a row for SmolLM2.

Where it applies: a step whose rows are all decodes (one new token each), at most
MAX_CAPTURE_SIZE of them, on the CPU kernels, one rank. Each batch size is captured the
first time it is seen (the first step of that size costs a normal step); the block
table's width is padded (its padding is masked by seq_lens), doubled and recaptured
when a sequence outgrows it. Prefill, chunked, speculative-verify and larger batches run
eagerly: there the Python is a small share of a step.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..layers.attention import AttentionMetadata
from ..layers.backends import KernelOps
from ..worker.model_input import ModelInput
from ..worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 8        # decode batches up to this size replay (vLLM: cudagraph_capture_sizes)
MIN_WIDTH = 16              # block-table columns of a first capture

aten = torch.ops.aten
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                aten.new_empty.default}
_COPIES = {aten.clone.default, aten._to_copy.default}       # a new tensor: replayed as out.copy_(src)
_HOST_READS = {aten.item.default, aten._local_scalar_dense.default}


class Uncapturable(RuntimeError):
    """A step did something a CPUGraph cannot replay (the message says what)."""


class _HostList(list):
    """A metadata host list while capturing: reading it refuses the capture."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _refuse(self, *args):
        raise Uncapturable(f"the step read {self.name}, a host list of this step's values")
    __len__ = __iter__ = __getitem__ = __bool__ = _refuse


class _Recorder:
    """Stands in for the kernel module while capturing: each function call is run and
    appended to `calls` as (function, args)."""

    def __init__(self, module, calls: list) -> None:
        self._module, self._calls, self.inside = module, calls, False

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)         # AttributeError for a kernel the build lacks
        if not callable(fn):
            return fn

        def record(*args, **kwargs):
            self._calls.append((functools.partial(fn, **kwargs) if kwargs else fn, args))
            self.inside = True                   # the kernel's own torch calls are its business
            try:
                result = fn(*args, **kwargs)
            finally:
                self.inside = False
            if result is not None:
                raise Uncapturable(f"kernel {name} returned a new object")
            return result
        return record


class _CaptureMode(TorchDispatchMode):
    """Records the torch operations between kernel calls (see the module docstring)."""

    def __init__(self, recorder: _Recorder, calls: list) -> None:
        super().__init__()
        self.recorder, self.calls = recorder, calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recorder.inside or func in _ALLOCATIONS:
            return out
        if func in _HOST_READS:
            raise Uncapturable(f"{func} reads a tensor's value into Python")
        if func.namespace != "aten" or torch.Tag.nondeterministic_seeded in func.tags:
            raise Uncapturable(f"{func} cannot be replayed (a collective, or a random draw)")
        if func.is_view:      # may alias: a view, or a copy where none can (contiguous, reshape)
            if not isinstance(out, torch.Tensor) or _same_storage(out, args[0]):
                return out
            if not (out.is_contiguous() and out.numel() == args[0].numel()):
                raise Uncapturable(f"{func} made a copy that cannot be replayed")
            self.calls.append((torch.Tensor.copy_, (out.view(args[0].shape), args[0])))
        elif func in _COPIES:
            self.calls.append((torch.Tensor.copy_, (out, args[0])))
        elif func._schema.is_mutable:        # in place (or out=): the same call writes the same tensors
            self.calls.append((functools.partial(func, **kwargs), args))
        elif isinstance(out, torch.Tensor):  # a new tensor: computed again and copied into it
            self.calls.append((_recompute, (out, func, args, kwargs)))
        else:
            raise Uncapturable(f"{func} returns {type(out).__name__}, not one tensor")
        return out


def _recompute(out: torch.Tensor, func, args, kwargs) -> None:
    out.copy_(func(*args, **kwargs))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class CPUGraph:
    """One decode batch size's recorded step, with its static inputs.

    Attributes:
        num_seqs: the batch size (decode rows, one token each).
        width: block-table columns held (a padded block table).
        inputs_embeds: [num_seqs, hidden] the embedded tokens, in the model's dtype.
        positions, slot_mapping, seq_lens: [num_seqs] int64; block_tables: [num_seqs,
            width] int64; query_start_loc: [num_seqs + 1] int64 = 0, 1, ..., num_seqs.
        output: [num_seqs, hidden], the hidden states a replay writes.
        calls: the recorded (function, args), in order.
    """

    def __init__(self, inputs_embeds: torch.Tensor, width: int) -> None:
        n, device = inputs_embeds.shape[0], inputs_embeds.device
        self.num_seqs, self.width = n, width
        self.inputs_embeds = inputs_embeds.clone()
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device)
        self.meta = AttentionMetadata(slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                                      seq_lens=self.seq_lens, query_start_loc=self.query_start_loc,
                                      num_decodes=n, seq_lens_list=_HostList("seq_lens_list"),
                                      query_start_loc_list=_HostList("query_start_loc_list"))
        self.output: torch.Tensor | None = None
        self.calls: list = []

    def load(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a step's inputs into the static buffers (the block table's columns past
        its width keep old ids: masked by seq_lens, never read)."""
        self.inputs_embeds.copy_(inputs_embeds)
        self.positions.copy_(positions)
        self.slot_mapping.copy_(meta.slot_mapping)
        self.seq_lens.copy_(meta.seq_lens)
        self.block_tables[:, :meta.block_tables.shape[1]].copy_(meta.block_tables)

    def capture(self, ops: KernelOps, forward) -> None:
        """Run forward(inputs_embeds, positions, meta) -> hidden once, recording it.

        Raises:
            Uncapturable: it ran a torch computation outside the kernels (or anything
                else unsafe to replay: a kernel returning a new tensor, a host list).
        """
        module = ops.ops
        recorder = _Recorder(module, self.calls)
        ops.ops = recorder
        try:
            with _CaptureMode(recorder, self.calls):
                self.output = forward(self.inputs_embeds, self.positions, self.meta)
        finally:
            ops.ops = module

    def replay(self) -> torch.Tensor:
        """The recorded calls in order; returns `output` (overwritten by the next replay)."""
        for fn, args in self.calls:
            fn(*args)
        return self.output


class CPUGraphModelRunner(ModelRunner):
    """A ModelRunner whose small all-decode steps replay a CPUGraph (`_forward`, the
    extension "cpu_graphs": on unless EngineConfig.enforce_eager, on one rank, with a
    compiled backend; it replays only on the CPU kernels).

    Attributes:
        graphs: batch size -> its CPUGraph, or None where that size runs eagerly.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, CPUGraph | None] = {}     # batch size -> graph; None: runs eagerly
        self.graphs_usable = (self.device.type == "cpu" and isinstance(self.ops, KernelOps)
                              and self.ops.fused_layer_ops)

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        meta, n = inp.attn_metadata, inp.input_ids.shape[0]
        if not self.graphs_usable or n > MAX_CAPTURE_SIZE or meta.num_decodes != n or len(meta.seq_lens_list) != n:
            return super()._forward(inp)
        graph = self.graphs.get(n, False)
        if graph is None:
            return super()._forward(inp)
        width = meta.block_tables.shape[1]
        embeds = self.model.embed_tokens(inp.input_ids)
        if graph is False or graph.width < width:
            return self._capture(n, embeds, inp, max(MIN_WIDTH, 2 * (graph.width if graph else 0), width))
        graph.load(embeds, inp.positions, meta)
        return graph.replay().clone()

    def _capture(self, n: int, embeds: torch.Tensor, inp: ModelInput, width: int) -> torch.Tensor:
        """Capture batch size n's graph on this step (its result is the step's); on
        Uncapturable, log why once and run this size eagerly from now on."""
        graph = CPUGraph(embeds, width)
        graph.load(embeds, inp.positions, inp.attn_metadata)
        try:
            graph.capture(self.ops, lambda x, pos, meta: self.model.forward_embeds(x, pos, self.kv_cache, meta))
        except Uncapturable as e:
            logger.warning("decode batches of %d run eagerly: %s", n, e)
            self.graphs[n] = None
            return super()._forward(inp)       # the K/V it wrote are rewritten with the same values
        self.graphs[n] = graph
        return graph.output.clone()
