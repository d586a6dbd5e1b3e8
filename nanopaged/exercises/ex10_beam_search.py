"""Exercise 10 (chapter 10): the rules of one beam-search step."""
from __future__ import annotations

NUMBER = 10
CHAPTER = "10-beam-search.md"
TITLE = "Beam search: rank the candidates, finish or continue"
TARGETS = ["nanopaged.beam_search.scheduler:top_candidates",
           "nanopaged.beam_search.scheduler:split_candidates"]
TASK = """
Write the rules of a beam-search step, the ones transformers' generate(num_beams=k,
early_stopping=True) follows, so that nanopaged agrees with it token for token.
top_candidates scores every (beam, token) candidate of the runner's logprobs rows by
the beam's cumulative logprob (the request's BeamState keeps them, by seq_id) plus the
token's, and keeps the best ones.
split_candidates decides which of them end (an eos token, or the length limit) and
become finished hypotheses, which continue as the next beams, and whether the search
is done. beam_search_step calls both after every forward pass of a beam-search request,
then gives the next beams their Sequences (forking where a beam has two children).
"""
HINT = """
top_candidates: build (cumulative_logprob[beam.seq_id] + lp, beam index, position in
row, beam, token) for each beam and each (lp, token) of zip(row.logprobs[0][1:], row.token_ids[0][1:])
(entry 0 is the sampled token, not a candidate), sort by score, highest first (ties:
lower beam index, then lower position), keep `keep`, return (score, beam, token).
split_candidates: walk the ranked list with its rank. A candidate ends if ends_by_length
or (not ignore_eos and token in eos_token_ids). Not ending: a next beam, while there are
fewer than beam_width. Ending with rank < beam_width while fewer than beam_width
hypotheses were finished before this step: a BeamSearchSequence(beam.token_ids +
[token], score, score=score / gen_len ** length_penalty, finish_reason="stop" if eos
else "length"). Then state.finished = the best beam_width of old + new, by .score;
state.done = len(state.finished) >= beam_width or len(next beams) < beam_width.
"""

EOS = 0


def _beams(*cumulative_logprobs):
    """(beams, seq_id -> cumulative logprob): beams 10, 11, ... with two tokens each."""
    from nanopaged.core.sequence import Sequence

    beams, cumulative = [], {}
    for i, c in enumerate(cumulative_logprobs):
        seq = Sequence(10 + i, i, [1, 2, 3], 4)
        seq.output_token_ids = [40 + i, 50 + i]          # two tokens generated so far
        cumulative[seq.seq_id] = c
        beams.append(seq)
    return beams, cumulative


def _row(tokens, logprobs):
    from nanopaged.messages import Logprobs

    return Logprobs([list(tokens)], [list(logprobs)], [1])


def _state(beam_width, **params):
    from nanopaged.beam_search.scheduler import BeamSearchParams, BeamState

    return BeamState(BeamSearchParams(beam_width=beam_width, max_tokens=10, **params))


def _show(ranked):
    return [(round(score, 4), beam.seq_id, token) for score, beam, token in ranked]


def check_top_candidates():
    """candidates are scored cumulative_logprob + logprob, best first, the row's first entry (the sampled token) excluded"""
    from nanopaged.beam_search.scheduler import top_candidates

    (b0, b1), cumulative = _beams(-1.0, -0.5)
    rows = {10: _row([5, 5, 6, 7], [-0.1, -0.1, -0.2, -3.0]),      # sampled token 5, then the top 3
            11: _row([8, 8, 9, 10], [-0.3, -0.3, -1.0, -2.0])}
    got = _show(top_candidates([b0, b1], cumulative, rows, 4))
    want = [(-0.8, 11, 8), (-1.1, 10, 5), (-1.2, 10, 6), (-1.5, 11, 9)]
    assert got == want, (f"beams 10 (cumulative -1.0) and 11 (-0.5), rows {rows[10].token_ids[0]} / "
                         f"{rows[11].token_ids[0]}, keep 4: expected (score, beam, token) {want}, you returned {got}")
    got = _show(top_candidates([b0, b1], cumulative, rows, 6))
    assert len(got) == 6 and got[-1] == (-4.0, 10, 7), f"keep 6 of the 6 candidates: you returned {got}"
    tie = {10: _row([5, 5, 6], [-0.5, -0.5, -0.5]), 11: _row([8, 8, 9], [-1.0, -1.0, -1.0])}
    got = _show(top_candidates([b0, b1], cumulative, tie, 4))
    want = [(-1.5, 10, 5), (-1.5, 10, 6), (-1.5, 11, 8), (-1.5, 11, 9)]
    assert got == want, \
        f"four equal scores: ties go to the earlier beam, then the earlier token: {got}, expected {want}"


