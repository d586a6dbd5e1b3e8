"""Sampler: turn each sequence's last-position logits into its next token.

Batched over the step's sequences, each with its own SamplingParams:

    greedy rows (temperature 0)  -> argmax
    other rows                   -> logits / temperature -> top-k -> top-p -> softmax -> draw

The draw uses the "exponential race" that vLLM uses (`vllm/v1/sample/ops/topk_topp_sampler.py`):
argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i, and needs no
cumulative sums. Its randomness is one Exp(1) vector per row, so a request with a seed
fills its row from its own torch.Generator and gets the same tokens whatever else is in
the batch; requests without a seed share the engine's generator (seeded by
`LLM(seed=...)`), so a whole run is reproducible too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .messages import Logprobs
from .sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors.

    Attributes:
        temperature: [num_rows] float32 (1.0 on greedy rows, which never use it).
        top_p: [num_rows] float32 in (0, 1].
        top_k: [num_rows] int64, vocab_size where there is no top-k filter.
        greedy: [num_rows] bool.
        all_greedy, any_top_p, any_top_k: shortcuts that skip whole stages.
        generators: row index -> the request's torch.Generator (seeded requests).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    generators: dict[int, torch.Generator]

    params: list = None

    @classmethod
    def build(cls, seq_ids, params: list[SamplingParams], generators: list[torch.Generator | None],
              output_token_ids, vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """One row per entry of `params` (and of `generators`, None for unseeded rows)."""
        greedy = [p.greedy for p in params]
        top_k = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            any_top_k=any(k < vocab_size and not g for k, g in zip(top_k, greedy)),
            generators={i: g for i, g in enumerate(generators) if g is not None}, params=params,
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Set the logits of tokens outside each row's top-k / top-p set to -inf.

    logits: [num_rows, vocab] float32; top_k: [num_rows] int64 in [1, vocab] or None;
    top_p: [num_rows] float32 in (0, 1] or None. The most likely token always survives,
    so a row never ends up all -inf (no NaN after softmax), even for top_p near 0.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)     # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        # the k-th largest value is at index vocab - k; ties with it are kept
        kth = sorted_logits.gather(-1, (vocab - top_k).unsqueeze(-1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(-1)      # the low tail holding <= 1 - top_p of the mass
        drop[:, -1] = False                          # keep the argmax whatever happens
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs: list


def compute_logprobs(logits, token_ids, k):
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(k, dim=-1) if k else None
    tok_lp = lp.gather(-1, token_ids[:, None])
    ranks = (lp > tok_lp).sum(-1) + 1
    ids = token_ids[:, None] if not k else torch.cat([token_ids[:, None], top.indices], 1)
    vals = tok_lp if not k else torch.cat([tok_lp, top.values], 1)
    return Logprobs(ids.tolist(), vals.tolist(), ranks.tolist())


class Sampler:
    """Samples one token per row. See the module docstring for the method."""

    def __init__(self, vocab_size=None, device=None):
        pass

    def add_sequence(self, *a):
        pass

    def append_tokens(self, *a):
        pass

    def remove_sequence(self, *a):
        pass

    def __call__(self, logits, meta, generator):
        tokens = self._sample(logits, meta, generator)
        lps = [compute_logprobs(logits[i:i + 1], tokens[i:i + 1], p.logprobs) if getattr(p, "logprobs", None) is not None else None
               for i, p in enumerate(meta.params)]
        return SamplerOutput(tokens, lps)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata,
                 generator: torch.Generator) -> torch.Tensor:
        """logits: [num_rows, vocab] float32 -> token ids [num_rows] int64.

        `generator` is the engine's, used by rows without their own.
        """
        greedy_tokens = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_tokens
        logits = logits / meta.temperature.unsqueeze(-1)
        if meta.any_top_k or meta.any_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k if meta.any_top_k else None,
                                       meta.top_p if meta.any_top_p else None)
        probs = logits.softmax(dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator)
        for row, gen in meta.generators.items():     # seeded rows: their own stream
            race[row].exponential_(generator=gen)
        sampled = (probs / race).argmax(dim=-1)
        return torch.where(meta.greedy, greedy_tokens, sampled)
