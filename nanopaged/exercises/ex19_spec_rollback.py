"""Exercise 19 (chapter 19): speculative decoding's rollback of rejected drafts' blocks."""
from __future__ import annotations

from contextlib import contextmanager

NUMBER = 19
CHAPTER = "19-speculative-decoding.md"
TITLE = "free_slots_past_computed: take back the rejected drafts' blocks"
TARGETS = ["nanopaged.spec_decode.scheduler:free_slots_past_computed"]
TASK = """
A verify step reserves slots for a sequence's k drafts before the forward (the
scheduler's append_slots), so its block table may grow by a block or two. After the
forward, the rejection sampler keeps some drafts and rejects the rest; the scheduler
rolls num_computed_tokens back to the accepted tokens and calls
free_slots_past_computed(block_manager, seq) (spec_decode/scheduler.py: the rollback is
speculative decoding's, run from the scheduler's side). Write it: every block at the
end of the table that holds no computed token (only slots of rejected drafts) is given
back, so that the table again holds ceil(num_computed_tokens / block_size) blocks. Such a block was fresh this
step and never named in the prefix cache, so it goes to the FRONT of the free queue:
the next allocation reuses it before any block whose cached contents still have value.
Publish a BlockFreed for each block, as BlockManager.free does. A block another table
also holds (ref_count > 1) only loses this sequence's hold: it is not free yet.
"""
HINT = """
With table = seq.block_table, keep = table.num_blocks_for(seq.num_computed_tokens) blocks stay. For each block id of
table.block_ids[keep:], last first (reversed): block_manager.block_pool.free_block(b,
front=True) lowers its ref_count, puts it at the FRONT of the free queue when that
reaches 0, and returns the new ref_count. If block_manager.observers, publish
BlockFreed(seq.seq_id, b, that ref_count) there. Then cut the table:
del table.block_ids[keep:]. A block somebody else still holds (ref_count > 1 before)
only loses this sequence's hold. Never touch num_computed_tokens: the scheduler set it.
"""

_BLOCK = 4


def _pool(num_blocks=8):
    from nanopaged.core.block_manager import BlockManager

    return BlockManager(num_gpu_blocks=num_blocks, block_size=_BLOCK, enable_prefix_caching=False)


def _rollback(bm, seq):
    from nanopaged.spec_decode.scheduler import free_slots_past_computed

    free_slots_past_computed(bm, seq)


def _holding(bm, seq_id, num_computed, block_ids):
    """A sequence whose first num_computed positions are computed and whose table holds
    block_ids (the ones past them reserved for drafts)."""
    from . import holding_sequence

    return holding_sequence(bm, seq_id, num_computed + 1, block_ids, num_computed)


def check_takes_back_the_blocks_past_the_accepted_tokens():
    """9 positions computed, a table of 4 blocks: the last one is free again, at the front of the free queue, and the table keeps 3"""
    bm = _pool()
    seq = _holding(bm, 0, 9, [5, 2, 7, 4])       # positions 0-8 in blocks 5, 2, 7 (one slot); 4 only drafts
    _rollback(bm, seq)
    assert seq.block_table.block_ids == [5, 2, 7], (
        f"9 computed positions need 3 blocks of 4: the table is {seq.block_table.block_ids}, it should be [5, 2, 7] "
        "(block 7 holds position 8: it stays, though its other slots were drafts')")
    assert bm.ref_count[4] == 0 and 4 in bm.free_block_ids, f"block 4 is not free (ref_count {bm.ref_count[4]})"
    assert next(iter(bm.free_block_ids)) == 4, (
        f"the free queue starts {list(bm.free_block_ids)[:4]}: block 4 must be first, reused before the blocks "
        "that were freed long ago (their prefix-cache names still have value)")
    assert seq.num_computed_tokens == 9, "num_computed_tokens changed: only the scheduler writes it"


def check_two_blocks_and_none():
    """4 positions computed, 3 blocks: two go back, the last one first; at a block boundary with no extra block, nothing changes"""
    bm = _pool()
    seq = _holding(bm, 0, 4, [1, 6, 3])
    _rollback(bm, seq)
    assert seq.block_table.block_ids == [1], f"4 computed positions need 1 block: the table is {seq.block_table.block_ids}"
    front = list(bm.free_block_ids)[:2]
    assert front == [6, 3], (f"the free queue starts {front}: it should start [6, 3] (blocks 3 then 6 given back, "
                             "last block first, each to the front)")
    before = list(bm.free_block_ids)
    seq = _holding(bm, 1, 8, [0, 2])
    _rollback(bm, seq)
    assert seq.block_table.block_ids == [0, 2] and bm.ref_count[0] == bm.ref_count[2] == 1, (
        f"8 computed positions fill exactly 2 blocks: nothing to take back, but the table is "
        f"{seq.block_table.block_ids} and the ref_counts {bm.ref_count[0]}, {bm.ref_count[2]}")
    assert list(bm.free_block_ids) == [b for b in before if b not in (0, 2)], "the free queue changed"


def check_a_shared_block_loses_one_hold():
    """a block past the computed positions that another sequence also holds is not freed: its ref_count drops by one"""
    bm = _pool()
    other = _holding(bm, 0, 8, [3, 5])
    seq = _holding(bm, 1, 4, [3, 5])              # shares block 5, which holds none of its computed positions
    _rollback(bm, seq)
    assert seq.block_table.block_ids == [3], f"the table is {seq.block_table.block_ids}, it should be [3]"
    assert bm.ref_count[5] == 1 and 5 not in bm.free_block_ids, (
        f"block 5 is still held by seq 0: its ref_count should be 1, it is {bm.ref_count[5]}"
        + (", and it is in the free queue" if 5 in bm.free_block_ids else ""))
    assert other.block_table.block_ids == [3, 5]