def check_finished_hypotheses():
    """an ending candidate ranked among the first beam_width becomes a hypothesis scored cum_logprob / gen_len ** length_penalty"""
    from nanopaged.beam_search.scheduler import split_candidates

    (b0, b1), _ = _beams(-1.0, -0.5)
    state = _state(2, length_penalty=2.0)
    ranked = [(-1.0, b0, EOS), (-1.2, b0, 5), (-1.5, b1, EOS), (-2.0, b1, 6)]
    split_candidates(state, ranked, frozenset({EOS}), 3, False)
    got = [(h.tokens, h.cum_logprob, round(h.score, 4), h.finish_reason) for h in state.finished]
    want = [(b0.token_ids + [EOS], -1.0, round(-1.0 / 3 ** 2.0, 4), "stop")]
    assert got == want, (f"width 2, candidates ranked (-1.0, eos), (-1.2, 5), (-1.5, eos), (-2.0, 6), 3 tokens "
                         f"generated, length_penalty 2: the rank-0 eos is a hypothesis (tokens, cum_logprob, score, "
                         f"finish_reason) {want}; the rank-2 eos is not among the first 2. You have {got}")
    state = _state(2, ignore_eos=True)
    nxt = split_candidates(state, ranked, frozenset({EOS}), 3, False)
    assert state.finished == [] and _show(nxt) == [(-1.0, 10, EOS), (-1.2, 10, 5)], (
        f"with ignore_eos an eos token is an ordinary candidate: no hypothesis, next beams the first two; you have "
        f"{len(state.finished)} hypotheses and next beams {_show(nxt)}")
    state = _state(2)
    split_candidates(state, [(-1.2, b0, 5), (-2.0, b1, 6), (-2.5, b1, 7)], frozenset({EOS}), 10, True)
    got = [(h.tokens[-1], h.finish_reason) for h in state.finished]
    assert got == [(5, "length"), (6, "length")], (
        f"at the length limit every candidate ends: the first 2 become hypotheses with finish_reason 'length'; "
        f"you have (last token, finish_reason) {got}")


def check_next_beams_and_done():
    """the best beam_width candidates that go on are the next beams; the search is done once beam_width hypotheses are in, or too few go on"""
    from nanopaged.beam_search.scheduler import BeamSearchSequence, split_candidates

    (b0, b1), _ = _beams(-1.0, -0.5)
    state = _state(2)
    ranked = [(-1.0, b0, EOS), (-1.2, b0, 5), (-1.5, b1, 6), (-2.0, b1, 7)]
    nxt = split_candidates(state, ranked, frozenset({EOS}), 3, False)
    assert _show(nxt) == [(-1.2, 10, 5), (-1.5, 11, 6)] and not state.done, (
        f"width 2, ranked (-1.0, eos), (-1.2, 5), (-1.5, 6), (-2.0, 7): the next beams are (-1.2, 5) and "
        f"(-1.5, 6), and the search goes on (1 hypothesis of 2). You returned {_show(nxt)}, done={state.done}")
    nxt = split_candidates(state, [(-2.1, b0, EOS), (-2.2, b0, 8), (-2.3, b1, 9)], frozenset({EOS}), 4, False)
    assert len(state.finished) == 2 and state.done, (
        f"a second eos at rank 0: 2 hypotheses for width 2, so the search is done; you have {len(state.finished)} "
        f"hypotheses, done={state.done}")
    assert [h.cum_logprob for h in state.finished] == [-1.0, -2.1], \
        f"state.finished must be sorted by score, best first: {[h.cum_logprob for h in state.finished]}"
    state = _state(2)
    state.finished = [BeamSearchSequence([1], -0.1, score=-0.05), BeamSearchSequence([2], -0.2, score=-0.1)]
    split_candidates(state, [(-0.01, b0, EOS), (-1.0, b0, 5), (-1.1, b1, 6)], frozenset({EOS}), 2, False)
    assert [h.cum_logprob for h in state.finished] == [-0.1, -0.2], (
        "2 hypotheses were already finished for width 2: no new one is taken (early stopping), however good; "
        f"you have {[h.cum_logprob for h in state.finished]}")
    state = _state(3)
    split_candidates(state, [(-1.0, b0, EOS), (-1.2, b0, 5), (-1.5, b1, EOS), (-1.6, b1, 6)],
                     frozenset({EOS}), 3, False)
    assert state.done, ("width 3, but only 2 candidates go on: fewer than beam_width beams can continue, so the "
                        "search is done")


def _beam_search():
    """Beam searches of several widths on one tiny engine, with some frequent tokens made eos."""
    from nanopaged import LLM, BeamSearchParams

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=64, attention_backend="torch")
    llm.engine.processor.eos_token_ids = frozenset({EOS, 4, 204})      # so that some hypotheses end early
    results = []
    for prompt, params in (([5, 6, 7, 8, 9, 10], BeamSearchParams(beam_width=3, max_tokens=6)),
                           ([40, 41, 42], BeamSearchParams(beam_width=2, max_tokens=7, length_penalty=0.5)),
                           ([100, 3, 7, 9, 11], BeamSearchParams(beam_width=4, max_tokens=5))):
        out = llm.beam_search([prompt], params)[0]
        results.append([(s.tokens[len(prompt):], round(s.cum_logprob, 5), round(s.score, 5), s.finish_reason)
                        for s in out.sequences])
    stats = llm.engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"], "KV blocks are still held (a leak)"
    return results


def check_engine_runs_on_it():
    """LLM.beam_search on the tiny model gives the engine's own hypotheses, scores and finish reasons"""
    from . import engines_own

    got = _beam_search()
    with engines_own():
        want = _beam_search()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (f"search {i}: with your code (tokens, cum_logprob, score, finish_reason) =\n{g}\n"
                        f"with the engine's own\n{w}")


CHECKS = [check_top_candidates, check_finished_hypotheses, check_next_beams_and_done, check_engine_runs_on_it]
