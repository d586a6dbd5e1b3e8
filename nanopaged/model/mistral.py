"""Mistral (Jiang et al. 2023): Llama's layers, and a sliding attention window.

Mistral-7B-v0.1 attends only to the last `sliding_window` = 4096 tokens: a query at
position p sees keys p - 4095 .. p (§2 of the paper; transformers masks the rest). Later
versions (v0.2, v0.3) set no window and are Llama in all but name. The engine does not
implement the window in its attention kernels; instead it never lets a sequence grow past
it (max_model_len <= sliding_window, engine/arg_utils.py), where the window cuts nothing
and full attention is exact. That is what vLLM did for attention backends without
window support. vLLM: `vllm/model_executor/models/llama.py` serves Mistral too.
"""
from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral over a flat token batch with a paged KV cache; see LlamaForCausalLM.

    Raises:
        ValueError: init_rope for more positions than the sliding window (the window
            would cut attention, which is not implemented).
    """

    def init_rope(self, max_positions: int) -> None:
        window = self.config.sliding_window
        if window is not None and max_positions > window:
            raise ValueError(f"max_model_len={max_positions} exceeds the model's sliding_window={window}: "
                             "sliding-window attention is not implemented; use max_model_len <= "
                             f"{window} (attention is exact there)")
        super().init_rope(max_positions)
