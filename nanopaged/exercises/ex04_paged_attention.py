"""Exercise 4 (chapter 04): write K/V by slot_mapping, read them by block table."""
from __future__ import annotations

NUMBER = 4
CHAPTER = "04-model-runner-and-attention.md"
TITLE = "Paged attention: write_kv and the decode path"
TARGETS = ["nanopaged.layers.attention:write_kv",
           "nanopaged.layers.attention:_decode"]
TASK = """
Write the two halves of paged attention in plain PyTorch (PagedAttention §4.1; vLLM's
reshape_and_cache and paged_attention_v1): `write_kv` stores this step's K and V of
every token in its slot of the block pool, and `_decode` computes, for a batch of
sequences with one new query each, attention over that sequence's cached keys and
values, which lie scattered over the blocks its block table names. The engine (with the
PyTorch reference backend) writes every K/V and runs every decode with your code.
"""
HINT = """
write_kv: a slot is a row of the cache viewed as [num_blocks * block_size, num_kv_heads,
head_size] (`key_cache.view(-1, num_kv_heads, head_size)`); write into that view in place
(index_copy_ or indexing assignment), so the cache tensor itself changes.

_decode: `_gather(key_cache, block_tables)` gives each sequence's K rows in block-table
order, [num_seqs, max_blocks * block_size, num_kv_heads, head_size]; only the first
seq_lens[i] rows of sequence i are real, the others are padding or stale slots and must be
masked out (a boolean mask to F.scaled_dot_product_attention, or -inf scores before the
softmax). GQA: query head h reads KV head h // (num_heads // num_kv_heads)
(`enable_gqa=True`, or repeat_interleave the K/V heads). The query is [num_seqs,
num_heads, head_size]; return the same shape.
"""


def _pool(seed=0, num_blocks=6, block_size=4, kv_heads=2, head=8):
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, block_size, kv_heads, head, generator=g),
            torch.randn(num_blocks, block_size, kv_heads, head, generator=g), g)


def check_write_kv_slots():
    """write_kv puts token t's K and V in slot slot_mapping[t] (block slot // block_size, offset slot % block_size), nowhere else"""
    import torch

    from nanopaged.layers.attention import write_kv

    key_cache, value_cache, g = _pool()
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots = [5, 8, 9, 10, 23, 0]
    key, value = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    write_kv(key, value, key_cache, value_cache, torch.tensor(slots))
    for t, slot in enumerate(slots):
        b, o = divmod(slot, 4)
        for name, cache, new in (("key", key_cache, key), ("value", value_cache, value)):
            assert torch.equal(cache[b, o], new[t]), (
                f"token {t}'s {name} should be at slot {slot} = block {b}, offset {o} of the {name} cache; it is not")
    untouched = torch.ones(6, 4, dtype=torch.bool)
    for slot in slots:
        untouched[divmod(slot, 4)] = False
    for name, cache, before in (("key", key_cache, before_k), ("value", value_cache, before_v)):
        changed = [(b, o) for b, o in untouched.nonzero().tolist() if not torch.equal(cache[b, o], before[b, o])]
        assert not changed, f"slots {slots} written, but the {name} cache also changed at (block, offset) {changed}"


def _decode_case(seed=0):
    """Three sequences decoding one token, their K/V in scattered blocks: (query, caches,
    block tables, seq_lens)."""
    import torch

    key_cache, value_cache, g = _pool(seed, num_blocks=8)
    tables = torch.tensor([[4, 1, 0], [3, 6, 7], [2, 0, 0]])     # padded with block 0
    seq_lens = torch.tensor([5, 11, 3])
    query = torch.randn(3, 4, 8, generator=g)                     # 4 query heads, 2 KV heads
    return query, key_cache, value_cache, tables, seq_lens


def _reference_decode(query, key_cache, value_cache, tables, seq_lens, scale):
    """Plain attention, one sequence and one head at a time, over contiguous K/V."""
    import torch

    out = torch.empty_like(query)
    group = query.shape[1] // key_cache.shape[2]
    for i, n in enumerate(seq_lens.tolist()):
        k = torch.cat([key_cache[b] for b in tables[i].tolist()])[:n]      # [n, kv_heads, head]
        v = torch.cat([value_cache[b] for b in tables[i].tolist()])[:n]
        for h in range(query.shape[1]):
            weights = torch.softmax(k[:, h // group] @ query[i, h] * scale, dim=0)
            out[i, h] = weights @ v[:, h // group]
    return out


def check_decode_matches_plain_attention():
    """_decode equals plain attention over each sequence's first seq_len keys, read in block-table order (GQA included)"""
    import torch

    from nanopaged.layers.attention import _decode

    query, key_cache, value_cache, tables, seq_lens = _decode_case()
    got = _decode(query, key_cache, value_cache, tables, seq_lens, 8 ** -0.5)
    want = _reference_decode(query, key_cache, value_cache, tables, seq_lens, 8 ** -0.5)
    assert tuple(got.shape) == tuple(want.shape), f"output shape {tuple(got.shape)}, want {tuple(want.shape)}"
    for i in range(3):
        for h in range(4):
            assert torch.allclose(got[i, h], want[i, h], atol=1e-5), (
                f"sequence {i} (block table {tables[i].tolist()}, seq_len {seq_lens[i].item()}), query head {h}: "
                f"your output differs from plain attention by {(got[i, h] - want[i, h]).abs().max().item():.3g}")


def check_decode_ignores_slots_past_seq_len():
    """_decode ignores every slot past seq_len: garbage in them (stale tokens, padding blocks) changes nothing"""
    import torch

    from nanopaged.layers.attention import _decode

    query, key_cache, value_cache, tables, seq_lens = _decode_case(seed=1)
    clean = _decode(query, key_cache, value_cache, tables, seq_lens, 8 ** -0.5)
    real = {(tables[i][p // 4].item(), p % 4) for i, n in enumerate(seq_lens.tolist()) for p in range(n)}
    for b in range(key_cache.shape[0]):                  # poison every slot no sequence may read
        for o in range(4):
            if (b, o) not in real:
                key_cache[b, o], value_cache[b, o] = 50.0, 1e4
    got = _decode(query, key_cache, value_cache, tables, seq_lens, 8 ** -0.5)
    worst = (got - clean).abs().amax(dim=(1, 2))
    assert torch.all(worst < 1e-5), (
        f"after filling the unused slots (past each seq_len) with large numbers, the outputs of the sequences "
        f"moved by {[round(w, 3) for w in worst.tolist()]}: a key past seq_len must get zero weight")


def check_engine_runs_on_it():
    """the engine writes every K/V and runs every decode on your code: same tokens (a third prompt joins while the others decode)"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 7, 12)]
    same_as_engines_own([list(range(1, 10)), [5, 6], list(range(30, 44))], params, max_num_seqs=2)


CHECKS = [check_write_kv_slots, check_decode_matches_plain_attention, check_decode_ignores_slots_past_seq_len,
          check_engine_runs_on_it]
