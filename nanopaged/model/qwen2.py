"""Qwen2 and Qwen2.5 (Qwen team 2024): Llama's layers plus a bias on q, k and v.

That bias is the whole difference at inference time (transformers' `Qwen2Attention`
builds q_proj/k_proj/v_proj with bias=True and o_proj without). Under tensor
parallelism the bias rows split with the weight rows, by heads. Qwen2's configs carry a
`sliding_window` that is off unless `use_sliding_window` is set (model/config.py).
vLLM: `vllm/model_executor/models/qwen2.py`.
"""
from __future__ import annotations

from .llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """LlamaAttention whose qkv_proj has a bias ([q_size + 2 * kv_size] on this rank)."""

    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/Qwen2.5 over a flat token batch with a paged KV cache; see LlamaForCausalLM
    for the shapes. Checkpoint tensors: Llama's plus `self_attn.{q,k,v}_proj.bias`."""

    attention_cls = Qwen2Attention
