"""Incremental detokenization and stop strings: the text side of one sequence.

A byte-level BPE token can hold half of a multi-byte character (an emoji is often 3-4
tokens), so decoding each new token on its own would print U+FFFD garbage. tokenizers'
DecodeStream buffers such tokens until the bytes form whole characters and returns only
the new text, which is what streaming needs (vLLM's `detokenize_incrementally` does the
same with prefix/read offsets). It is seeded with the last few prompt tokens so that a
first output token that starts with a space (SentencePiece's "▁") keeps it.

Stop strings are found here too, on the text, because only text knows them: a stop string
may span several tokens ("Paris." can be " Par" + "is" + "."), so the core, which sees
only ids, cannot. `check_stop_strings` searches only the text that is new this step.
vLLM: `vllm/v1/engine/detokenizer.py` (FastIncrementalDetokenizer, check_stop_strings).
"""
from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

# Context tokens from the prompt; vLLM used 5 too (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PROMPT_CONTEXT = 5
# What tokenizers raises when a decoder made earlier text change; vLLM resets the stream.
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text, one id at a time.

    Args:
        tokenizer: a transformers fast tokenizer (uses its `backend_tokenizer`).
        prompt_token_ids: the sequence's prompt ids (a few give the decoder context).
        skip_special_tokens: leave special tokens (eos, chat markers) out of the text.
        spaces_between_special_tokens: only matters when special tokens are kept. With a
            fast tokenizer vLLM v1 does this: when False, a special (added) token that
            directly follows another one is emitted as its bare content, without the
            space a word-joining decoder (WordPiece, Metaspace) would put before it.
            Byte-level decoders add no such space, so for them it changes nothing.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        # A prompt that ends inside a multi-byte character (a cut emoji, or random ids)
        # would make the stream return the context's text along with the first output
        # token once that character completes: drop such trailing tokens from the context
        while context and self._backend.decode(context, skip_special_tokens=False).endswith("\ufffd"):
            context.pop()
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # id -> content of every added token, only needed to glue special tokens together
        self._added: dict[int, str] = {}
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        self._last_was_added = False

    def step(self, token_id: int) -> str:
        """Feed one new token id; returns the text it completes ("" if none yet)."""
        text = self._protected_step(token_id)
        if self._added:
            is_added = token_id in self._added
            if is_added and self._last_was_added:
                text = self._added[token_id]
            self._last_was_added = is_added
        return text

    def _protected_step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as e:       # tokenizers raises a plain Exception for this
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # A decoder rewrote text it had already returned (rare; seen with some
            # normalizing decoders). That text is out already, so start a fresh stream.
            logger.warning("detokenizer: %s; resetting the decode stream", e)
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id) or ""


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """Look for a stop string that ends in the last `new_char_count` characters.

    Only the new text and the len(s) - 1 characters before it can hold a match that the
    previous call did not see, so that is all we search: the cost per token does not grow
    with the text.

    Args:
        output_text: the whole text so far, new text included.
        new_char_count: how many characters at its end are new.
        stop: the stop strings.
        include_in_output: keep the matched string in the text.

    Returns:
        None, or (the matched string, the length to cut the text to). When several match,
        the one whose last character comes first wins (the longer on a tie): the match a
        reader going character by character would see first, so the result does not
        depend on how the text was split into tokens. (vLLM takes the first in list order
        that matches; the two differ only when one step's text holds two stop strings.)
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, int, str] | None = None          # (end, start, string)
    for s in stop:
        start = output_text.find(s, max(0, len(output_text) - new_char_count - len(s) + 1))
        if start != -1 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    if best is None:
        return None
    end, start, s = best
    return s, end if include_in_output else start
