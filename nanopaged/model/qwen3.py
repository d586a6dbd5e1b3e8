"""Qwen3 (Qwen team 2025): Llama's layers with an RMSNorm on every head of q and k.

Before RoPE, each head's query and key vectors ([head_dim]) are normalized with a learned
weight shared by all heads (`q_norm`, `k_norm`; "QK-norm", Dehghani et al. 2023, which
keeps attention logits from growing). There is no q/k/v bias (unlike Qwen2), and
`head_dim` is set explicitly in config.json and need not be hidden_size / heads
(Qwen3-0.6B: 1024 / 16 heads but head_dim 128). Under tensor parallelism the two norm
weights are replicated: every rank normalizes its own heads with the same weight.
vLLM: `vllm/model_executor/models/qwen3.py`; transformers: `Qwen3Attention`.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import LlamaAttention, LlamaForCausalLM, RMSNorm
from ..layers.parallel import TPGroup


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with q_norm and k_norm (RMSNorm over head_size, weight [head_size])."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__(config, tp)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalize each head of q [num_tokens, heads * head_size] and k [num_tokens,
        kv_heads * head_size], then RoPE as Llama."""
        n, d = q.shape[0], self.head_size
        q = self.q_norm(q.reshape(-1, d)).view(n, -1)      # one row per (token, head)
        k = self.k_norm(k.reshape(-1, d)).view(n, -1)
        return super().rotate(q, k, positions, rope)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) over a flat token batch with a paged KV cache; see LlamaForCausalLM
    for the shapes. Checkpoint tensors: Llama's plus `self_attn.q_norm.weight` and
    `self_attn.k_norm.weight` ([head_dim] each)."""

    attention_cls = Qwen3Attention
