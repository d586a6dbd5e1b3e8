"""Rejection sampler: verify draft tokens against the target model in one step.

Speculative decoding lets a cheap proposer (ngram_proposer.py, a small draft model)
guess the next k tokens d_1..d_k of a sequence. The target model then runs one
forward over [last token, d_1..d_k] and returns k + 1 rows of logits: row j is the
target's distribution for the token after the first j drafts. This module decides,
in the sampling stage of that step, how many drafts to keep and which token follows.
It replaces the Sampler's draw for sequences with drafts; the logits have already
gone through `Sampler.apply_logits_processors` (masks, bias, penalties).

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", section 2.3; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", algorithm 2), with p_j the target distribution of row j
and q_j the proposer's distribution for d_{j+1}:

    for j = 0..k-1:
        accept d_{j+1} with probability min(1, p_j(d) / q_j(d))
        on rejection: output a draw from normalize(max(p_j - q_j, 0)) and stop
    all k accepted: output a "bonus" draw from p_k

Each output token is then distributed exactly as a token sampled from the target
alone, whatever q is; a good q only makes acceptance likelier (the acceptance rate
of one step is sum_x min(p_j(x), q_j(x))). A proposer without probabilities (n-gram
lookup) is deterministic: q_j = one-hot(d_{j+1}), so d is accepted with probability
p_j(d) and a rejection draws from p_j with d removed. Greedy rows need no random
numbers: keep d_{j+1} while it is the argmax of row j, then output that argmax.

p_j is exactly what `Sampler.sample` draws from for the row (min_p, temperature,
top-k, top-p, softmax), computed over the full vocabulary by `target_probs`.

vLLM: `vllm/v1/sample/rejection_sampler.py` (RejectionSampler, batched in Triton
kernels). Here a Python loop runs over the sequences (k is small) and every step of
it is a tensor op over the vocabulary.
"""
from __future__ import annotations

import torch

