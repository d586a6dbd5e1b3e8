"""NgramProposer: prompt lookup decoding, vLLM's choice of match (the longest n-gram,
its earliest occurrence), the draft length limits and the argument checks."""

import random
import time

import pytest

from nanopaged.spec_decode.ngram_proposer import NgramProposer


def test_proposes_the_tokens_that_followed_the_match():
    assert NgramProposer(3, 2, 2).propose_tokens([1, 2, 3, 4, 5, 9, 1, 2]) == [3, 4, 5]


def test_no_match_proposes_nothing():
    assert NgramProposer(3, 1, 3).propose_tokens([1, 2, 3, 4, 5]) == []
    assert NgramProposer(3, 1, 3).propose_tokens([7]) == []
    assert NgramProposer(3, 1, 3).propose_tokens([]) == []


def test_suffix_shorter_than_prompt_lookup_min_does_not_match():
    # [4] and [3, 4] occur earlier, but n must be >= 3.
    assert NgramProposer(3, 3, 4).propose_tokens([3, 4, 8, 9, 3, 4]) == []


def test_longest_ngram_wins():
    # The 1-gram [4] first occurs at 0 (followed by 7); the 3-gram [2, 3, 4] at 3.
    tokens = [4, 7, 7, 2, 3, 4, 5, 6, 2, 3, 4]
    assert NgramProposer(2, 1, 3).propose_tokens(tokens) == [5, 6]
    assert NgramProposer(2, 1, 1).propose_tokens(tokens) == [7, 7]


def test_earliest_occurrence_wins_like_vllm():
    # [1, 2] occurs at 0 (followed by 10) and at 3 (followed by 20).
    assert NgramProposer(1, 2, 2).propose_tokens([1, 2, 10, 1, 2, 20, 1, 2]) == [10]


def test_proposal_is_cut_at_the_end_of_the_sequence():
    # The match [5, 6] at 2 is followed by only [7, 5, 6] before the end.
    assert NgramProposer(5, 2, 2).propose_tokens([0, 1, 5, 6, 7, 5, 6]) == [7, 5, 6]


def test_occurrence_may_overlap_the_suffix():
    assert NgramProposer(4, 2, 2).propose_tokens([3, 3, 3]) == [3]
    assert NgramProposer(4, 3, 3).propose_tokens([3, 3, 3, 3, 3]) == [3, 3]


def test_at_most_num_speculative_tokens():
    assert NgramProposer(2, 1, 1).propose_tokens([1, 2, 3, 4, 5, 1]) == [2, 3]


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=0, prompt_lookup_min=1, prompt_lookup_max=2), "num_speculative_tokens"),
    (dict(num_speculative_tokens=1, prompt_lookup_min=0, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(num_speculative_tokens=1, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
])
def test_bad_arguments_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)


def test_token_id_out_of_range_raises():
    with pytest.raises(ValueError, match="token_ids"):
        NgramProposer(2, 1, 2).propose_tokens([1, 0x110000, 1])


def test_4000_tokens_fast_and_same_as_a_plain_scan():
    rng = random.Random(0)
    proposer = NgramProposer(5, 1, 4)
    cases = [[rng.randrange(50) for _ in range(4000)],
             [rng.randrange(151_000) for _ in range(4000)],
             [0, 0, 0, 2] * 1000 + [0, 0, 0, 1],
             [0] * 4000]
    for tokens in cases:
        assert proposer.propose_tokens(tokens) == plain_scan(tokens, 5, 1, 4)
        start = time.perf_counter()
        for _ in range(20):
            proposer.propose_tokens(tokens)
        assert (time.perf_counter() - start) / 20 < 0.01      # measured ~0.5 ms; 10 ms is slack


def plain_scan(tokens, k, lo, hi):
    """The rule written out: longest n first, earliest occurrence ending before the end."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for s in range(len(tokens) - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_propose_keeps_each_sequences_text_until_it_is_removed():
    """Proposer.propose: the proposer keeps each sequence's tokens as text itself (the
    runner's record holds none of it), extends it as tokens come, forgets it on
    remove_sequence."""
    from nanopaged import SamplingParams
    from nanopaged.worker.input_batch import SeqState

    proposer = NgramProposer(2, 1, 2)
    seq = SeqState(7, 0, [1, 2, 3, 4], [1], SamplingParams(), [0], 5)
    assert proposer.propose(None, [(seq, [2])]) == {7: [3, 4]}            # 1 2 3 4 1 | 2 -> 3 4
    assert not hasattr(seq, "lookup_text")
    seq.output_token_ids += [2, 5]
    assert proposer.propose(None, [(seq, [1])]) == {7: [2, 3]}            # ... 1 2 5 | 1 -> 2 3
    # the same seq_id sent in full again with other tokens: after remove_sequence the
    # proposer reads them anew, not its old text
    proposer.remove_sequence(7)
    other = SeqState(7, 0, [8, 9, 8], [], SamplingParams(), [0], 3)
    assert proposer.propose(None, [(other, [9])]) == {7: [8, 9]}          # 8 9 8 | 9 -> 8 9
