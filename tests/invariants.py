"""The block-accounting invariants of ../shared/DESIGN.md, checked against a live engine."""
from __future__ import annotations

from collections import Counter

from nanopaged.block_manager import hash_block_tokens
from nanopaged.sequence import SequenceStatus


def check_block_invariants(engine) -> None:
    """Raise AssertionError if the engine's KV pool bookkeeping is inconsistent."""
    bm, sched = engine.block_manager, engine.scheduler
    held, held_cpu = Counter(), Counter()
    for group in list(sched.waiting) + list(sched.running) + list(sched.swapped):
        for seq in group.seqs:
            table = seq.block_table
            (held_cpu if table.on_cpu else held).update(table.block_ids)
            assert table.on_cpu == (seq.status == SequenceStatus.SWAPPED) or not table.block_ids, seq
            if seq.status == SequenceStatus.RUNNING:
                # L tokens with K/V in the pool hold exactly ceil(L / block_size) blocks
                assert table.num_tokens == seq.num_computed_tokens, (seq, table)
                assert len(table) == -(-seq.num_computed_tokens // bm.block_size), (seq, table)
            elif seq.status == SequenceStatus.SWAPPED:
                assert table.num_tokens == seq.num_computed_tokens, (seq, table)
                assert len(table) == -(-seq.num_computed_tokens // bm.block_size), (seq, table)
            elif seq.status == SequenceStatus.WAITING:
                assert len(table) == 0 and seq.num_computed_tokens == 0, (seq, table)
            else:
                assert len(table) == 0, (seq, table)
    # every prefix-cache entry names a block whose stored tokens are the ones hashed; a
    # sequence holding a named block at index i has exactly those tokens there
    for h, block_id in bm.cached_blocks.items():
        assert bm.block_hash[block_id] == h and bm.block_token_ids[block_id] is not None, block_id
    for group in sched.running:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            parent = None
            for i, block_id in enumerate(seq.block_table.block_ids):
                if (i + 1) * bm.block_size > seq.num_computed_tokens:
                    break
                tokens = seq.token_ids_slice(i * bm.block_size, (i + 1) * bm.block_size)
                parent = hash_block_tokens(parent, tokens)
                if bm.block_hash[block_id] is not None:
                    assert bm.block_hash[block_id] == parent, (seq, i, block_id)
                    assert bm.block_token_ids[block_id] == tuple(tokens), (seq, i, block_id)
    for block_id in range(bm.num_gpu_blocks):
        assert bm.ref_count[block_id] == held[block_id], (block_id, bm.ref_count[block_id], held[block_id])
        assert (bm.ref_count[block_id] == 0) == (block_id in bm.free_block_ids), block_id
    assert len(bm.free_block_ids) + sum(1 for c in bm.ref_count if c > 0) == bm.num_gpu_blocks
    # the CPU swap pool, the same way (it can have millions of tiny blocks: stay O(held))
    for block_id, holders in held_cpu.items():
        assert bm.cpu_ref_count[block_id] == holders, ("cpu", block_id)
    assert len(bm.free_cpu_block_ids) + len(held_cpu) == bm.num_cpu_blocks
    if bm.num_cpu_blocks <= 4096:
        free = set(bm.free_cpu_block_ids)
        assert len(free) == len(bm.free_cpu_block_ids) and not free & set(held_cpu)


def run_checked(engine, max_steps: int = 10_000) -> dict[str, object]:
    """step() until idle, checking invariants after every step; returns final outputs by id."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_block_invariants(engine)
    else:
        raise AssertionError("engine did not finish within max_steps")
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.block_manager.num_gpu_blocks
    assert engine.block_manager.get_num_free_cpu_blocks() == engine.block_manager.num_cpu_blocks
    return final
