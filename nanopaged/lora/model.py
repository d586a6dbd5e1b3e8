"""The model's side of multi-LoRA: every projection of every decoder layer gets a pool of
adapter slots, and each row of a batch adds the delta of the slot its sequence uses.

S-LoRA (Sheng et al. 2023) and vLLM keep a few adapters resident on the device in
stacked tensors, one slot each, and Punica's BGMV (punica.py) computes a whole batch's
deltas, each row with its own slot, in one call per projection. Here each of qkv_proj,
o_proj, gate_up_proj and down_proj becomes a LoRALinear around the base layer (plain,
GGUF or int8: it only adds to the base's output), holding per part (q, k, v; gate, up;
or the whole matrix)

    lora_a [max_loras, max_lora_rank, in], lora_b [max_loras, out, max_lora_rank],
    scales [max_loras] float32,

an adapter of rank r < max_lora_rank padded with zeros (zero products add exact zeros),
a projection it does not target all zeros. The step's slot of every token is in one
buffer the layers share (LoRABatch), written in place before each forward, so a CPU
graph's replay reads the new step's values. A row whose slot is -1 is left untouched:
bit for bit the base model. vLLM: `vllm/lora/layers/` (BaseLayerWithLoRA and its
column/row parallel subclasses), `vllm/lora/punica_wrapper/`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.backends import TorchOps
from .adapter import LoRAAdapter
from .kernels import join_lora_kernels
from .punica import add_lora


class LoRABatch:
    """The slot of each token of the step, for every LoRALinear of a model.

    token_slots: [num_tokens] int64 (-1: no adapter), a view of a buffer of `capacity`
    tokens that `set` rewrites in place (a step larger than that, never a replayed one,
    gets a tensor of its own); None: no token of the next forward has an adapter (a
    forward that is not a step's, such as the start-up measurement).
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.buffer = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.token_slots: torch.Tensor | None = None

    def set(self, slots: list[int]) -> None:
        """The step's slots, one per token in batch order."""
        values = torch.tensor(slots, dtype=torch.int64)
        if len(slots) > len(self.buffer):
            self.token_slots = values.to(self.buffer.device)
            return
        self.token_slots = self.buffer[:len(slots)]
        self.token_slots.copy_(values)


class LoRALinear(nn.Module):
    """base_layer(x) plus each row's LoRA delta, part by part.

    Args:
        base_layer: the projection (ColumnParallelLinear or RowParallelLinear, any weights).
        parts: HF projection name -> (first output column, columns) of base_layer's output.
        in_size: its input features; max_loras, max_rank: the slots and their rank.
        batch: the model's LoRABatch; dtype: the activations' (the slots are kept in it).

    forward(x [n, in]) -> [n, out] in x's dtype.
    """

    def __init__(self, base_layer: nn.Module, parts: dict[str, tuple[int, int]], in_size: int, max_loras: int,
                 max_rank: int, batch: LoRABatch, dtype: torch.dtype) -> None:
        super().__init__()
        self.base_layer, self.parts, self.batch, self.max_rank = base_layer, parts, batch, max_rank
        device = batch.buffer.device
        self.lora_a = {name: torch.zeros(max_loras, max_rank, in_size, dtype=dtype, device=device) for name in parts}
        self.lora_b = {name: torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device)
                       for name, (_, n) in parts.items()}
        self.scales = {name: torch.zeros(max_loras, dtype=torch.float32, device=device) for name in parts}
        self.ops = TorchOps()          # the model's set_ops gives the kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        slots = self.batch.token_slots                                        # [n] int64
        if slots is None:
            return y
        t = torch.empty(x.shape[0], self.max_rank, dtype=torch.float32, device=x.device)   # shrink's result
        for name, (first, n) in self.parts.items():
            add_lora(self.ops, y[:, first:first + n], x, self.lora_a[name], self.lora_b[name], slots,
                     self.scales[name], t)
        return y

    def set_slot(self, slot: int, name: str, ab: tuple[torch.Tensor, torch.Tensor] | None, scaling: float) -> None:
        """Part `name` of `slot` holds A [r, in] and B [out, r] (None: zeros), in place."""
        a, b, scale = self.lora_a[name][slot], self.lora_b[name][slot], self.scales[name]
        a.zero_()
        b.zero_()
        scale[slot] = 0.0 if ab is None else scaling
        if ab is not None:
            a[:ab[0].shape[0]].copy_(ab[0])
            b[:, :ab[1].shape[1]].copy_(ab[1])


class LoRAModel:
    """A model family class that serves LoRA adapters (the feature "LoRA adapters",
    features.py): `create_lora_slots` wraps the projections of the layers this rank holds
    (the worker calls it once the weights are loaded), `load_lora_slot` fills a slot, and
    `lora_batch` takes each step's token slots. `set_ops` joins the LoRA kernels to the CPU
    kernel backend (kernels.py), before any CPU graph is captured.
    """

    def set_ops(self, ops) -> None:
        join_lora_kernels(ops)
        super().set_ops(ops)

    def create_lora_slots(self, max_loras: int, max_rank: int, max_num_tokens: int) -> None:
        """Wrap qkv_proj, o_proj, gate_up_proj and down_proj of every decoder layer held
        here (a pipeline stage's placeholders are skipped) in LoRALinears with empty slots."""
        weight = next(self.parameters())          # where the activations live, in their dtype
        self.lora_batch = LoRABatch(max_num_tokens, weight.device)
        self.lora_layers: dict[int, dict[str, LoRALinear]] = {}
        for i, layer in enumerate(self.layers):
            if not hasattr(layer, "self_attn"):
                continue
            attn, mlp, wrapped = layer.self_attn, layer.mlp, {}
            for module, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
                base = getattr(module, name)
                parts = ({p: (base.offsets[p], n) for p, (_, _, n) in base.parts.items()} if hasattr(base, "parts")
                         else {name: (0, base.output_size)})
                lora = LoRALinear(base, parts, base.input_size, max_loras, max_rank, self.lora_batch, weight.dtype)
                setattr(module, name, lora)
                wrapped.update((p, lora) for p in parts)
            self.lora_layers[i] = wrapped

    def load_lora_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Slot `slot` of every projection holds `adapter` (None: empties it)."""
        for i, parts in self.lora_layers.items():
            for name, lora in parts.items():
                ab = None if adapter is None else adapter.weights.get((i, name))
                lora.set_slot(slot, name, ab, 0.0 if adapter is None else adapter.scaling)
