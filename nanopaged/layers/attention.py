"""Paged attention in plain PyTorch: write K/V by slot_mapping, read them by block table.

This is the reference backend: the CUDA and C++ kernels of kernels/ are checked against
it (backends.py chooses between them).
The KV cache of one layer is two tensors of shape

    [num_blocks, block_size, num_kv_heads, head_size]      (key_cache, value_cache)

so a token's K (or V) for all heads lives at one *slot*, and slot = block * block_size +
offset: viewing the cache as [num_blocks * block_size, num_kv_heads, head_size] makes
slot the row index. Two operations use it (PagedAttention paper §4.1; vLLM
`reshape_and_cache` and `paged_attention_v1`, `vllm/attention/`):

1. write: the K/V computed this step go to their slots, `cache[slot_mapping] = k`.
2. read: a sequence's keys are the rows of its physical blocks in block-table order,
   `key_cache[block_table]` -> [num_blocks_of_seq * block_size, ...], of which the
   first seq_len are real. Attention then is ordinary causal attention over those.

Prefill and decode are the same read; they differ only in how many queries a sequence
brings. Decode (one query per sequence) is batched over all sequences with a length mask;
prefill (many queries) runs per sequence and, within it, one KV block of queries at a
time, with a causal mask offset by the tokens that are already cached (a prefix-cache
hit or an earlier chunk).

Everything the op needs comes in an AttentionMetadata built by the model runner: no
global state. GQA (num_heads a multiple of num_kv_heads) is handled by SDPA's enable_gqa.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..utils.math_utils import cdiv


@dataclass
class AttentionMetadata:
    """Where every token of this step's batch reads and writes in the KV cache.

    The batch is flattened: the new tokens of all sequences one after another, decode
    sequences (1 new token) first, then prefill sequences.

    Attributes:
        slot_mapping: [num_tokens] int64, the KV slot each new token writes.
        block_tables: [num_seqs, max_blocks] int64, physical block ids per sequence,
            padded with 0 (padding is never read: seq_lens masks it).
        seq_lens: [num_seqs] int64, tokens each sequence attends to after this step
            (cached + new), i.e. its context length.
        query_start_loc: [num_seqs + 1] int64, offsets of each sequence's new tokens
            in the flat batch (vLLM's name); query_lens = diff of it.
        num_decodes: the first num_decodes sequences are decodes: one new token, an
            output token (a prompt's last token alone is still prefill).
        seq_lens_list, query_start_loc_list: host copies (python ints) for the loops.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int
    seq_lens_list: list[int]
    query_start_loc_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V in their slots (vLLM's reshape_and_cache).

    key, value: [num_tokens, num_kv_heads, head_size]; caches: [num_blocks, block_size,
    num_kv_heads, head_size], same dtype; slot_mapping: [num_tokens] int64.
    """
    num_kv_heads, head_size = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of this step's queries over each sequence's cached K/V.

    Args:
        query: [num_tokens, num_heads, head_size].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], already
            holding this step's K/V (call write_kv first).
        meta: the batch layout (see AttentionMetadata).
        scale: softmax scale, usually head_size ** -0.5.

    Returns:
        [num_tokens, num_heads, head_size], same dtype as query.
    """
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(query[:nd], key_cache, value_cache,
                           meta.block_tables[:nd], meta.seq_lens[:nd], scale)
    prefill_attention(out, query, key_cache, value_cache, meta, scale)
    return out


def prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
    """Fill the prefill rows of `out` (sequences num_decodes and on), one sequence at a time.

    Same arguments as paged_attention; `out` is [num_tokens, num_heads, head_size] and
    its decode rows are left alone. The compiled backends use this too (backends.py).
    """
    qsl = meta.query_start_loc_list
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens_list[i]
        out[start:end] = _prefill(query[start:end], key_cache, value_cache,
                                  meta.block_tables[i], seq_len, scale)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., n] block ids -> [..., n * block_size, num_kv_heads, head_size] K or V rows.

    This copy is the price of paging in plain PyTorch (a kernel reads the blocks in
    place). index_select on whole blocks is a row memcpy, faster than advanced indexing.
    """
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    rows = torch.index_select(cache.view(num_blocks, -1), 0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_size)


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, all sequences at once, padding masked by seq_lens.

    query: [num_seqs, num_heads, head_size]; key_cache, value_cache: [num_blocks,
    block_size, num_kv_heads, head_size]; block_tables: [num_seqs, max_blocks] int64,
    padded with 0 (only the first ceil(seq_lens[s] / block_size) entries of row s are
    real); seq_lens: [num_seqs] int64. Query head h of sequence s attends to the first
    seq_lens[s] keys of its blocks, in block-table order, of KV head
    h // (num_heads // num_kv_heads): softmax(scale * q . k) @ v. Returns
    [num_seqs, num_heads, head_size]. (This version gathers the blocks into a copy and
    makes one SDPA call with a length mask; the kernels walk the block table instead,
    kernels/cpu/attention.cpp.)
    """
    k = _gather(key_cache, block_tables).transpose(1, 2)    # [S, kv_heads, T, head]
    v = _gather(value_cache, block_tables).transpose(1, 2)
    max_len = k.shape[2]
    mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]   # [S, T]
    o = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                       scale=scale, enable_gqa=True)   # [S, heads, 1, head]
    return o.squeeze(2)


def _prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """Queries of one sequence (its last q_len positions) over its first seq_len keys.

    The queries go to SDPA one KV block at a time: the queries of positions in block b
    attend, in one call, to keys 0 .. (end of their block). Why not one call for all of
    them: SDPA's rounding depends on how many queries it is given, and a prefix-cache hit
    computes only the blocks after the hit. Split at block boundaries, the hit path
    (queries of the last blocks) makes exactly the calls the miss path makes for those
    blocks, so both write the same K/V and sample the same tokens
    (tests/model/test_c36_bf16_prefix_hit.py checks it). The split calls cost no time we
    could tell from noise.
    """
    q_len = query.shape[0]
    block_size = key_cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    k = _gather(key_cache, block_table[:num_blocks])[:seq_len].transpose(0, 1)   # [kv_heads, L, head]
    v = _gather(value_cache, block_table[:num_blocks])[:seq_len].transpose(0, 1)
    q = query.transpose(0, 1)                                                     # [heads, q_len, head]
    out = torch.empty_like(q)
    first = seq_len - q_len                    # position of query 0
    start = first
    while start < seq_len:
        end = min((start // block_size + 1) * block_size, seq_len)
        pos_q = torch.arange(start, end, device=query.device)
        mask = torch.arange(end, device=query.device)[None, :] <= pos_q[:, None]   # [end - start, end]
        out[:, start - first:end - first] = F.scaled_dot_product_attention(
            q[:, start - first:end - first], k[:, :end], v[:, :end], attn_mask=mask, scale=scale,
            enable_gqa=True)
        start = end
    return out.transpose(0, 1)
