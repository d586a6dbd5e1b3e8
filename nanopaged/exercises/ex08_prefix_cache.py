"""Exercise 8 (chapter 08): the prefix cache's names, and the lookup that uses them."""
from __future__ import annotations

NUMBER = 8
CHAPTER = "08-prefix-caching.md"
TITLE = "Prefix caching: chained block hashes and the lookup"
TARGETS = ["nanopaged.core.block_manager:hash_block_tokens",
           "nanopaged.core.block_manager:BlockManager._full_block_hashes",
           "nanopaged.core.block_manager:BlockManager._cached_prefix"]
TASK = """
Write the three functions that let a new request reuse the K/V of a prompt prefix that
an earlier request computed (vLLM v1's automatic prefix caching). A full block is named
by a hash of its tokens chained with its parent block's name, so a name stands for the
whole prefix up to the block's end; a sequence's names are computed once and kept in
seq.block_hashes; a waiting request's cached prefix is the run of its first blocks whose
names the block pool knows (bm.block_pool.get_cached_block(name, tokens): the block id,
confirmed by the block's stored tokens, or None), never including the prompt's last token.
The scheduler calls _cached_prefix for every request it admits, so every prefill of
the engine goes through your code.
"""
HINT = """
hash_block_tokens: hashlib.sha256(parent_hash or b""), then .update() with the tokens as
bytes (array("q", token_ids).tobytes()), then .digest().
_full_block_hashes: while len(hashes) < seq.num_tokens // bs, name block len(hashes)
from hashes[-1] (or None) and seq.token_ids_slice(i * bs, (i + 1) * bs); return the list.
_cached_prefix: return [] when caching is off or sampling_params.prompt_logprobs is not
None; else walk the first (seq.num_tokens - 1) // bs names, look each up with
self.block_pool.get_cached_block(name, seq.token_ids_slice(i * bs, (i + 1) * bs)), stop
at the first None, and return the block ids found.
"""


def _seq(tokens, seq_id=0, block_size=4):
    from nanopaged.core.sequence import Sequence

    return Sequence(seq_id, 0, list(tokens), block_size)


def _group(seq, **params):
    from nanopaged.core.sequence import SequenceGroup
    from nanopaged.messages import EngineCoreRequest
    from nanopaged.sampling_params import SamplingParams

    request = EngineCoreRequest(f"r{seq.seq_id}", seq.prompt_token_ids, SamplingParams(**params),
                                eos_token_ids=frozenset(), arrival_time=0.0)
    return SequenceGroup(request, [seq])


def _pool_with(tokens, block_ids):
    """A BlockManager whose prefix cache names the full blocks of a sequence that holds
    `tokens` in blocks `block_ids` (named by your functions, as the scheduler would)."""
    from nanopaged.core.block_manager import BlockManager

    bm = BlockManager(num_gpu_blocks=16, block_size=4)
    seq = _seq(tokens, seq_id=99)
    for b in block_ids:
        bm.block_pool.touch(b)
        seq.block_table.append_block(b)
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq, 0, len(tokens))
    return bm


def check_hash_chains():
    """hash_block_tokens is deterministic, and the same tokens after a different parent get a different name"""
    from nanopaged.core.block_manager import hash_block_tokens

    a, b = hash_block_tokens(None, [1, 2, 3, 4]), hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(a, bytes), f"a name should be bytes (a digest), you returned {type(a).__name__}"
    assert a == b, "hashing [1, 2, 3, 4] twice gave two different names"
    p, q = hash_block_tokens(None, [9, 9, 9, 9]), hash_block_tokens(None, [8, 8, 8, 8])
    assert p != q, "blocks [9, 9, 9, 9] and [8, 8, 8, 8] got the same name"
    assert hash_block_tokens(p, [5, 6, 7, 8]) != hash_block_tokens(q, [5, 6, 7, 8]), (
        "block [5, 6, 7, 8] got the same name after two different parents: the name must "
        "stand for the whole prefix, since the block's K/V depend on it")
    assert hash_block_tokens(p, [5, 6, 7, 8]) == hash_block_tokens(p, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [4, 3, 2, 1]), \
        "[1, 2, 3, 4] and [4, 3, 2, 1] got the same name: the order of the tokens must count"


def check_full_block_hashes():
    """_full_block_hashes names each full block (chained to the one before), not the partial one, and only extends seq.block_hashes"""
    from nanopaged.core.block_manager import BlockManager, hash_block_tokens

    bm = BlockManager(num_gpu_blocks=8, block_size=4)
    tokens = list(range(10, 21))                        # 11 tokens: 2 full blocks + 3
    seq = _seq(tokens)
    want = [hash_block_tokens(None, tokens[:4])]
    want.append(hash_block_tokens(want[0], tokens[4:8]))
    got = bm._full_block_hashes(seq)
    assert got is seq.block_hashes, "return seq.block_hashes itself (the sequence keeps its names)"
    assert got == want, (f"11 tokens in blocks of 4: expected the 2 names hash(None, tokens[0:4]), "
                         f"hash(name 0, tokens[4:8]); you returned {len(got)} names"
                         + (", not those" if len(got) == 2 else ""))
    seq.append_token(21)                                # block 2 is full now
    got = bm._full_block_hashes(seq)
    assert got == want + [hash_block_tokens(want[1], tokens[8:] + [21])], \
        "after a 12th token (an output token) block 2 is full: expected a third name, chained to the second"
    seq.block_hashes[:] = [b"kept-0", b"kept-1", b"kept-2"]
    seq.append_token(22)
    got = bm._full_block_hashes(seq)
    assert got[:3] == [b"kept-0", b"kept-1", b"kept-2"] and len(got) == 3, (
        "names already in seq.block_hashes must be kept as they are (they are computed once, "
        f"and kept across preemption); a 13th token fills no block, yet you returned {got[:3]}...")


