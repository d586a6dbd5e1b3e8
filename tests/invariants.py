"""The block-accounting invariants, checked against a live engine (run_checked: after every step):

- every block is free (perhaps cached) or held, and its ref_count equals the number of
  block tables that hold it; free + held = all blocks, in each pool (none is lost);
- a sequence of L tokens in the device pool holds exactly ceil(L / block_size) blocks;
- a prefix-cache entry names a block whose stored token ids are the ones it was hashed from;
- after the last request finishes or is aborted, every block is free.

With async scheduling a step may be in flight when they are checked. Two checks differ
then, legitimately: num_computed_tokens already counts the positions that step computes
(the last of which may hold a placeholder, a token not sampled yet), so only the known
tokens are hashed; and the runner's record (read once its forward is done) may run ahead
of the scheduler's by the tokens that step sampled.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import wait

from nanopaged import events as ev
from nanopaged.core.block_manager import hash_block_tokens
from nanopaged.core.sequence import SequenceStatus


def check_block_invariants(engine) -> None:
    """Raise AssertionError if the engine's KV pool bookkeeping is inconsistent."""
    bm, sched = engine.block_manager, engine.scheduler
    held, held_cpu = Counter(), Counter()
    for group in list(sched.waiting) + list(sched.running) + list(sched.swapped):
        for seq in group.seqs:
            table = seq.block_table
            (held_cpu if seq.is_swapped else held).update(table.block_ids)
            if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                # L tokens with K/V in the pool hold exactly ceil(L / block_size) blocks
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
            parent = seq.cache_salt                                    # None: the plain hashes
            known = min(seq.num_computed_tokens, seq.num_tokens)      # async: placeholders
            for i, block_id in enumerate(seq.block_table.block_ids):
                if (i + 1) * bm.block_size > known:
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
    check_runner_state(engine)
    # the CPU swap pool, the same way (it can have millions of tiny blocks: stay O(held))
    for block_id, holders in held_cpu.items():
        assert bm.cpu_ref_count[block_id] == holders, ("cpu", block_id)
    assert len(bm.free_cpu_block_ids) + len(held_cpu) == bm.num_cpu_blocks
    if bm.num_cpu_blocks <= 4096:
        free = set(bm.free_cpu_block_ids)
        assert len(free) == len(bm.free_cpu_block_ids) and not free & set(held_cpu)


def check_runner_state(engine) -> None:
    """The model runner's own record (built from SchedulerOutput messages only) agrees
    with the scheduler's for every sequence the scheduler says the runner knows: the
    same block table, and tokens that are a prefix of the sequence's reaching at least
    its computed ones (the token sampled last step reaches the runner next step).
    With async scheduling: once the forward in flight is done, the runner may know the
    tokens it sampled for the placeholders, beyond the scheduler's."""
    sched = engine.scheduler
    try:
        runner = engine.model_runner
    except AttributeError:                # in worker processes (tp or pp > 1, 'mp'): not readable here
        return
    in_flight = getattr(getattr(engine, "engine_core", None), "_in_flight", None)
    if in_flight is not None:
        wait([in_flight.future])          # the worker thread writes runner state meanwhile
    for group in sched.running:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if seq.seq_id not in sched.runner_view.known:
                continue
            state = runner.input_batch.seqs[seq.seq_id]
            table = seq.block_table.block_ids
            # speculative decoding: the blocks the scheduler took back after a verify step
            # are dropped by the runner when the next message comes (num_blocks_taken_back)
            spec = sched.config.speculative_config
            extra = state.block_ids[len(table):] if spec is not None else []
            assert state.block_ids == table + extra, (seq, state.block_ids)
            assert len(extra) == (sched._taken_back.get(seq.seq_id, 0) if spec is not None else 0), (seq, extra)
            tokens = state.prompt_token_ids + state.output_token_ids
            # ... and the drafts a verify step accepted reach it then too (as the sampled token)
            lag = spec.num_speculative_tokens if spec is not None else 0
            in_flight = sched._num_pending_tokens(seq)          # async scheduling's placeholders
            assert seq.num_computed_tokens - lag <= len(tokens) <= seq.num_tokens + in_flight, (seq, len(tokens))
            assert tokens[:seq.num_tokens] == seq.token_ids[:len(tokens)], seq
    live = {s.seq_id for g in sched.requests.values() for s in g.seqs if not s.status.is_finished}
    assert set(runner.input_batch.seqs) - live <= sched.runner_view.finished_seq_ids, "runner keeps a finished sequence"


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