def check_events():
    """a BlockFreed(seq_id, block_id, ref_count after) for each block given back, the last block first"""
    from nanopaged.events import BlockFreed

    bm = _pool()
    seen = []
    bm.observers.append(seen.append)
    _holding(bm, 0, 8, [6])
    seq = _holding(bm, 1, 1, [0, 6, 2])
    _rollback(bm, seq)
    want = [BlockFreed(1, 2, 0), BlockFreed(1, 6, 1)]
    assert seen == want, f"the events were {[str(e) for e in seen]}, they should be {[str(e) for e in want]}"


# -- the engine, with drafts we choose ---------------------------------------------------------

@contextmanager
def scripted_drafts(full_token_ids: list[int], wrong_positions: set[int]):
    """Inside the block the n-gram proposer drafts the sequence's own future: for a
    sequence whose tokens so far begin full_token_ids (prompt and greedy output of a run
    without speculation), the next num_speculative_tokens tokens of it, except that the
    draft for each position in wrong_positions is a wrong token. So a test chooses where
    drafts are rejected, e.g. at a block's first slot. Other sequences get no drafts."""
    from nanopaged.spec_decode.ngram_proposer import NgramProposer

    original = NgramProposer.propose_text       # propose hands it the tokens as a str

    def propose_text(self, text):
        token_ids = [ord(c) for c in text]
        n = len(token_ids)
        if token_ids != full_token_ids[:n]:
            return []
        drafts = full_token_ids[n:n + self.num_speculative_tokens]
        return [(t - 1 if t else 1) if n + i in wrong_positions else t for i, t in enumerate(drafts)]
    NgramProposer.propose_text = propose_text
    try:
        yield
    finally:
        NgramProposer.propose_text = original


_PROMPT = list(range(30, 57))           # 27 tokens: the last one in slot 3 of block 6
_WRONG = {36, 41, 45, 46}               # rejections at a block's first slot, mid-block, and two in a row
_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _run():
    """The tiny model, one greedy request with scripted drafts: (tokens, the state of the
    pool after each step: (block table, num_computed_tokens, free queue, ref_counts))."""
    from nanopaged import LLM, SamplingParams

    from . import tiny_model_folder

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(tiny_model_folder(), block_size=_BLOCK, num_gpu_blocks=32, attention_backend="torch")
    full = _PROMPT + list(plain.generate([_PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
    llm = LLM(tiny_model_folder(), block_size=_BLOCK, num_gpu_blocks=32, attention_backend="torch",
              speculative_config=_SPEC)
    engine, states, out = llm.engine, [], None
    with scripted_drafts(full, _WRONG):
        engine.add_request("A", _PROMPT, params)
        while engine.has_unfinished_requests():
            outs = engine.step()
            out = outs[0] if outs else out
            bm = engine.block_manager
            seq = next((s for g in engine.requests.values() for s in g.seqs), None)
            table = list(seq.block_table.block_ids) if seq else []
            states.append((table, seq.num_computed_tokens if seq else None, list(bm.free_block_ids),
                           list(bm.ref_count)))
            if seq is not None and len(table) != -(-seq.num_computed_tokens // _BLOCK):
                raise AssertionError(f"after step {len(states)} the table holds {len(table)} blocks {table} for "
                                     f"{seq.num_computed_tokens} computed positions: it should hold "
                                     f"{-(-seq.num_computed_tokens // _BLOCK)}")
    stats = engine.get_stats()
    tokens = list(out.outputs[0].token_ids) if out else []
    assert tokens == full[len(_PROMPT):], (f"with speculation the engine produced {tokens[:12]}..., without it "
                                           f"{full[len(_PROMPT):len(_PROMPT) + 12]}...")
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"], "a block is still held at the end (a leak)"
    assert stats["spec_decode_num_draft_tokens"] > 0, "no draft was proposed: the scripted drafts did not reach the runner"
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], "no draft was rejected"
    return tokens, states


def check_engine_with_rejected_drafts():
    """the engine on your code, drafts rejected at a block's first slot and mid-block: the tables hold ceil(computed / 4) blocks after every step, the output is the one without speculation, and the pool is the engine's own after every step"""
    from . import engines_own

    _, states = _run()
    with engines_own():
        _, want = _run()
    for step, (got, ref) in enumerate(zip(states, want), start=1):
        for name, g, w in zip(("the block table", "num_computed_tokens", "the free queue", "the ref_counts"),
                              got, ref):
            assert g == w, (f"after step {step}, {name} is {g if name != 'the free queue' else g[:8]}"
                            f"{'...' if name == 'the free queue' else ''}; with the engine's own code it is "
                            f"{w if name != 'the free queue' else w[:8]}{'...' if name == 'the free queue' else ''}")
    assert len(states) == len(want), f"your run took {len(states)} steps, the engine's own {len(want)}"


CHECKS = [check_takes_back_the_blocks_past_the_accepted_tokens, check_two_blocks_and_none,
          check_a_shared_block_loses_one_hold, check_events, check_engine_with_rejected_drafts]
