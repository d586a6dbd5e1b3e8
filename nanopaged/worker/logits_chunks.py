"""Logits in bounded chunks of rows: no step holds more than max_logits_bytes of them.

A step samples one row per running sequence, one per fork of a fresh n > 1 request
(they all sample from their parent's last hidden row), and k + 1 per sequence that
verifies k drafts; a request with prompt logprobs adds one row per prompt position the
step computes. Each row is vocab_size float32 logits (SmolLM2: 49152 x 4 B = 192 KiB),
and the sampler makes a few more of that size per row (sorted values and ids, the
softmax, penalty counts). Computed all at once, a step's logits grow with what requests
ask for: `n = 10**6` once asked the core for 196 GB, and it died.

So the runner (model_runner.py) takes the rows in chunks of at most `max_rows`
(EngineConfig.max_logits_bytes // (vocab_size x 4); by default max_num_seqs rows, so a
batch of one-row requests is one chunk): a chunk's logits are computed, masked and
sampled, and only tokens and logprobs are kept before the next chunk starts. A verifying
sequence's k + 1 rows stay in one chunk (the rejection sampler reads them together).

Chunking changes no bit of a row's logits: the lm_head's matmul adds each row's
products in one order whatever rows are beside it (the CPU kernels' `linear`, chapter
05, "Batch invariance"; tests/worker/test_batch_invariance.py), and the sampler
processes each row from its own settings. Seeded rows draw from their own generators,
so their tokens do not change; rows without a seed share the engine's generator and,
as in any batch, draw in an order the batch decides.
vLLM has no such chunks: its front end splits n > 1 into n requests, each counted
against max_num_seqs, so its sampled rows are bounded by the batch.
"""
from __future__ import annotations

import torch

from ..messages import Logprobs
from .sampler import apply_grammar_bitmask, compute_logprobs

LOGIT_BYTES = 4                 # logits are float32


def max_logits_rows(max_logits_bytes: int | None, vocab_size: int) -> int | None:
    """Rows of fp32 logits that fit in max_logits_bytes (at least 1); None: no bound."""
    return None if max_logits_bytes is None else max(1, max_logits_bytes // (vocab_size * LOGIT_BYTES))


def row_chunks(items: list, max_rows: int | None, sizes: list[int] | None = None) -> list[list]:
    """Split items (of `sizes` rows each, default 1; an item is never split) into
    consecutive chunks of at most max_rows rows; an item larger than max_rows is a chunk
    alone. None = one chunk. No items, no chunks."""
    chunks: list[list] = []
    rows = 0
    for item, size in zip(items, sizes or [1] * len(items)):
        if not chunks or (max_rows is not None and rows + size > max_rows):
            chunks.append([])
            rows = 0
        chunks[-1].append(item)
        rows += size
    return chunks


def compute_logits_rows(model, hidden: torch.Tensor, logits_indices: torch.Tensor, rows: list[int],
                        masks: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 logits [len(rows), vocab] of the step's sampled rows `rows` (positions in
    logits_indices, which map them to hidden rows), with the grammar masks of those
    rows applied (masks: (the sampled row of each mask row, bitmask [num_masks, words]))."""
    logits = model.compute_logits(hidden[logits_indices[rows]]).float()
    if masks is not None:
        where = {r: j for j, r in enumerate(rows)}
        picked = [(where[r], m) for m, r in enumerate(masks[0]) if r in where]
        if picked:
            apply_grammar_bitmask(logits, [j for j, _ in picked], masks[1][[m for _, m in picked]])
    return logits


def chunked_logprobs(model, hidden: torch.Tensor, token_ids: list[int], k: int,
                     max_rows: int | None) -> Logprobs:
    """sampler.compute_logprobs of the logits of hidden rows [n, hidden_size] for the
    tokens they predict (token_ids, n of them) and their top k, max_rows rows at a time
    (prompt logprobs: one row per prompt position the step computes)."""
    step = max_rows or len(token_ids)
    parts = []
    for a in range(0, len(token_ids), step):
        logits = model.compute_logits(hidden[a:a + step]).float()              # [<= step, vocab]
        parts.append(compute_logprobs(logits, torch.tensor(token_ids[a:a + step], device=hidden.device), k))
    return Logprobs([r for p in parts for r in p.token_ids], [r for p in parts for r in p.logprobs],
                    [r for p in parts for r in p.ranks])