from ..worker.sampler import apply_top_k_top_p, min_p_floor
from ..worker.sampling_metadata import SamplingMetadata


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row draws from, over the full vocabulary.

    logits: [num_rows, vocab] float32, already through `Sampler.apply_logits_processors`
    (not modified). Returns [num_rows, vocab] float32 rows that sum to 1: the min_p
    floor on the raw logits, division by the temperature, top-k and top-p, softmax.
    This is the distribution `Sampler.sample` draws a random row's token from (the
    Sampler works on a truncated candidate list; the result is the same, except
    that a full-vocabulary top-k keeps every token tied with the k-th).
    Greedy rows get a distribution too, but it means nothing: they take the argmax.
    """
    if meta.min_p is not None:
        # Same floor as the Sampler: min_p acts on the temperature-scaled probabilities,
        # and logit_max + T * log(min_p) says that on the raw logits.
        floor = min_p_floor(logits, meta.min_p, meta.temperature)           # [rows, 1]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    logits = logits / meta.temperature.unsqueeze(-1)
    if meta.any_top_k or meta.any_top_p:
        logits = apply_top_k_top_p(logits, meta.top_k if meta.any_top_k else None,
                                   meta.top_p if meta.any_top_p else None)
    return logits.softmax(dim=-1)


def _draw(weights: torch.Tensor, u: torch.Tensor) -> int:
    """Inverse-CDF draw of one token from unnormalised weights [vocab] float32 >= 0
    (positive sum), with u a uniform number in [0, 1) (0-dim tensor), as the Sampler
    draws: the token where the cumulative weight first exceeds u * total."""
    cdf = weights.cumsum(dim=-1)                                            # [vocab]
    pick = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    # u * total can round up to total; then fall back to the last token with
    # weight, never to a token the distribution excludes.
    return min(pick, int(weights.nonzero()[-1]))


class RejectionSampler:
    """Verifies draft tokens (see the module docstring). Stateless: a step's logits,
    drafts and SamplingMetadata in, each sequence's new tokens out."""

    def __call__(self, logits: torch.Tensor, draft_token_ids: list[list[int]],
                 meta: SamplingMetadata, generator: torch.Generator,
                 draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
        """Accept or reject each sequence's drafts and add one token after them.

        Args:
            logits: [num_rows, vocab] float32 (upcast if not), processed by
                `Sampler.apply_logits_processors`; not modified. Sequence i owns the
                len(draft_token_ids[i]) + 1 rows starting at off_i, one sequence after
                another (off_0 = 0); row off_i + j scores the token after j drafts.
            draft_token_ids: per sequence, its k_i >= 0 draft token ids.
            meta: SamplingMetadata with one row per logits row. A sequence's rows
                share its params, so its first row's greedy flag and generator are used.
            generator: the engine's torch.Generator, for rows without their own.
            draft_probs: None (every proposal deterministic), or per sequence None
                (deterministic: q = one-hot of the draft) or a [k_i, vocab] float32
                tensor, row j = the distribution d_{j+1} was drawn from.

        Returns:
            Per sequence, the accepted drafts followed by one more token: 1 to k_i + 1
            token ids. A sequence with no drafts gets one token, drawn as the Sampler
            would.

        Raises:
            ValueError: the rows do not add up to logits.shape[0] (or meta's row
                count), a draft id is outside the vocabulary, or draft_probs has the
                wrong length or a tensor of the wrong shape.
        """
        logits = logits.float()
        num_rows, vocab = logits.shape
        self._check(num_rows, vocab, draft_token_ids, meta, draft_probs)
        argmax = logits.argmax(dim=-1).tolist() if meta.any_greedy else None
        probs = None if meta.all_greedy else target_probs(logits, meta)    # [num_rows, vocab]
        outputs, off = [], 0
        for i, drafts in enumerate(draft_token_ids):
            k = len(drafts)
            if bool(meta.greedy[off]):
                outputs.append(self._greedy(drafts, argmax[off:off + k + 1]))
            else:
                q = draft_probs[i] if draft_probs is not None else None
                gen = meta.generators.get(off, generator)
                outputs.append(self._random(drafts, probs[off:off + k + 1], q, gen))
            off += k + 1
        return outputs

    @staticmethod
    def _greedy(drafts: list[int], targets: list[int]) -> list[int]:
        """Keep drafts while they equal the argmax of their row ([k + 1] ints), then
        output the argmax of the first row that disagrees (or of the last row)."""
        out = []
        for d, t in zip(drafts, targets):
            if d != t:
                break
            out.append(d)
        out.append(targets[len(out)])
        return out

    @staticmethod
    def _random(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None,
                gen: torch.Generator) -> list[int]:
        """The random rule for one sequence. p: [k + 1, vocab] target probabilities;
        q: [k, vocab] draft probabilities, or None for one-hot proposals."""
        k = len(drafts)
        # Always k + 1 uniform numbers: k acceptance tests and one final draw (the
        # recovered or the bonus token). Drawing a fixed count keeps a seeded
        # request's stream in step however many drafts it accepts.
        u = torch.rand(k + 1, generator=gen, device=p.device)
        d = torch.tensor(drafts, dtype=torch.int64, device=p.device)       # [k]
        rows = torch.arange(k, device=p.device)
        p_d = p[rows, d]                                                   # [k]
        q_d = q[rows, d] if q is not None else torch.ones_like(p_d)
        # u < p / q, written without the division (q(d) = 0 accepts if p(d) > 0).
        accepted = (u[:k] * q_d < p_d).tolist()
        n = accepted.index(False) if False in accepted else k
        if n == k:
            return drafts + [_draw(p[k], u[k])]                            # bonus token
        if q is not None:
            residual = (p[n] - q[n]).clamp_(min=0.0)
        else:
            residual = p[n].clone()
            residual[drafts[n]] = 0.0
        # A rejection means p_n(d) < q_n(d), so p_n - q_n has positive mass in exact
        # arithmetic; if rounding left none (p_n and q_n equal to float precision),
        # drawing from p_n is the same distribution.
        if not bool((residual > 0).any()):
            residual = p[n]
        return drafts[:n] + [_draw(residual, u[k])]

    @staticmethod
    def _check(num_rows: int, vocab: int, draft_token_ids: list[list[int]],
               meta: SamplingMetadata, draft_probs: list[torch.Tensor | None] | None) -> None:
        """Raise ValueError unless the arguments describe the same rows."""
        needed = sum(len(d) + 1 for d in draft_token_ids)
        if needed != num_rows:
            raise ValueError(f"draft_token_ids: {len(draft_token_ids)} sequences need {needed} "
                             f"logits rows (k_i + 1 each), logits has {num_rows}")
        if meta.greedy.shape[0] != num_rows:
            raise ValueError(f"meta: {meta.greedy.shape[0]} rows, logits has {num_rows}")
        for i, drafts in enumerate(draft_token_ids):
            bad = [t for t in drafts if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"draft_token_ids[{i}]: ids {bad} outside the vocabulary [0, {vocab})")
        if draft_probs is None:
            return
        if len(draft_probs) != len(draft_token_ids):
            raise ValueError(f"draft_probs: {len(draft_probs)} entries, "
                             f"draft_token_ids has {len(draft_token_ids)}")
        for i, (q, drafts) in enumerate(zip(draft_probs, draft_token_ids)):
            if q is not None and tuple(q.shape) != (len(drafts), vocab):
                raise ValueError(f"draft_probs[{i}]: shape {tuple(q.shape)}, "
                                 f"expected {(len(drafts), vocab)}")
