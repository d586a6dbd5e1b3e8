"""How far two float computations of one quantity can be apart when they add in different
orders: first-order worst-case bounds, from the length of each reduction and the unit
roundoff u of the dtype it runs in (Higham, "Accuracy and Stability of Numerical
Algorithms", ch. 3: a sum of n terms, in any order, is within gamma_n ~ n u sum |terms| of
the exact sum). The "close" claims of the kernel tests take their tolerances from here;
the "equal" claims need none.

u: float32 2^-24, bfloat16 2^-8, float16 2^-11 (p significant bits: 2^-p, half the distance
between neighbours at 1).
"""
from __future__ import annotations

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FP32_U = UNIT_ROUNDOFF[torch.float32]
# fast_exp (the kernel's Cephes polynomial: 8 multiply-adds, each fused or not as the
# compiler contracts it for the build's instruction set) is within 2 ulp (4 u) of libm's
# expf, itself within 1 ulp: 6 u of exp, charged as 8 u a side, so two builds' (or a
# build's and libm's) exps of one value are within 16 u. Below -87.3 it returns 0 where
# exp is under 1.2e-38: nothing next to the max-subtracted softmax's largest term, 1.
EXP_ROUNDINGS = 16


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - want| <= bound elementwise (in float64), or say by how much it is not."""
    err = (got.double() - want.double()).abs()
    assert got.shape == want.shape and (err <= bound).all(), (
        f"{what + ': ' if what else ''}apart by up to {err.max().item():.3g}, "
        f"{(err / bound).max().item():.3g} times the bound")


def matmul_bound(x: torch.Tensor, w: torch.Tensor, roundings: int) -> torch.Tensor:
    """float64 [m, n]: the most fp32 arithmetic can move x [m, k] @ w [n, k]^T from its
    exact value when every term of an output's sum passes at most `roundings` roundings
    (its product, its scales, each addition of the chain that adds it in): roundings * u *
    sum_i |x_i| |w_i|. A plain fp32 dot product of k terms in any order: k + 1; two such
    computations are apart by at most twice that."""
    return roundings * FP32_U * (x.abs().double() @ w.abs().double().T)


def rounded_apart(bound: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bound on |a - b| after each of a and b is rounded once to `dtype`, given `bound`
    on their fp32 difference and `value` their exact value: each rounding adds at most
    u_dtype of its own magnitude, and |a|, |b| <= |value| + bound (so `bound` must also
    bound each side's distance from `value`, as every caller's does: a two-sided bound
    is at least each side's own). Below float16's smallest normal (6.1e-5) its spacing
    stops shrinking: a rounding there moves a value by up to 2^-25, absolutely."""
    if dtype == torch.float32:
        return bound
    subnormal = 2.0 ** -25 if dtype == torch.float16 else 0.0
    return bound + 2 * UNIT_ROUNDOFF[dtype] * (value.abs().double() + bound) + 2 * subnormal


