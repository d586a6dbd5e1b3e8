"""Exercise 12 (chapter 12): the decode loop the kernels run, in PyTorch."""
from __future__ import annotations

NUMBER = 12
CHAPTER = "12-kernels.md"
TITLE = "Paged attention decode: walk each sequence's block table"
TARGETS = ["nanopaged.layers.attention:_decode"]
TASK = """
Write the decode attention of the PyTorch backend: one query per sequence, attending to
that sequence's keys and values where they lie in the block pool. Write it the way the
kernels do (kernels/cpu/attention.cpp, attention_kernel; v2 of
kernels/dev/paged_attention_cpu_dev.cpp): for each sequence, walk its block table a
block at a time; token t of block b is row t of key_cache[block_tables[s][b]], and only
the first seq_len tokens count (the last block may be partly filled, the table is
padded). 1. logits = scale * q . k for every head and key (GQA: query head h reads KV
head h // (num_heads // num_kv_heads)); 2. softmax over them (max first); 3. out = the
probabilities times the V rows, summed. Loop over sequences and blocks in Python, and
let torch do each block's heads and head_size at once. (The engine's own version
gathers the blocks into a copy and calls SDPA: shorter, and what the kernels avoid.)
The engine with the PyTorch attention backend runs your function for every decode row.
"""
HINT = """
For sequence s with n = int(seq_lens[s]) tokens, blocks b = 0 .. ceil(n / block_size) - 1:
    rows = min(block_size, n - b * block_size)
    k = key_cache[block_tables[s, b], :rows]        # [rows, num_kv_heads, head_size]
GQA: k.repeat_interleave(num_heads // num_kv_heads, dim=1) makes it [rows, num_heads,
head_size]; logits of the block: scale * (k * query[s]).sum(-1) -> [rows, num_heads].
Collect the blocks' logits (torch.cat on dim 0), softmax over dim 0, then sum p[:, :,
None] * v over the keys, V gathered the same way. Build the output with torch.stack
or write into torch.empty_like(query).
"""


def _attend(q, k, v, scale):
    """The definition, for one sequence: q [heads, d], k and v [n, kv_heads, d]."""
    import torch

    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [n, heads, d]
    p = torch.softmax(scale * torch.einsum("hd,nhd->nh", q, k), dim=0)
    return torch.einsum("nh,nhd->hd", p, v)


def _case(seq_lens, tables, num_blocks=8, block_size=4, num_heads=2, num_kv_heads=2, head_size=8, seed=0):
    """Random query and caches, and the expected output, computed from each sequence's
    first seq_len rows of its blocks in table order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=g)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    want = torch.stack([_attend(query[s], key_cache[tables[s]].flatten(0, 1)[:n],
                                value_cache[tables[s]].flatten(0, 1)[:n], 0.3) for s, n in enumerate(seq_lens)])
    return (query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int64), 0.3), want


def _compare(args, want, what):
    import torch

    from nanopaged.layers.attention import _decode

    got = _decode(*args)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
        f"{what}: expected a [num_seqs, num_heads, head_size] = {list(want.shape)} tensor, you returned "
        f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    diff = (got - want).abs().nan_to_num(float("inf"))
    err = diff.max().item()
    if err >= 1e-4:
        s, h = divmod(int(diff.amax(-1).argmax()), want.shape[1])
        show = lambda x: [round(v, 4) for v in x[s, h, :3].tolist()]
        raise AssertionError(f"{what}: your output is off by up to {err:.3g}; sequence {s}, head {h}: you "
                             f"returned {show(got)}..., expected {show(want)}...")


def check_one_sequence():
    """one sequence in one block: out = softmax(scale * q . k) @ v over its seq_len keys"""
    import torch

    from nanopaged.layers.attention import _decode

    key_cache = torch.zeros(2, 4, 1, 2)
    value_cache = torch.zeros(2, 4, 1, 2)
    key_cache[1, :3, 0] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    value_cache[1, :3, 0] = torch.tensor([[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]])
    query = torch.tensor([[[2.0, 0.0]]])                    # [1 sequence, 1 head, head_size 2]
    got = _decode(query, key_cache, value_cache, torch.tensor([[1]]), torch.tensor([3]), 1.0)
    p = torch.softmax(torch.tensor([2.0, 0.0, 0.0]), 0)
    want = (p[:, None] * value_cache[1, :3, 0]).sum(0)
    assert got.shape == (1, 1, 2), f"expected shape [1, 1, 2], you returned {list(got.shape)}"
    assert torch.allclose(got[0, 0], want, atol=1e-5), (
        f"block 1 holds keys [1, 0], [0, 1], [0, 0] and values [10, 0], [0, 10], [5, 5]; query [2, 0], scale 1: "
        f"logits [2, 0, 0], out = softmax(logits) @ v = {[round(x, 4) for x in want.tolist()]}; you returned "
        f"{[round(x, 4) for x in got[0, 0].tolist()]}")


def check_block_table_order():
    """keys and values are read through the block table: scattered blocks, in the table's order"""
    args, want = _case([10], [[5, 2, 7]])
    _compare(args, want, "one sequence of 10 tokens in blocks 5, 2, 7 (block size 4)")


def check_only_seq_len_keys():
    """only the first seq_len keys count: the empty slots of the last block and the table's padding are never used"""
    args, want = _case([6, 1], [[3, 4], [6]])
    query, key_cache, value_cache, tables, lens, scale = args
    for cache in (key_cache, value_cache):          # garbage where nothing was written
        cache[4, 2:] = 1e4
        cache[6, 1:] = 1e4
        cache[0] = -1e4                             # block 0: what the padding of row 1 points at
    _compare(args, want, "sequences of 6 tokens (blocks 3, 4: block 4 half full) and 1 token (block 6), "
                         "huge values in the unwritten slots and in block 0 (the table's padding)")


def check_batch_with_gqa():
    """a batch of sequences of different lengths, and grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads)"""
    args, want = _case([1, 7, 12], [[2], [7, 1], [4, 0, 5]], num_heads=6, num_kv_heads=2, seed=1)
    _compare(args, want, "3 sequences of 1, 7 and 12 tokens, 6 query heads over 2 KV heads")


def check_engine_runs_on_it():
    """the engine decodes with your function (PyTorch attention backend): same tokens on the tiny model"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    prompts = [[1, 2, 3, 4, 5], list(range(20, 33)), [7, 8]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 12)]
    same_as_engines_own(prompts, params)
    same_as_engines_own(prompts, params, block_size=3)


CHECKS = [check_one_sequence, check_block_table_order, check_only_seq_len_keys, check_batch_with_gqa,
          check_engine_runs_on_it]
