"""Sampler: turn each sequence's last-position logits into its next token.

Batched over the step's sequences (one row each), each with its own SamplingParams. The
order is vLLM v1's (`vllm/v1/sample/sampler.py`), after the runner has masked the rows
with structured outputs (`apply_grammar_bitmask`, below; chapter 18):

    1. raw logprobs        log_softmax of the model's logits, for rows that want logprobs
    2. logits processors   allowed_token_ids, bad_words, min_tokens (mask to -inf),
                           logit_bias (add)
    3. penalties           repetition (prompt and output), frequency and presence (output)
    4. greedy rows         argmax of the processed logits
    5. other rows          / temperature -> min_p -> top-k -> top-p -> softmax -> draw

A stage no row of the batch uses costs nothing, so an unconstrained greedy batch is one
argmax. Stages 2-3 only ever change a row from that row's own settings and tokens, so a
request's tokens never depend on what else shares the batch (tests/worker/
test_sampler.py::test_c41_penalised_tokens_do_not_depend_on_batch_mates).

The draw is the inverse CDF over each row's candidates (the tokens that survive min_p /
top-k, most likely first): one uniform number u per row, and the token where the
cumulative probability first exceeds u. A request with a seed draws its u from its own
torch.Generator and gets the same tokens whatever else is in the batch; requests without
a seed share the engine's generator (seeded by `LLM(seed=...)`), so a whole run is
reproducible too. vLLM on a GPU uses the "exponential race" instead (argmax(p / E),
E ~ Exp(1) per token: no cumulative sum, but one random number per vocabulary entry).
On a CPU those draws cost more than the rest of sampling (chapter 06); the inverse CDF
costs one draw and one cumsum.

The Sampler holds no per-sequence state: everything it reads arrives in the step's
SamplingMetadata (sampling_metadata.py), the penalty rows' token counts and the seeded
generators included; the worker's InputBatch keeps them between steps (input_batch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..messages import Logprobs
from .sampling_metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """What the Sampler returns for one step.

    Attributes:
        sampled_token_ids: [num_rows] int64, the token chosen for each row.
        logprobs: per row, a one-row Logprobs (the sampled token first, then the row's
            top SamplingParams.logprobs tokens) where logprobs was asked for, else None.
    """

    sampled_token_ids: torch.Tensor
    logprobs: list[Logprobs | None]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> Logprobs:
    """Log-probabilities of `token_ids` and of each row's k most likely tokens.

    logits: [rows, vocab], any float dtype (the log_softmax is computed in float32);
    token_ids: [rows] int64; k >= 0. Returns a Logprobs with `rows` rows: row i holds
    [token_ids[i], top-k ids...] and their log-probabilities (natural log), and
    ranks[i] = 1 + the number of tokens with a strictly larger logprob than token_ids[i].
    """
    return _gather_logprobs(logits.float().log_softmax(dim=-1), token_ids, k)


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> Logprobs:
    """compute_logprobs, from logprobs already computed ([rows, vocab] float32)."""
    token_logprobs = logprobs.gather(-1, token_ids.unsqueeze(-1))          # [rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1                     # [rows]
    ids, values = token_ids.unsqueeze(-1), token_logprobs
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        ids, values = torch.cat([ids, top.indices], dim=-1), torch.cat([values, top.values], dim=-1)
    return Logprobs(ids.tolist(), values.tolist(), ranks.tolist())


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Structured outputs: set to -inf, in place, the logit of every token the grammar
    forbids in the given rows (structured_output/manager.py makes the masks).

    logits: [num_rows, vocab] float32; rows: the logits row of each mask row;
    bitmask: [len(rows), ceil(vocab / 32)] int32 on the logits' device, bit j of word w
    = token 32 * w + j, 1 = allowed (llguidance's layout). Tokens past the mask's width
    are forbidden. Runs before the sampler, so everything after it (logprobs, penalties,
    temperature, top-k/p) sees the masked distribution, as in vLLM's model runner; a
    mask always allows at least one token, so no row is left all -inf by it.
    """
    if not rows:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)    # [len(rows), 32 * words]
    vocab = logits.shape[-1]
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]))
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition_penalty: torch.Tensor, frequency_penalty: torch.Tensor,
                    presence_penalty: torch.Tensor) -> torch.Tensor:
    """The three penalties (vLLM's `apply_penalties`), out of place.

    logits: [rows, vocab] float32; prompt_mask: [rows, vocab] bool (token in the prompt);
    output_counts: [rows, vocab] int32 (times the token was generated); the penalties:
    [rows] float32. Repetition acts on tokens in the prompt or the output, dividing a
    positive logit by the penalty and multiplying a negative one (transformers'
    RepetitionPenaltyLogitsProcessor); frequency subtracts penalty * count and presence
    subtracts penalty once, both counting output tokens only (OpenAI's definition).
    A penalty that no row uses costs no pass over the vocabulary.
    """
    generated = output_counts > 0
    if (repetition_penalty != 1.0).any():
        rep = repetition_penalty.unsqueeze(-1)           # divide, not multiply by 1 / rep:
        penalised = torch.where(logits < 0, logits * rep, logits / rep)   # transformers' bits
        logits = torch.where(prompt_mask | generated, penalised, logits)
    if frequency_penalty.any():
        logits = logits - frequency_penalty.unsqueeze(-1) * output_counts
    if presence_penalty.any():
        logits = logits - presence_penalty.unsqueeze(-1) * generated
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits of tokens whose probability is below min_p times the row's
    largest probability. logits: [rows, vocab] float32; min_p: [rows] float32 in [0, 1]
    (0 keeps the row as it is). The most likely token always survives.
    p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed."""
    return logits.masked_fill(logits < min_p_floor(logits, min_p), float("-inf"))


def min_p_floor(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, 1]: the smallest logit min_p keeps, for logits that are still to be divided by
    `temperature` ([rows], None = already divided): logit_max + temperature * log(min_p)."""
    log_min_p = min_p.log() if temperature is None else temperature * min_p.log()
    return logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Set the logits of tokens outside each row's top-k / top-p set to -inf.

    logits: [num_rows, vocab] float32; top_k: [num_rows] int64 in [1, vocab] or None;
    top_p: [num_rows] float32 in (0, 1] or None. The most likely token always survives,
    so a row never ends up all -inf (no NaN after softmax), even for top_p near 0.
    (The Sampler itself filters its candidate list with `_filter_sorted`; this full-vocab
    form is for reading and for tests.)
    """
    values, order = logits.sort(dim=-1, descending=True)
    values = _filter_sorted(values, top_k, top_p)
    return torch.empty_like(logits).scatter_(-1, order, values)


def _filter_sorted(values: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """top-k and top-p on logits sorted in descending order ([num_rows, num_candidates]
    float32), in place: top-k keeps the k largest (and ties with the k-th); top-p keeps
    the most likely tokens until their mass reaches top_p, i.e. drops a token when the
    tokens more likely than it already hold >= top_p (the first one never is)."""
    if top_k is not None:
        kth = values.gather(-1, (top_k.clamp(max=values.shape[-1]) - 1).unsqueeze(-1))
        values.masked_fill_(values < kth, float("-inf"))
    if top_p is not None:
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        values.masked_fill_(mass_before >= top_p.unsqueeze(-1), float("-inf"))
    return values


class Sampler:
    """Samples one token per row (see the module docstring). Stateless: a step's
    logits and its SamplingMetadata in, tokens out (vLLM v1's Sampler)."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 generator: torch.Generator) -> SamplerOutput:
        """logits: [num_rows, vocab] (upcast to float32; not modified) -> SamplerOutput.

        `generator` is the engine's, used by rows without their own. Logprobs are vLLM's
        default logprobs_mode "raw_logprobs": the log_softmax of the logits as the model
        produced them, before any processor, penalty, temperature or filter.
        """
        logits = logits.float()
        raw_logprobs = None
        if meta.logprobs_rows:
            raw_logprobs = logits[meta.logprobs_rows].log_softmax(dim=-1)   # [num_lp_rows, vocab]
        logits = self.apply_logits_processors(logits, meta)
        sampled = self.sample(logits, meta, generator)
        logprobs: list[Logprobs | None] = [None] * logits.shape[0]
        if raw_logprobs is not None:
            rows = meta.logprobs_rows
            k = max(meta.num_logprobs[i] for i in rows)
            gathered = _gather_logprobs(raw_logprobs, sampled[rows], k)
            for j, i in enumerate(rows):
                keep = meta.num_logprobs[i] + 1
                logprobs[i] = Logprobs([gathered.token_ids[j][:keep]],
                                       [gathered.logprobs[j][:keep]], [gathered.ranks[j]])
        return SamplerOutput(sampled, logprobs)

    def apply_logits_processors(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Stages 2 and 3: the masks, logit_bias and penalties. logits: [num_rows, vocab]
        float32, returned as is when no row uses any of them, else as a new tensor."""
        banned_rows, banned_ids = self._banned_by_output(meta)
        masks = (meta.allowed_token_ids_mask is not None or meta.bad_words_single is not None
                 or banned_rows or meta.logit_bias is not None)
        if not masks and not meta.penalty_rows:
            return logits
        if masks or len(meta.penalty_rows) < logits.shape[0]:
            logits = logits.clone()              # the in-place edits below stay ours
        if meta.allowed_token_ids_mask is not None:
            logits.masked_fill_(meta.allowed_token_ids_mask, float("-inf"))
        if meta.bad_words_single is not None:
            logits[meta.bad_words_single] = float("-inf")
        if banned_rows:                          # multi-token bad words and min_tokens
            logits[torch.tensor(banned_rows, device=logits.device),
                   torch.tensor(banned_ids, device=logits.device)] = float("-inf")
        if meta.logit_bias is not None:
            rows, ids, bias = meta.logit_bias
            logits.index_put_((rows, ids), bias, accumulate=True)
        if meta.penalty_rows:
            args = (meta.prompt_mask, meta.output_counts, meta.repetition_penalty,
                    meta.frequency_penalty, meta.presence_penalty)
            if len(meta.penalty_rows) == logits.shape[0]:      # every row: no gather, no scatter
                return apply_penalties(logits, *args)
            rows = torch.tensor(meta.penalty_rows, device=logits.device)
            logits[rows] = apply_penalties(logits[rows], *args)
        return logits

    @staticmethod
    def _banned_by_output(meta: SamplingMetadata) -> tuple[list[int], list[int]]:
        """(rows, token ids) that the rows' outputs so far forbid: the last token of a
        multi-token bad word whose other tokens end the output (vLLM looks at output
        tokens only), and the stop ids of a row still short of min_tokens."""
        rows, ids = [], []
        for i, word in meta.bad_words_multi:
            out, prefix = meta.output_token_ids[i], word[:-1]
            if len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix:
                rows.append(i)
                ids.append(word[-1])
        for i, min_tokens, stop_ids in meta.min_tokens:
            if len(meta.output_token_ids[i]) < min_tokens:
                rows += [i] * len(stop_ids)
                ids += stop_ids
        return rows, ids

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               generator: torch.Generator) -> torch.Tensor:
        """Stages 4 and 5: processed logits [num_rows, vocab] float32 -> [num_rows] int64."""
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        greedy_tokens = logits.argmax(dim=-1) if meta.any_greedy else None
        # The candidates, most likely first. Dividing by the temperature keeps the order,
        # so they are picked before it, on the raw logits. After min_p (or top-k) most
        # rows keep a few tokens, and a top-k of that many is far cheaper than sorting
        # the whole vocabulary.
        vocab, floor = logits.shape[-1], None
        num_candidates = vocab
        if meta.min_p is not None:
            floor = min_p_floor(logits, meta.min_p, meta.temperature)          # [rows, 1]
            num_candidates = int((logits >= floor).sum(dim=-1).max())
        if meta.any_top_k:
            num_candidates = min(num_candidates, int(meta.top_k.max()))
        if num_candidates < vocab:
            values, ids = logits.topk(num_candidates, dim=-1)
        else:
            values, ids = logits.sort(dim=-1, descending=True)
        if floor is not None:
            values.masked_fill_(values < floor, float("-inf"))
        values = values / meta.temperature.unsqueeze(-1)
        if meta.any_top_k or meta.any_top_p:
            values = _filter_sorted(values, meta.top_k if meta.any_top_k else None,
                                    meta.top_p if meta.any_top_p else None)
        # Inverse CDF: one uniform number u per row picks the candidate where the
        # cumulative probability first exceeds u. A seeded row draws its u from its own
        # generator, so its tokens do not depend on the rest of the batch.
        cdf = values.softmax(dim=-1).cumsum(dim=-1)                        # [num_rows, num_candidates]
        u = torch.rand(cdf.shape[0], generator=generator, device=cdf.device)
        for row, gen in meta.generators.items():
            u[row] = torch.rand((), generator=gen, device=cdf.device)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp_(max=cdf.shape[-1] - 1)
        sampled = ids.gather(-1, pick).squeeze(-1)
        return sampled if greedy_tokens is None else torch.where(meta.greedy, greedy_tokens, sampled)