def attention_bound(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound), float64 [num_heads, head_size]: one query row's attention computed
    exactly, and how far two fp32 computations of it that add in different orders (and
    compute exp to within 8 u each) can be apart, after rounding to out_dtype.

    query [num_heads, head_size], keys and values [n, num_heads, head_size] (the row's
    keys, KV heads already repeated for GQA), all holding values exact in fp32 (bf16 and
    fp16 widen exactly). Both sides compute in fp32:
    - each logit l_j = scale q . k_j sums d = head_size products: apart by at most
      E = 2 (d + 1) u scale max_j sum_i |q_i k_ji|;
    - p_j = exp(l_j - max): the argument rounds once more (u |l_j - max|, at most u R
      with R the logits' range, twice for two sides) and exp itself (EXP_ROUNDINGS u):
      a relative difference of at most E + (2 R + EXP_ROUNDINGS) u;
    - w_j = p_j / sum p: the sum of n terms (n + 1 roundings a side) and the division;
      the weights' relative difference is at most twice p's, plus 2 (n + 2) u;
    - out = sum_j w_j v_j over the n keys (n + 1 roundings a side): apart by at most
      (rel_w + 2 (n + 1) u) sum_j w_j |v_j|.
    """
    q, k, v = query.double(), keys.double(), values.double()
    n, d = k.shape[0], q.shape[-1]
    logits = scale * torch.einsum("hd,nhd->hn", q, k)                       # [heads, n]
    w = torch.softmax(logits, dim=-1)
    exact = torch.einsum("hn,nhd->hd", w, v)
    e = 2 * (d + 1) * FP32_U * scale * torch.einsum("hd,nhd->hn", q.abs(), k.abs()).amax(-1)   # [heads]
    spread = (logits.amax(-1) - logits.amin(-1))
    rel_p = e + (2 * spread + EXP_ROUNDINGS) * FP32_U
    rel_w = 2 * rel_p + 2 * (n + 2) * FP32_U
    bound = (rel_w + 2 * (n + 1) * FP32_U)[:, None] * torch.einsum("hn,nhd->hd", w, v.abs())
    return exact, rounded_apart(bound, exact, out_dtype)


def paged_attention_bound(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                          out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound), float64 [num_tokens, num_heads, head_size]: attention_bound for
    every query row of a paged batch (layers/attention.py's layout: sequence s brings the
    rows query_start_loc[s]:[s + 1], the last of its seq_lens[s] positions, each attending
    causally to the keys up to its own position, read through block_tables)."""
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    exact = torch.empty(query.shape, dtype=torch.float64)
    bound = torch.empty(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[s, :-(-seq_len // block_size)]
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].repeat_interleave(group, dim=1)
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].repeat_interleave(group, dim=1)
        rows = starts[s + 1] - starts[s]
        for r in range(rows):
            seen = seq_len - rows + r + 1                      # causal: keys up to this row's position
            exact[starts[s] + r], bound[starts[s] + r] = attention_bound(
                query[starts[s] + r], keys[:seen], values[:seen], scale, out_dtype)
    return exact, bound


def rms_norm_bound(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound), float64 like x [rows, h]: RMSNorm as transformers computes it (the
    mean of squares in fp32, the normalized row rounded to x's dtype, times the weight,
    rounded again), two computations apart. The mean of h squares, all positive: h + 1
    roundings, relative; the square root and the division 3 more, x * inv one: each side's
    normalized row within (h / 2 + 6) u of it (the root halves the sum's error), twice
    that apart, then each rounding to the dtype (rounded_apart) on both sides."""
    xd, wd = x.double(), weight.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    bound = rounded_apart(2 * (x.shape[-1] / 2 + 6) * FP32_U * normed.abs(), normed, x.dtype)
    return normed * wd, rounded_apart(bound * wd.abs() + 2 * FP32_U * (normed * wd).abs(), normed * wd, x.dtype)


def silu_and_mul_bound(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound), float64 [rows, d]: silu(gate) * up, gate_up [rows, 2d], the
    activation rounded to the dtype, then the product rounded again. exp within
    EXP_ROUNDINGS / 2 u a side, then 1 + e, the division, the product (3 more): the
    activation 2 (EXP_ROUNDINGS / 2 + 3) u apart, and a rounding a side for the product."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = gate * torch.sigmoid(gate)
    bound = rounded_apart(2 * (EXP_ROUNDINGS / 2 + 3) * FP32_U * act.abs(), act, gate_up.dtype)
    return act * up, rounded_apart(bound * up.abs() + 2 * FP32_U * (act * up).abs(), act * up, gate_up.dtype)


def rope_bound(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 like x [rows, heads, head_size]: how far two computations of GPT-NeoX RoPE
    (x1 c - x2 s, x2 c' + x1 s', each product and the sum rounded to the dtype, or fused
    into one FMA in fp32) can be apart; cos, sin [rows, head_size] for each row's
    position. Two roundings of |x1 c| + |x2 s| a side in fp32 (the products and the sum,
    or the FMA's one), and in bf16 or fp16 a rounding of each product and of the sum."""
    half = x.shape[-1] // 2
    xd, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    x1, x2 = xd[..., :half], xd[..., half:]
    first, second = x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]
    size = torch.cat([x1.abs() * c[..., :half].abs() + x2.abs() * s[..., :half].abs(),
                      x2.abs() * c[..., half:].abs() + x1.abs() * s[..., half:].abs()], dim=-1)
    u = max(UNIT_ROUNDOFF[x.dtype], FP32_U)
    return rounded_apart(2 * 2 * u * size, torch.cat([first, second], dim=-1), x.dtype)
