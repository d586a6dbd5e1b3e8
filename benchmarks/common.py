"""What the sections share: the throughput workload, the two ways of running it
(nanopaged continuously batched, transformers in static batches), the CPU features the
driver prints first, and the decode-attention inputs and timer of the kernels section
(chapter 12 times its kernel versions with the same two)."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch


def find_peer(explicit: str | None, env: str, local: str) -> str | None:
    """A peer's program (llama.cpp's interpreter or server): the flag's path, else $env's,
    else `local` (relative to the checkout) if it exists, else None."""
    path = explicit or os.environ.get(env)
    if path:
        return path
    candidate = Path(__file__).resolve().parent.parent / local
    return str(candidate) if candidate.is_file() else None


def workload(n: int, vocab: int, seed: int = 0, max_output: int = 128):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    outputs = [rng.randint(32, max_output) for _ in range(n)]
    return prompts, outputs


def run_nanopaged(llm, prompts, out_lens) -> tuple[float, int]:
    from nanopaged import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens)
    return elapsed, tokens


def run_transformers(model, prompts, out_lens, batch_size=16, pad_id=0) -> tuple[float, int]:
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], out_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t, sum(out_lens)


def cpu_flags() -> str:
    """The CPU features that decide our speed, as this machine reports them."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":")[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, flags: "
            f"{' '.join(w for w in wanted if w in flags) or 'none of ' + '/'.join(wanted)}")


def seconds_per_call(fn, repeat: int) -> float:
    """Seconds per call of fn(), after one warm-up call (synchronizing on CUDA)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - t) / repeat


def decode_batch(num_seqs, context, num_heads, num_kv_heads, head_size, block_size, dtype, device):
    """Random decode inputs with each sequence's blocks scattered over the pool."""
    from nanopaged.layers.attention import AttentionMetadata
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
    lens = [context] * num_seqs
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
                             block_tables=tables, seq_lens=torch.tensor(lens, device=device),
                             query_start_loc=torch.arange(num_seqs + 1, device=device),
                             num_decodes=num_seqs, seq_lens_list=lens,
                             query_start_loc_list=list(range(num_seqs + 1)))
    return query, key_cache, value_cache, meta