def check_cached_prefix():
    """_cached_prefix finds the cached blocks of the longest shared prefix, confirmed by their tokens, never the last token's block"""
    cached = list(range(100, 114))                       # 3 full blocks (+ 2 tokens), in blocks 5, 9, 2, 7
    bm = _pool_with(cached, [5, 9, 2, 7])
    cases = [(cached[:8] + [1, 2, 3], [5, 9], "the first 8 tokens shared, then other tokens"),
             (cached[:12] + [1], [5, 9, 2], "the first 12 tokens shared, a 13th of its own"),
             (cached[:12], [5, 9], "exactly the 12 cached tokens (the last token is always computed, "
                                   "to have logits to sample from)"),
             (cached[:3], [], "3 tokens, no full block"),
             ([0] + cached[1:12] + [1], [], "a first token of its own (so no block's whole prefix matches)")]
    for tokens, want, what in cases:
        got = bm._cached_prefix(_group(_seq(tokens)), _seq(tokens))
        assert got == want, f"a prompt with {what}: you returned blocks {got}, expected {want}"
    bm.block_pool.blocks[9].token_ids = (0, 0, 0, 0)     # as if block 9's name collided
    got = bm._cached_prefix(_group(_seq(cached)), _seq(cached))
    assert got == [5], (f"block 9's name matches but it holds other tokens (a hash collision): the hit must "
                        f"stop before it; you returned {got}, expected [5]")


def check_no_hit_when_not_allowed():
    """no hit when prefix caching is off, or for a request that asks for prompt_logprobs"""
    cached = list(range(100, 114))
    bm = _pool_with(cached, [5, 9, 2, 7])
    got = bm._cached_prefix(_group(_seq(cached), prompt_logprobs=1), _seq(cached))
    assert got == [], (f"a request with prompt_logprobs=1 needs every prompt token's logits, so it reads "
                       f"nothing from the cache; you returned {got}")
    bm.enable_prefix_caching = False
    got = bm._cached_prefix(_group(_seq(cached)), _seq(cached))
    assert got == [], f"with enable_prefix_caching False you returned {got}, expected []"


def _serve_one_by_one(prompts, params):
    """Generate the prompts one after another on one tiny engine: (tokens, cache hits)."""
    from nanopaged import LLM

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=64, attention_backend="torch")
    engine, tokens, hits = llm.engine, [], []
    for i, prompt in enumerate(prompts):
        before = engine.get_stats()["prefix_cache_hits"]
        engine.add_request(str(i), prompt, params)
        for _ in range(4 * params.max_tokens):
            outs = engine.step()
            if not engine.has_unfinished_requests():
                break
        else:
            raise AssertionError(f"prompt {i + 1} ({len(prompt)} tokens) is still unfinished after "
                                 f"{4 * params.max_tokens} engine steps: did its prefill have nothing to compute?")
        tokens.append(list(outs[0].outputs[0].token_ids))
        hits.append(engine.get_stats()["prefix_cache_hits"] - before)
    stats = llm.engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"], "KV blocks are still held (a leak)"
    return tokens, hits


def check_engine_runs_on_it():
    """the engine reuses cached prefixes with your code: same tokens and cache hits as its own, no false hit"""
    from nanopaged import SamplingParams

    from . import engines_own

    a, b, c, d, e = ([t] * 4 for t in (11, 22, 33, 44, 55))
    prompts = [a + b + [1, 2], a + b + c + [3],            # 2: shares a + b with 1
               d + c + [4], a + c + e + [5],               # 4: a hits, but this c follows a, not d
               a + b]                                      # 5: all cached, yet its last token is computed
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got_tokens, got_hits = _serve_one_by_one(prompts, params)
    with engines_own():
        want_tokens, want_hits = _serve_one_by_one(prompts, params)
    for i, (g, w) in enumerate(zip(got_hits, want_hits)):
        assert g == w, (f"prompt {i + 1} of {len(prompts)} found {g} tokens in the cache with your code, {w} "
                        "with the engine's own" + (" (its block c follows a, not d: a false hit?)" if i == 3 else "")
                        + (" (every block is cached, but the last token must be computed)" if i == 4 else ""))
    for i, (g, w) in enumerate(zip(got_tokens, want_tokens)):
        assert g == w, f"prompt {i + 1}: with your code the engine produced {g}, with its own {w}"


CHECKS = [check_hash_chains, check_full_block_hashes, check_cached_prefix, check_no_hit_when_not_allowed,
          check_engine_runs_on_it]