class EventReplay:
    """Rebuilds the block manager's books from its events alone (events.py), to check that
    the event stream tells the whole story: attach it, step the engine, call check().

    It starts from a snapshot of the pools (an engine may have served requests before),
    then applies each event: who holds which device block (hence every ref_count and the
    free set), which blocks are named in the prefix cache, which CPU blocks each swapped
    sequence holds, and which requests are in the engine.
    """

    def __init__(self, engine) -> None:
        bm, sched = engine.block_manager, engine.scheduler
        self.engine = engine
        self.tables = {s.seq_id: list(s.block_table.block_ids) for g in _groups(sched)
                       for s in g.seqs if not s.is_swapped}
        self.cpu_tables = {s.seq_id: list(s.block_table.block_ids) for g in _groups(sched)
                           for s in g.seqs if s.is_swapped}
        self.cached = set(bm.cached_blocks.values())
        self.requests = {rid: tuple(s.seq_id for s in g.seqs) for rid, g in engine.requests.items()}
        engine.add_observer(self.apply)

    def apply(self, e) -> None:
        match e:
            case ev.BlockAllocated():
                table = self.tables.setdefault(e.seq_id, [])
                assert e.block_id not in self._held() and e.logical_index == len(table), e
                table.append(e.block_id)
            case ev.BlockFreed():
                self.tables[e.seq_id].remove(e.block_id)
                assert self._held()[e.block_id] == e.ref_count, e
            case ev.BlocksShared():
                assert all(self._held()[b] for b in e.block_ids), e     # the parent holds them
                self.tables.setdefault(e.seq_id, []).extend(e.block_ids)
            case ev.PrefixCacheHit():
                assert set(e.block_ids) <= self.cached, e
                self.tables.setdefault(e.seq_id, []).extend(e.block_ids)
            case ev.CopyOnWrite():
                table, held = self.tables[e.seq_id], self._held()
                assert table[e.logical_index] == e.src and held[e.src] > 1 and not held[e.dst], e
                table[e.logical_index] = e.dst
            case ev.BlockCached():
                assert e.block_id not in self.cached and e.block_id in self.tables[e.seq_id], e
                self.cached.add(e.block_id)
            case ev.BlockEvicted():
                assert not self._held()[e.block_id], e
                self.cached.remove(e.block_id)
            case ev.SwapOut():
                assert all(not self.tables.get(s) for s in e.block_tables), e     # released first
                self.cpu_tables.update({s: list(t) for s, t in e.block_tables.items()})
            case ev.SwapIn():
                for seq_id, table in e.block_tables.items():
                    assert not self.tables.get(seq_id) and set(table) <= {g for _, g in e.block_pairs}, e
                    self.tables[seq_id] = list(table)
                    del self.cpu_tables[seq_id]
            case ev.RequestAdded():
                assert e.request_id not in self.requests, e
                self.requests[e.request_id] = e.seq_ids
            case ev.RequestFinished():              # its blocks are free, in both pools
                for seq_id in self.requests.pop(e.request_id):
                    assert not self.tables.pop(seq_id, None), e
                    self.cpu_tables.pop(seq_id, None)

    def _held(self) -> Counter:
        return Counter(b for table in self.tables.values() for b in table)

    def check(self) -> None:
        """Raise AssertionError unless the replayed books equal the block manager's."""
        bm, sched = self.engine.block_manager, self.engine.scheduler
        held = self._held()
        assert [held[b] for b in range(bm.num_gpu_blocks)] == bm.ref_count
        assert {b for b in range(bm.num_gpu_blocks) if not held[b]} == set(bm.free_block_ids)
        assert self.cached == set(bm.cached_blocks.values())
        actual = {s.seq_id: s.block_table.block_ids for g in _groups(sched) for s in g.seqs
                  if s.block_table.block_ids and not s.is_swapped}
        assert {k: v for k, v in self.tables.items() if v} == actual
        cpu_held = Counter(b for table in self.cpu_tables.values() for b in table)
        assert all(bm.cpu_ref_count[b] == n for b, n in cpu_held.items())
        assert len(cpu_held) + bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
        assert set(self.requests) == set(self.engine.requests)


def _groups(sched):
    return list(sched.waiting) + list(sched.running) + list(sched.swapped)
