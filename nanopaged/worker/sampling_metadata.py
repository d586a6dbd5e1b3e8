"""SamplingMetadata: one step's sampling settings, as the tensors the Sampler reads.

Built once a step from the rows' SamplingParams (and, for rows with a penalty, their
token counts, which the InputBatch keeps: input_batch.py), so that each stage of the
Sampler is a few tensor ops over the whole batch, and a stage no row uses is skipped.

vLLM: `vllm/v1/sample/metadata.py` (SamplingMetadata), built by
`vllm/v1/worker/gpu_input_batch.py` (InputBatch._make_sampling_metadata).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors (row i = entry i of `build`).

    Attributes:
        output_token_ids: the row's generated tokens so far, the caller's live lists
            (not copies); read for min_tokens and multi-token bad words.
        temperature: [num_rows] float32 (1.0 on greedy rows, which never use it).
        top_p: [num_rows] float32 in (0, 1].
        top_k: [num_rows] int64, vocab_size where there is no top-k filter.
        greedy: [num_rows] bool.
        all_greedy, any_greedy, any_top_p, any_top_k: shortcuts that skip whole stages.
        generators: row index -> the request's torch.Generator (seeded requests).
        min_p: [num_rows] float32, 0 where off; None when no sampled row uses it.
        num_logprobs: per row, SamplingParams.logprobs (None = no logprobs).
        logprobs_rows: rows whose num_logprobs is not None.
        allowed_token_ids_mask: [num_rows, vocab] bool, True = not allowed; or None.
        bad_words_single: (rows, token ids) [n] int64 each: single-token bad words; or None.
        bad_words_multi: (row, token ids) for bad words of two tokens or more.
        min_tokens: (row, min_tokens, ids to hold back) for rows with min_tokens > 0.
        logit_bias: (rows, token ids, biases) [n] int64, int64, float32; or None.
        penalty_rows: rows whose params need token counts (any penalty on).
        repetition_penalty, frequency_penalty, presence_penalty: [len(penalty_rows)]
            float32; None when penalty_rows is empty.
        prompt_mask: [len(penalty_rows), vocab] bool, token in the row's prompt; None
            when penalty_rows is empty.
        output_counts: [len(penalty_rows), vocab] int32, times the row generated the
            token; None when penalty_rows is empty.
    """

    output_token_ids: list[list[int]]
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    any_top_p: bool
    any_top_k: bool
    generators: dict[int, torch.Generator]
    min_p: torch.Tensor | None
    num_logprobs: list[int | None]
    logprobs_rows: list[int]
    allowed_token_ids_mask: torch.Tensor | None
    bad_words_single: tuple[torch.Tensor, torch.Tensor] | None
    bad_words_multi: list[tuple[int, list[int]]]
    min_tokens: list[tuple[int, int, list[int]]]
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    penalty_rows: list[int]
    repetition_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    output_counts: torch.Tensor | None

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              output_token_ids: list[list[int]], vocab_size: int, device: torch.device,
              prompt_mask: torch.Tensor | None = None,
              output_counts: torch.Tensor | None = None) -> "SamplingMetadata":
        """One row per entry of the three (parallel) lists; generators[i] is None for an
        unseeded row. prompt_mask / output_counts: the penalty rows' token counts
        ([num_penalty_rows, vocab], bool / int32, in row order), needed when a row has a
        penalty (InputBatch.make_sampling_metadata gathers them). O(rows) Python plus the
        size of the rows' token-id settings: a greedy batch pays little for the fields
        it does not use.

        Raises:
            ValueError: lists of different lengths, a row with bad_words whose params
                did not go through SamplingParams.update_from_tokenizer, or penalty rows
                without token counts of their shape.
        """
        n = len(params)
        if not len(generators) == len(output_token_ids) == n:
            raise ValueError("SamplingMetadata.build: params, generators and "
                             "output_token_ids must have one entry per row")

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        # One pass over the rows; a row that uses none of the optional stages only
        # contributes its temperature, top-p, top-k and greedy flag.
        temperature, top_k, greedy, min_p = [], [], [], []
        logprobs_rows, penalty_rows, min_tokens, multi = [], [], [], []
        allowed_rows, allowed_ids, single_rows, single_ids, bias = [], [], [], [], []
        for i, p in enumerate(params):
            g = p.greedy
            greedy.append(g)
            temperature.append(1.0 if g else p.temperature)
            top_k.append(vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size))
            min_p.append(0.0 if g else p.min_p)
            if p.logprobs is not None:
                logprobs_rows.append(i)
            if p.needs_token_counts:
                penalty_rows.append(i)
            if p.min_tokens > 0 and p._all_stop_token_ids:
                min_tokens.append((i, p.min_tokens, sorted(p._all_stop_token_ids)))
            if p.allowed_token_ids:
                allowed_rows.append(i)
                allowed_ids.extend(p.allowed_token_ids)
            if p.logit_bias:
                bias.extend((i, t, b) for t, b in p.logit_bias.items())
            if p.bad_words:
                if p._bad_words_token_ids is None:
                    raise ValueError(f"row {i} has bad_words {p.bad_words!r} but no token ids: "
                                     "call SamplingParams.update_from_tokenizer first")
                for ids in p._bad_words_token_ids:
                    if len(ids) == 1:
                        single_rows.append(i)
                        single_ids.append(ids[0])
                    else:
                        multi.append((i, ids))

        allowed_mask = None
        if allowed_rows:
            allowed_mask = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
            allowed_mask[allowed_rows] = True
            rows = [i for i in allowed_rows for _ in params[i].allowed_token_ids]
            allowed_mask[tensor(rows, torch.int64), tensor(allowed_ids, torch.int64)] = False

        if penalty_rows:
            shape = (len(penalty_rows), vocab_size)
            if prompt_mask is None or output_counts is None or \
                    tuple(prompt_mask.shape) != shape or tuple(output_counts.shape) != shape:
                raise ValueError(f"rows {penalty_rows} have penalties but no token counts of shape {shape} "
                                 "(InputBatch.make_sampling_metadata gathers them)")
        else:
            prompt_mask = output_counts = None

        def penalty(name):
            return tensor([getattr(params[i], name) for i in penalty_rows], torch.float32) \
                if penalty_rows else None

        return cls(
            output_token_ids=list(output_token_ids),      # the list of lists; each stays live
            temperature=tensor(temperature, torch.float32),
            top_p=tensor([p.top_p for p in params], torch.float32),
            top_k=tensor(top_k, torch.int64),
            greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy), any_greedy=any(greedy),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            any_top_k=any(k < vocab_size and not g for k, g in zip(top_k, greedy)),
            generators={i: g for i, g in enumerate(generators) if g is not None},
            min_p=tensor(min_p, torch.float32) if any(min_p) else None,
            num_logprobs=[p.logprobs for p in params],
            logprobs_rows=logprobs_rows,
            allowed_token_ids_mask=allowed_mask,
            bad_words_single=(tensor(single_rows, torch.int64), tensor(single_ids, torch.int64))
            if single_rows else None,
            bad_words_multi=multi,
            min_tokens=min_tokens,
            logit_bias=(tensor([r for r, _, _ in bias], torch.int64),
                        tensor([t for _, t, _ in bias], torch.int64),
                        tensor([b for _, _, b in bias], torch.float32)) if bias else None,
            penalty_rows=penalty_rows,
            repetition_penalty=penalty("repetition_penalty"),
            frequency_penalty=penalty("frequency_penalty"),
            presence_penalty=penalty("presence_penalty"),
            prompt_mask=prompt_mask,
            output_counts=output_counts,
        )
