"""The Llama model (Touvron et al. 2023) as the engine runs it: a flat batch of tokens
from many sequences, K/V kept in the paged cache.

Same math as Hugging Face's `LlamaForCausalLM` (and SmolLM2, which is a Llama): token
embedding, then per layer

    h = x + o_proj(attention(rope(q), rope(k), v))      q, k, v from input_layernorm(x)
    x = h + down_proj(silu(gate_proj(y)) * up_proj(y))   y = post_attention_layernorm(h)

then a final RMSNorm and the LM head (tied to the embedding in small models). Two
serving changes, both vLLM's (`vllm/model_executor/models/llama.py`):

- There is no batch dimension. The input is the new tokens of every scheduled sequence
  laid end to end, `[num_tokens]`, with their `positions`; attention.py sorts out which
  token belongs to which sequence from the AttentionMetadata.
- q/k/v are one matmul (`qkv_proj`), and so are gate/up (`gate_up_proj`): fewer, larger
  matmuls are faster, and the weights are just stacked at load time.

Weights are read straight from safetensors (one file or an index of shards, listed by
model_loader.safetensors_files); config.json is parsed by config.py. The other families
(registry.py) subclass these classes and change only what differs.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from ..layers.attention import AttentionMetadata
from ..layers.backends import TorchOps
from ..layers.parallel import (ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding,
                              _check_shape, shard_heads, valid_tp_size)
from .config import ModelConfig
from .model_loader import safetensors_files


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, [head_size // 2] float32, with the config's scaling.

    Supported rope_scaling types: default (none), "linear" (positions divided by factor,
    Chen et al. 2023) and "llama3" (Llama 3.1's frequency-dependent scaling). Matches
    transformers' `modeling_rope_utils`.

    Raises:
        ValueError: any other rope type (names it).
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like transformers' LlamaRMSNorm.

    forward(x [num_tokens, hidden]) -> normalized rows; forward(x, residual) -> (the
    normalized rows of x + residual, x + residual): the skip connection's add is done
    by the norm that follows it (vLLM's fused_add_rms_norm), in one pass with the
    compiled kernels. The math is in the kernels' ops (`ops`: layers/backends.py).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = TorchOps()      # set_ops gives the kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: qkv_proj column-parallel by heads,
    o_proj row-parallel (its all-reduce joins the heads of all ranks).

    Two hooks for the families built on it: `qkv_bias` (Qwen2: q, k and v have a bias,
    split by heads like the weight rows) and `rotate` (Qwen3 normalizes each head
    before RoPE)."""

    qkv_bias = False

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        d = config.head_dim
        shard = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads, self.head_size = shard.num_heads, shard.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        kv_rows = config.num_key_value_heads * d
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, {
            "q_proj": (config.num_attention_heads * d, shard.first_head * d, self.q_size),
            "k_proj": (kv_rows, shard.first_kv_head * d, self.kv_size),
            "v_proj": (kv_rows, shard.first_kv_head * d, self.kv_size)}, tp, bias=self.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, tp)
        self.scale = d ** -0.5
        self.ops = TorchOps()          # set_ops gives the kernels

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotate(q, k, positions, rope)
        q = q.view(n, self.num_heads, self.head_size)          # [num_tokens, heads, head_size]
        k = k.view(n, self.num_kv_heads, self.head_size)       # [num_tokens, kv_heads, head_size]
        v = v.view(n, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.ops.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        o = self.ops.forward(q, key_cache, value_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q [num_tokens, heads * head_size] and k [num_tokens, kv_heads *
        head_size] (rope: the cos and sin tables, [max_positions, head_size]); in place
        on the views of qkv_proj's output with the kernels."""
        return self.ops.rotary_embedding(positions, q, k, *rope, self.head_size)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: gate_up_proj column-parallel by intermediate rows, down_proj
    row-parallel (one all-reduce)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        inter, n = config.intermediate_size, config.intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, {
            "gate_proj": (inter, tp.rank * n, n), "up_proj": (inter, tp.rank * n, n)}, tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp)
        self.ops = TorchOps()      # set_ops gives the kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, attention_cls: type = LlamaAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_cls(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, x, residual, positions, rope, kv_cache, meta):
        """x: the last sublayer's output, residual: the stream it adds to (None before
        the first layer, where x is the embedding). Returns the same pair for the next."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError (naming the sizes, tp, and the sizes that would split this
    model) unless the model splits over tp_size ranks: the heads by vLLM's GQA rules
    (layers/parallel.py, shard_heads), and the intermediate size evenly."""
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    try:
        shard_heads(heads, kv_heads, tp_size)
        if inter % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide intermediate_size={inter}")
    except ValueError as e:
        fits = [t for t in range(1, heads + 1) if valid_tp_size(heads, kv_heads, t) and inter % t == 0]
        raise ValueError(f"{e}; try one of {fits}") from None


class LlamaForCausalLM(nn.Module):
    """Llama over a flat token batch with a paged KV cache, this rank's shard of it.

    Args:
        config: the ModelConfig.
        tp: this rank's TPGroup (default: one rank, the whole model, no communication).
        pp: this rank's PPGroup (layers/groups.py), kept as `pp`; this class holds the
            whole model (one stage), pipeline/stage_model.py one stage of several.

    forward(input_ids [num_tokens] int64, positions [num_tokens] int64,
            kv_caches [num_layers, 2, num_blocks, block_size, num_local_kv_heads, head_size],
            meta: AttentionMetadata) -> hidden states [num_tokens, hidden_size]
            (the whole hidden state on every rank).
    compute_logits(hidden [n, hidden_size]) -> [n, vocab_size] float32 (every rank).

    Raises:
        ValueError: the model does not split over tp.size ranks (check_tensor_parallel).
    """

    attention_cls: type = LlamaAttention      # what a family changes (qwen2.py, qwen3.py)

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, pp=None) -> None:
        super().__init__()
        self.config, self.pp = config, pp
        self.tp = tp = tp or TPGroup()
        check_tensor_parallel(config, tp.size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, self.attention_cls)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rope_cos = self.rope_sin = None

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank holds, so its KV cache holds (all of them at tp=1)."""
        return self.layers[0].self_attn.num_kv_heads

    @property
    def num_kv_cache_layers(self) -> int:
        """Layers whose K/V this rank caches: the first dimension of its kv_caches."""
        return len(self.layers)

    def init_rope(self, max_positions: int) -> None:
        """Precompute cos/sin for positions 0..max_positions-1: [max_positions, head_size]."""
        inv_freq = rope_inv_freq(self.config)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        weight = next(self.parameters())       # where the weights live, in their dtype
        device, dtype = weight.device, weight.dtype
        self.rope_cos = emb.cos().to(device=device, dtype=dtype)
        self.rope_sin = emb.sin().to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(input_ids), positions, kv_caches, meta)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The layers and the final norm on the embedded tokens x [num_tokens, hidden]
        (vLLM's inputs_embeds): what a decode graph captures (cpu_graph/model_runner.py)."""
        residual = None
        rope = (self.rope_cos, self.rope_sin)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    def set_ops(self, ops: TorchOps) -> None:
        """Give every layer these kernels (backends.get_ops picks them): attention, the
        fused RMSNorm, RoPE and SiLU-and-mul, and the linear layers' matmuls
        (batch-invariant: one order of additions for every batch size)."""
        for module in self.modules():
            if hasattr(module, "ops"):          # attention, norms, MLPs, the linear layers
                module.ops = ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32, summed in float32
        (VocabParallelEmbedding.logits says why); the embedding is the head when tied."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    # -- loading -------------------------------------------------------------------------

    def load_weights(self, folder: str | os.PathLike) -> None:
        """Copy weights from the folder's safetensors (one file or sharded) into the model.

        Each tensor is opened as a slice and only this rank's rows or columns are read
        (a tp rank reads about 1/tp of the file). q/k/v and gate/up go into their
        slices of qkv_proj and gate_up_proj. With tied embeddings a stored
        lm_head.weight is ignored (transformers does the same).

        Raises:
            FileNotFoundError: no *.safetensors in the folder.
            ValueError: a file that cannot be read, or a missing/misshapen tensor
                (the message names the file or tensor).
        """
        from safetensors import safe_open

        files = safetensors_files(Path(folder))
        loaded: set[str] = set()
        for file in files:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        key = self._load_one(name, f.get_slice(name), file)
                        if key:
                            loaded.add(key)
            except Exception as e:      # safetensors raises its own SafetensorError
                if isinstance(e, ValueError) and str(file) in str(e):
                    raise
                raise ValueError(f"could not read safetensors file {str(file)!r}: {e}") from e
        self._check_loaded(loaded, folder)

    def _check_loaded(self, loaded: set[str], folder) -> None:
        """Raise ValueError naming (the first five of) the parameters, or parts of a
        stacked one, whose keys (as `_load_one` returns them) are not in `loaded`."""
        expected = set()
        for name, module in self.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                key = f"{name}.{pname}" if name else pname
                parts = getattr(module, "parts", None)
                expected |= {f"{key}#{p}" for p in parts} if parts else {key}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"model folder {str(folder)!r} lacks weights for {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")

    def _load_one(self, name: str, src, file: Path) -> str | None:
        """Copy this rank's share of one stored tensor (a safetensors slice) into its
        parameter; returns the key it filled ("param#part" for a stacked one)."""
        stored, name = name, name.removeprefix("model.")
        if name.startswith("lm_head.") and self.lm_head is None or "rotary_emb" in name:
            return None                # tied head, or a buffer we recompute
        *path, matrix, leaf = ["", *name.split(".")] if name.count(".") == 0 else name.split(".")
        fused = _STACKED.get(matrix)
        try:
            try:
                module = self.get_submodule(".".join(path)) if path else self
            except AttributeError:
                raise ValueError(f"unexpected tensor {stored!r} for {type(self).__name__}") from None
            if fused and hasattr(module, fused):
                getattr(module, fused).load(matrix, src, stored, leaf)    # a slice of a stacked weight or bias
                return f"{'.'.join(path + [fused, leaf])}#{matrix}"
            target = getattr(module, matrix, None)
            if leaf == "weight" and hasattr(target, "load"):
                target.load(src, stored)                                   # row-parallel or vocab
            elif isinstance(getattr(target, leaf, None), nn.Parameter):
                param = getattr(target, leaf)
                _check_shape(stored, src, tuple(param.shape))
                param.data.copy_(src[:])                                   # replicated: norms
            else:
                raise ValueError(f"unexpected tensor {stored!r} for {type(self).__name__}")
        except ValueError as e:
            raise ValueError(f"{str(file)!r}: {e}") from None
        return f"{'.'.join(path + [matrix])}.{leaf}"


# HF's separate projections -> our stacked parameter holding them
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
            "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
