"""Exercise 21 (chapter 21): the Q4_1 block dequantizer, graded against gguf-py's."""
from __future__ import annotations

import functools

NUMBER = 21
CHAPTER = "21-quantization.md"
TITLE = "dequantize_q4_1: GGUF's Q4_1 blocks back to float32 weights"
TARGETS = ["nanopaged.quantization.gguf:dequantize_q4_1"]
TASK = """
Write dequantize_q4_1(qweight) -> float32 [n, k]: the rows of a Q4_1 matrix as a GGUF
file stores them (uint8 [n, k / 32 * 20]) widened back to weights. Each row is k / 32
blocks of 20 bytes, one per 32 weights: d (fp16, bytes 0-1), m (fp16, bytes 2-3) and 16
bytes of 4-bit q, where the low nibble of byte i is weight i and the high nibble weight
i + 16 of the block; w = q * d + m. The checks compare your values with the `gguf`
package's reference (gguf.quants.dequantize) bit for bit, on random blocks and edge
cases (d = 0, a negative m, subnormal fp16 scales), then run the default model
(SmolLM2-135M's Q4_1 file, quantization="gguf") through the PyTorch reference backend,
which widens every projection with your function before its matmul, and compare its
greedy tokens with the engine's own.
"""
HINT = """
Reshape to blocks first: qweight.reshape(n, -1, 20) is [n, k / 32, 20]. The fp16
scalars: blocks[..., 0:2].contiguous().view(torch.float16) is [n, k / 32, 1]; widen it
with .float() before any arithmetic (gguf-py does: d.astype(np.float32)). The nibbles:
byte & 0xF and byte >> 4, each [n, k / 32, 16]; put the low ones first, then the high
ones (torch.cat along the last dim): that is weights 0..15 then 16..31, NOT 0, 16, 1,
17, ... . Then q.float() * d + m, in that order (a multiply, then an add: float32 rounds
after each), and reshape to [n, k].
"""


def _reference(packed):
    """gguf.quants.dequantize of uint8 [n, row bytes] as float32 [n, k] (a torch tensor)."""
    import gguf
    import numpy as np
    import torch

    values = gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType.Q4_1)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _blocks(d, m, q):
    """One row of Q4_1 blocks from per-block d, m (floats) and q (32 ints 0..15 each)."""
    import torch

    rows = []
    for dd, mm, qq in zip(d, m, q):
        head = torch.tensor([dd, mm], dtype=torch.float16).view(torch.uint8)      # d, m: 4 bytes
        qq = torch.tensor(qq, dtype=torch.uint8)
        rows.append(torch.cat((head, qq[:16] | (qq[16:] << 4))))
    return torch.cat(rows)[None]                                               # [1, blocks * 20]


def _compare(packed, what: str) -> None:
    """Raise AssertionError naming the first weight that differs from gguf-py's, with a
    guess at why (the nibble order, m forgotten)."""
    import torch

    from nanopaged.quantization.gguf import dequantize_q4_1

    want = _reference(packed)
    got = dequantize_q4_1(packed.clone())
    n, k = want.shape
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == (n, k) and got.dtype == torch.float32, (
        f"{what}: uint8 {list(packed.shape)} must give float32 {[n, k]}, you returned "
        f"{getattr(got, 'dtype', type(got).__name__)} {list(getattr(got, 'shape', []))}")
    same = got.view(torch.int32) == want.view(torch.int32)                    # bits, so NaN == NaN too
    if bool(same.all()):
        return
    row, col = (int(i) for i in (~same).nonzero()[0])
    block, i = divmod(col, 32)
    raw = packed[row, block * 20:(block + 1) * 20]
    d, m = (float(raw[a:a + 2].view(torch.float16)) for a in (0, 2))
    byte = int(raw[4 + i % 16])
    q = byte & 0xF if i < 16 else byte >> 4
    why = ""
    blocks = packed.reshape(n, -1, 20)                                        # what the usual slips give
    d_all, m_all = (blocks[..., a:a + 2].contiguous().view(torch.float16).float() for a in (0, 2))
    nibbles = blocks[..., 4:]
    in_order = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1).float()        # [n, k / 32, 32]
    interleaved = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(n, -1, 32).float()
    if torch.equal(got, (interleaved * d_all + m_all).reshape(n, k)):
        why = (" Your weights come out in the order 0, 16, 1, 17, ...: byte i holds weight i in its LOW "
               "nibble and weight i + 16 in its HIGH nibble (all the low nibbles first, then the high ones).")
    elif torch.equal(got, (in_order * d_all).reshape(n, k)):
        why = " Your values are q * d without the block's minimum: add m (bytes 2-3, fp16)."
    elif torch.equal(got, (torch.cat((nibbles >> 4, nibbles & 0xF), dim=-1).float() * d_all + m_all).reshape(n, k)):
        why = " The halves are swapped: the LOW nibbles are weights 0..15, the high ones 16..31."
    raise AssertionError(
        f"{what}: row {row}, weight {col} (block {block}, weight {i} of it) is {got[row, col].item()!r}, "
        f"gguf-py's is {want[row, col].item()!r} (the block's d = {d!r}, m = {m!r}, q = {q}: byte {4 + i % 16} "
        f"of the block is {byte:#04x}).{why}")


