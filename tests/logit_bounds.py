"""How far our float32 logits (and logprobs) can be from transformers' float32 logits of
the same model: both compute the same sums, in different orders (our kernels and
blocking against torch's), so the claim is "close", with a tolerance built from the
reduction lengths and fp32's unit roundoff u = 2^-24. It is a first-order budget, not a
proof: the last reduction's worst case is derived; that the 30 layers before it fit in
what is charged on top is an assumption, which each test checks by quoting its measured
margin (a few percent of the budget or less).

Logits. Each side's logit t is the LM head's dot product of the final normed hidden
state h with the head's row W_t; a dot product of d terms in any order is within
gamma_{d+1} ~ (d + 1) u sum_i |h_i| |W_ti| of the exact one (Higham, "Accuracy and
Stability of Numerical Algorithms", §3.1). The layers before add errors of the same
kind to h, each a sum of at most K terms (K the longest reduction in the model: the
MLP's intermediate size, an attention row's keys, a head's width), carried on through
the norms. The bound charges every term of the head's sum K + 1 roundings instead of
d + 1, every error of one sign, a budget meant to hold the errors h brings with it as
well (assumed, and measured by the tests). Two sides: twice that,
    |ours_t - theirs_t| <= 2 (K + 1) u sum_i |h_i| |W_ti|.

Logprobs. log_softmax shifts every logit of a row by the same logsumexp, which moves by
at most the row's largest logit difference: a logprob moves by at most twice it. Each
side's log_softmax rounds too: x_j = l_j - max (u R, R the row's range), exp (2 u
relative, 1 ulp), the sum of V terms (V - 1 roundings), log (u ln V), and the final
subtraction (u |lp| <= u (R + ln V)): per side at most (V + 3 R + 2 + 2 ln V) u.

Tensor parallel against tp = 1 (our model both sides, tp_logits_bound): only the sums a
row-parallel layer splits add in another order. tp = 1 rounds each of their K products
at most K times (gamma_K), a rank K / tp times in its partial sum and tp - 1 more in the
all-reduce (gamma_{K/tp + tp - 1}): apart by (gamma_K + gamma_{K/tp + tp - 1}) S. The
head (column-parallel, the same dot products) adds no difference of its own; charging
that bound on the head's S = sum_i |h_i| |W_ti|, with K the longest split sum, leaves it
all for the differences h brings from the layers before (the same budget, and the same
assumption, as above).
"""
from __future__ import annotations

import math

import torch
from error_bounds import FP32_U as U     # float32's unit roundoff


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): a sum whose every product is rounded at most n
    times on its way is within gamma_n sum |a_i b_i| of the exact sum, in any order."""
    return n * U / (1 - n * U)


def longest_reduction(config, seq_len: int) -> int:
    """K: the most terms any one sum of the model adds, over a sequence of seq_len tokens."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return max(config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim, seq_len)


def logits_bound(hf, tokens: list[int], k: int | None = None) -> torch.Tensor:
    """float64 [len(tokens), V]: 2 (K + 1) u sum_i |h_i| |W_ti| for every position of
    `tokens` run through transformers' float32 model `hf` (K: longest_reduction unless
    given)."""
    k = longest_reduction(hf.config, len(tokens)) if k is None else k
    with torch.no_grad():
        h = hf.model(torch.tensor([tokens])).last_hidden_state[0]
    w = hf.get_output_embeddings().weight
    return 2 * (k + 1) * U * (h.double().abs() @ w.double().abs().T)


def head_sums(model, tokens: list[int], head_weight: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, logits), [len(tokens), V]: S = sum_i |h_i| |W_ti| in float64, h our model's
    final normed hidden state at every position of `tokens` (one prefill), W the head's
    weight (its fp32 values; by default the head's or, tied, the embedding's `weight`);
    and the model's logits there."""
    from conftest import paged_logits

    hidden, compute_logits = [], model.compute_logits
    model.compute_logits = lambda h: (hidden.append(h), compute_logits(h))[1]
    try:
        with torch.inference_mode():
            logits = paged_logits(model, tokens, 16, len(tokens))
    finally:
        del model.compute_logits
    if head_weight is None:
        head_weight = (model.embed_tokens if model.lm_head is None else model.lm_head).weight
    w = head_weight[:model.config.vocab_size]
    return torch.cat(hidden).double().abs() @ w.double().abs().T, logits


def tp_logits_bound(sums: torch.Tensor, k: int, tp: int) -> torch.Tensor:
    """float64: how far logits at tensor parallel size tp can be from tp = 1's, given the
    head's sums S (head_sums) and K the longest sum a row-parallel layer splits."""
    return (gamma(k) + gamma(-(-k // tp) + tp - 1)) * sums          # a rank's share: ceil(K / tp)


def logprobs_bound(logit_bound: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """float64 [rows, 1]: how far two float32 log_softmax rows can be apart when their
    logits (`logits` one side's, [rows, V]) are apart by at most `logit_bound` [rows, V]:
    twice the row's largest logit bound, plus each side's own log_softmax roundings."""
    v = logits.shape[-1]
    spread = (logits.amax(-1, keepdim=True) - logits.amin(-1, keepdim=True)).double()
    return 2 * logit_bound.amax(-1, keepdim=True) + 2 * (v + 3 * spread + 2 + 2 * math.log(v)) * U


def transformers_logprob_bounds(hf, tokens: list[int]) -> torch.Tensor:
    """float64 [len(tokens)]: at each position, how far our float32 logprobs of the next
    token (any of them) can be from transformers' log_softmax of its float32 logits
    (logits_bound, then logprobs_bound)."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0]
    return logprobs_bound(logits_bound(hf, tokens), logits)[:, 0]


def beam_score_bound(hf, tokens: list[int], prompt_len: int, cum_logprob: float) -> float:
    """How far our beam's cum_logprob / n (n = len(tokens) - prompt_len generated tokens)
    can be from transformers' sequences_scores of it (length_penalty 1): each step's
    logprob within its row's transformers_logprob_bounds; we add them in float64,
    transformers in a float32 running sum (n - 1 roundings, each partial sum at most
    |cum|) and divides once (u |score|): (sum_j b_j + (n + 1) u |cum|) / n."""
    n = len(tokens) - prompt_len
    steps = transformers_logprob_bounds(hf, tokens)[prompt_len - 1:len(tokens) - 1]
    return (steps.sum().item() + (n + 1) * U * abs(cum_logprob)) / n
