"""Incremental detokenization: text deltas that never split a UTF-8 character.

A byte-level BPE token can hold half of a multi-byte character (an emoji is often 3-4
tokens), so decoding each new token on its own would print U+FFFD garbage. tokenizers'
DecodeStream buffers such tokens until the bytes form whole characters and returns only
the new text, which is what streaming needs (vLLM's `detokenize_incrementally` does the
same with prefix/read offsets). It is seeded with the last few prompt tokens so that a
first output token that starts with a space (SentencePiece's "▁") keeps it.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Context tokens from the prompt; vLLM uses 5 too (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Per-sequence text accumulator.

    Args:
        tokenizer: a transformers fast tokenizer (uses its `backend_tokenizer`).
        prompt_token_ids: the sequence's prompt ids (a few give the decoder context).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT:]),
                                    skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        """Feed one new token id; returns the text it completes ("" if none yet)."""
        return self._stream.step(self._backend, token_id) or ""
