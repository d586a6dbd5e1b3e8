"""N-gram proposer: draft tokens by prompt lookup, with no model at all.

Text often repeats itself: code that edits code, a summary quoting its source, a
chat echoing the question. Prompt lookup decoding (Saxena 2023,
github.com/apoorvumang/prompt-lookup-decoding) uses that: if the last n tokens of a
sequence appeared earlier in it, guess that what followed them then follows them now. The guesses are the draft
tokens of speculative decoding; the target model verifies them in its next forward
and the rejection sampler (rejection_sampler.py) keeps those it agrees with, so a
wrong guess costs a little compute and never changes the output.

In vLLM it runs once a step, after sampling, for each decoding sequence: its output
is the draft_token_ids of the next step.

vLLM: `vllm/v1/spec_decode/ngram_proposer.py` (NgramProposer, with
prompt_lookup_min / prompt_lookup_max / num_speculative_tokens from the speculative
config). vLLM finds the longest match with one KMP pass over the reversed tokens
(compiled with numba); this file tries each n from the longest down, which gives
the same answer and reads more plainly. vLLM also stops a draft at max_model_len
(and can limit the search to a recent window); this class leaves that to its caller.
"""
from __future__ import annotations

from ..worker.input_batch import SeqState
from ..worker.model_input import ModelInput
from .proposer import Proposer


class NgramProposer(Proposer):
    """Proposes draft tokens by matching the sequence's last n-gram earlier in it.

    Args:
        num_speculative_tokens: most draft tokens per proposal, >= 1.
        prompt_lookup_min: shortest n-gram to match, >= 1.
        prompt_lookup_max: longest n-gram to match, >= prompt_lookup_min.

    Raises:
        ValueError: an argument out of range; the message names it and its value.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min "
                             f"({prompt_lookup_min}), got {prompt_lookup_max}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._texts: dict[int, str] = {}     # seq_id -> its first tokens as a str, extended as they come

    def propose(self, inp: ModelInput, seqs: list[tuple[SeqState, list[int]]]) -> dict[int, list[int]]:
        """Proposer.propose: for each sequence, propose_text of its tokens and the new ones."""
        drafts = {}
        for s, new in seqs:
            text = self._texts.get(s.seq_id, "")
            text = self._texts[s.seq_id] = text + "".join(map(chr, s.token_ids(len(text), s.num_tokens)))
            drafts[s.seq_id] = self.propose_text(text + "".join(map(chr, new)))
        return drafts

    def remove_sequence(self, seq_id: int) -> None:
        self._texts.pop(seq_id, None)

    def propose_tokens(self, token_ids: list[int]) -> list[int]:
        """Draft tokens for a sequence whose tokens so far (prompt and output) are
        `token_ids`.

        For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are
        looked for earlier in token_ids (an occurrence that ends before the last token,
        so not the suffix itself; it may overlap it). The first n that matches wins,
        and the proposal is the up to num_speculative_tokens tokens that followed the
        match, fewer where they run into the end of the sequence. Like vLLM, the
        EARLIEST occurrence of the n-gram is used, not the most recent (vLLM's KMP
        pass keeps the last match it meets in the reversed tokens).

        Returns the draft token ids, or [] when no n-gram matches.

        Raises:
            ValueError: a token id outside [0, 0x110000) (see below).

        Each token id becomes one character of a str, so that str.find (C code) does
        the search; every real vocabulary is far below 0x110000 = 1,114,112 ids.
        Building the str is most of a call, even with long runs of partial matches: a
        search in C beats a Python scan of the list.
        """
        if len(token_ids) < 2:
            return []
        if min(token_ids) < 0 or max(token_ids) >= 0x110000:
            raise ValueError(f"token_ids: ids must be in [0, 0x110000), got "
                             f"{min(token_ids)}..{max(token_ids)}")
        return self.propose_text("".join(map(chr, token_ids)))

    def propose_text(self, text: str) -> list[int]:
        """`propose_tokens` for tokens already turned into a str (token id i -> chr(i)):
        `propose` keeps each sequence's str and extends it as tokens come, so a step
        costs a search, not an O(length) rebuild."""
        if len(text) < 2:
            return []
        for n in range(min(self.prompt_lookup_max, len(text) - 1), self.prompt_lookup_min - 1, -1):
            # Search text[:-1]: the occurrence must end before the last token, so it
            # is not the suffix itself (it may overlap it). find returns the first.
            start = text.find(text[-n:], 0, len(text) - 1)
            if start >= 0:
                follow = start + n
                return [ord(c) for c in text[follow:follow + self.num_speculative_tokens]]
        return []