def check_a_hand_made_block():
    """one block: d = 0.5, m = -1, the weights' q are 0..15 then 15..0: w = q * d + m, low nibbles first"""
    q = list(range(16)) + list(range(15, -1, -1))
    _compare(_blocks([0.5], [-1.0], [q]), "the block d=0.5, m=-1, q=0..15,15..0")


def check_random_blocks_bit_for_bit():
    """random blocks (6 rows of 8 blocks, every fp16 d and m of normal size): gguf-py's values, bit for bit"""
    import torch

    g = torch.Generator().manual_seed(21)
    packed = torch.randint(0, 256, (6, 8 * 20), dtype=torch.uint8, generator=g)
    blocks = packed.view(6, 8, 20)
    scales = (torch.randn(6, 8, 2, generator=g) * torch.tensor([0.02, 0.3])).half()   # d, m (signed)
    blocks[..., 0:4] = scales.view(torch.uint8)
    _compare(packed, "random rows [6, 256]")


def check_edge_cases():
    """d = 0 (every weight is m), negative and zero m, subnormal fp16 d and m, the largest fp16 d: still gguf-py's bits"""
    q = [[(7 * j + 3 * (j // 16) + b) % 16 for j in range(32)] for b in range(6)]     # weight j, j + 16 differ
    tiny = 2.0 ** -24                                          # the smallest subnormal fp16
    d = [0.0, 0.25, tiny, 3 * tiny, 65504.0, -0.125]
    m = [-3.5, 0.0, -tiny, 5 * tiny, -65504.0, 2.0]
    _compare(_blocks(d, m, q), "blocks with d = 0, subnormal d and m, fp16's largest d")


@functools.cache
def _default_gguf_engine():
    """The default model's Q4_1 file run as shipped, with the PyTorch reference backend
    (quantization/gguf.py's gguf_linear: dequantize, then F.linear), made once per process."""
    from nanopaged import LLM

    return LLM(quantization="gguf", attention_backend="torch", block_size=16, num_gpu_blocks=8,
               preemption_mode="recompute")


def check_engine_runs_on_it():
    """SmolLM2-135M's Q4_1 file (quantization="gguf"), every projection widened by your function: the engine's own greedy tokens"""
    from nanopaged import SamplingParams

    from . import engines_own

    llm = _default_gguf_engine()
    prompt, params = "The capital of France is", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with engines_own():
        want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert list(got.token_ids) == list(want.token_ids), (
        f"{prompt!r} -> with your dequantizer the model says {got.text!r} {list(got.token_ids)}, with the engine's "
        f"{want.text!r} {list(want.token_ids)}")


CHECKS = [check_a_hand_made_block, check_random_blocks_bit_for_bit, check_edge_cases, check_engine_runs_on_it]
