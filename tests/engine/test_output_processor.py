"""The OutputProcessor, fed hand-made EngineCoreOutputs one step at a time (no model).

The tiny tokenizer splits "Hello, my name is nanopaged." into
'Hello' ',' ' my' ' nam' 'e' ' is' ' nanop' 'aged' '.', so "name is" spans three tokens.
"""
import tempfile

import pytest

from nanopaged.beam_search.messages import BeamSearchHypothesis, BeamSearchRequest
from nanopaged.beam_search.output_processor import BeamSearchOutputProcessor
from nanopaged.beam_search.scheduler import BeamSearchParams
from nanopaged.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from nanopaged.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                FinishReason, Logprobs)
from nanopaged.engine.output_processor import OutputProcessor
from nanopaged.outputs import Logprob
from nanopaged.sampling_params import RequestOutputKind, SamplingParams

from conftest import make_tiny_tokenizer

EOS = 0
TEXT = "Hello, my name is nanopaged."
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = [273, 312, 274, 303, 318]          # "The capital of France"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ids(tok):
    return tok(TEXT).input_ids


def add(op, rid="r", n=1, prompt_ids=PROMPT, beam_search=None, **params):
    args = (rid, prompt_ids, SamplingParams(n=n, **params), frozenset({EOS}), 0.0)
    op.add_request(EngineCoreRequest(*args) if beam_search is None else BeamSearchRequest(*args, beam_search),
                   None, n)


def step(op, *outs):
    return op.process_outputs(EngineCoreOutputs(list(outs)))


def out(token_ids, rid="r", index=0, **kw):
    return EngineCoreOutput(rid, index, list(token_ids), **kw)


def feed(op, token_ids, rid="r", index=0, finish=None):
    """One token per step; the last step carries `finish`. Returns every step's result."""
    results = []
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        results.append(step(op, out([t], rid, index, finish_reason=finish if last else None)))
    return results


def only(result):
    assert len(result.request_outputs) == 1
    return result.request_outputs[0]


# -- stop strings ---------------------------------------------------------------------------

def test_c16_stop_string_spanning_tokens(tok, ids):
    op = OutputProcessor(tok)
    add(op, stop=["name is"])
    results = feed(op, ids[:7])                           # the core would run on; it is told to stop
    final = only(results[5])
    c = final.outputs[0]
    assert final.finished and c.text == "Hello, my " and c.finish_reason == "stop"
    assert c.stop_reason == "name is" and c.token_ids == ids[:6]
    assert results[5].seqs_to_stop == [("r", 0)]
    assert results[6].request_outputs == [] and not op.has_unfinished_requests()


def test_c16_deltas_concatenate_and_never_hold_the_stop_string(tok, ids):
    op = OutputProcessor(tok)
    add(op, stop=["name is"], output_kind=DELTA)
    deltas = [c.text for r in feed(op, ids[:6]) for o in r.request_outputs for c in o.outputs]
    assert "".join(deltas) == "Hello, my "
    assert "n" not in "".join(deltas)          # the "n" of "name is" never leaked, not even alone
    assert deltas == ["", "", "Hel", "lo, ", "m", "y "]        # 6 characters always held back


def test_c16_include_stop_str_in_output_keeps_it_and_holds_nothing_back(tok, ids):
    op = OutputProcessor(tok)
    add(op, stop=["name is"], include_stop_str_in_output=True)
    results = feed(op, ids[:6])
    assert only(results[0]).outputs[0].text == "Hello"
    assert only(results[5]).outputs[0].text == "Hello, my name is"


def test_stop_string_found_across_two_steps(tok, ids):
    op = OutputProcessor(tok)
    add(op, stop=["my name"])
    step(op, out(ids[:3]))                              # "Hello, my"
    r = step(op, out(ids[3:6]))                         # " name is": the match spans both steps
    assert only(r).outputs[0].text == "Hello, " and r.seqs_to_stop == [("r", 0)]


def test_several_stop_strings_the_earliest_match_wins(tok, ids):
    op = OutputProcessor(tok)
    add(op, stop=["nanopaged", "name", "my"])
    c = only(step(op, out(ids))).outputs[0]             # all the text in one step
    assert (c.text, c.stop_reason) == ("Hello, ", "my")
    # the match that ends first, whatever the list order; the longer one on a tie
    assert check_stop_strings("abcd", 4, ["abcd", "bc"], False) == ("bc", 1)
    assert check_stop_strings("abcd", 4, ["cd", "bcd"], True) == ("bcd", 4)
    assert check_stop_strings("abcd", 1, ["ab"], False) is None      # "ab" is old text


def test_min_tokens_suppresses_stop_strings(tok, ids):
    op = OutputProcessor(tok)
    add(op, stop=[","], min_tokens=2)
    feed(op, ids[:4])
    assert op.request_states["r"].completions[0].finish_reason is None    # "," was token 2
    op = OutputProcessor(tok)
    add(op, stop=[", my"], min_tokens=2)                # ends in token 3: counts
    assert only(feed(op, ids[:3])[-1]).outputs[0].text == "Hello"


# -- output kinds ---------------------------------------------------------------------------

def test_cumulative_outputs_hold_everything_so_far(tok, ids):
    op = OutputProcessor(tok)
    add(op)
    texts = [only(r).outputs[0].text for r in feed(op, ids[:3], finish=FinishReason.LENGTH)]
    assert texts == ["Hello", "Hello,", "Hello, my"]


def test_delta_outputs_hold_only_what_is_new(tok, ids):
    op = OutputProcessor(tok)
    add(op, n=2, output_kind=DELTA)
    r = step(op, out(ids[:2], index=0), out(ids[:1], index=1))
    assert [(c.index, c.text, c.token_ids) for c in only(r).outputs] == [
        (0, "Hello,", ids[:2]), (1, "Hello", ids[:1])]
    r = step(op, out(ids[1:2], index=1))                # only completion 1 moved
    assert [(c.index, c.text, c.token_ids) for c in only(r).outputs] == [(1, ",", ids[1:2])]


def test_final_only_gives_one_output(tok, ids):
    op = OutputProcessor(tok)
    add(op, output_kind=FINAL_ONLY)
    results = feed(op, ids, finish=FinishReason.LENGTH)
    assert all(r.request_outputs == [] for r in results[:-1])
    final = only(results[-1])
    assert final.finished and final.outputs[0].text == TEXT and final.outputs[0].token_ids == ids


def test_n2_completions_finishing_at_different_steps(tok, ids):
    op = OutputProcessor(tok)
    add(op, n=2)
    r = step(op, out(ids[:1], index=0, finish_reason=FinishReason.LENGTH), out(ids[:1], index=1))
    assert not only(r).finished and [c.finish_reason for c in only(r).outputs] == ["length", None]
    r = step(op, out(ids[1:2], index=1, finish_reason=FinishReason.LENGTH))
    assert only(r).finished and [c.text for c in only(r).outputs] == ["Hello", "Hello,"]
    assert not op.has_unfinished_requests()


def test_abort_forgets_the_request(tok, ids):
    op = OutputProcessor(tok)
    add(op, "a")
    add(op, "b")
    op.abort_requests("a")
    assert op.get_num_unfinished_requests() == 1
    r = step(op, out(ids[:1], "a"), out(ids[:1], "b"))
    assert [o.request_id for o in r.request_outputs] == ["b"]
    op.abort_requests(["b", "unknown"])
    assert not op.has_unfinished_requests()


def test_duplicate_request_id_raises(tok):
    op = OutputProcessor(tok)
    add(op)
    with pytest.raises(ValueError, match="already in use"):
        add(op)


def test_hold_back_is_released_when_the_sequence_finishes(tok, ids):
    op = OutputProcessor(tok)
    add(op, stop=["never appears"])
    results = feed(op, ids, finish=FinishReason.LENGTH)
    assert only(results[-2]).outputs[0].text == TEXT[:-1][:-12]     # 12 characters held back
    assert only(results[-1]).outputs[0].text == TEXT


def test_text_equals_decode_of_the_token_ids(tok):
    op = OutputProcessor(tok)
    add(op, output_kind=DELTA)
    text_ids = tok("Café déjà vu. 東京と大阪. 👍🏽 done.").input_ids
    deltas = [c.text for r in feed(op, text_ids + [EOS], finish=FinishReason.STOP)
              for o in r.request_outputs for c in o.outputs]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(text_ids + [EOS], skip_special_tokens=True)


# -- eos / stop token ids ---------------------------------------------------------------------

def test_c17_eos_has_no_stop_reason_and_stays_out_of_the_text(tok, ids):
    """An eos ends with stop_reason None (vLLM's; issue 34: the core sends None, so the
    eos id itself says the last token is a stop token to leave out of the text). A
    stop_token_ids id is the stop_reason and stays out too; a structured output whose
    grammar completed stops on a token of its text (no stop id), which stays in."""
    for include in (False, True):
        op = OutputProcessor(tok)
        add(op, skip_special_tokens=False, include_stop_str_in_output=include)
        c = only(step(op, out([ids[0], EOS], finish_reason=FinishReason.STOP))).outputs[0]
        assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", None, [ids[0], EOS])
        assert c.text == ("Hello<eos>" if include else "Hello")    # vLLM v1: only when asked
        op = OutputProcessor(tok)
        add(op, stop_token_ids=[ids[1]], include_stop_str_in_output=include)
        c = only(step(op, out(ids[:2], finish_reason=FinishReason.STOP, stop_reason=ids[1]))).outputs[0]
        assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == \
            ("stop", ids[1], ids[:2], "Hello," if include else "Hello")
    op = OutputProcessor(tok)
    add(op)
    c = only(step(op, out(ids[:2], finish_reason=FinishReason.STOP))).outputs[0]
    assert (c.text, c.stop_reason) == ("Hello,", None)


def test_length_finish_has_no_stop_reason(tok, ids):
    op = OutputProcessor(tok)
    add(op)
    c = only(step(op, out(ids[:2], finish_reason=FinishReason.LENGTH))).outputs[0]
    assert c.finish_reason == "length" and c.stop_reason is None


# -- logprobs -----------------------------------------------------------------------------

def test_logprob_dicts_hold_the_sampled_token_with_its_rank_and_the_top_k(tok, ids):
    op = OutputProcessor(tok)
    add(op, logprobs=2, output_kind=DELTA)
    row = Logprobs(token_ids=[[ids[0], 7, 8]], logprobs=[[-2.5, -0.5, -1.0]], ranks=[3])
    c = only(step(op, out(ids[:1], new_logprobs=row))).outputs[0]
    assert c.logprobs == [{ids[0]: Logprob(-2.5, 3, "Hello"), 7: Logprob(-0.5, 1, tok.decode([7])),
                           8: Logprob(-1.0, 2, tok.decode([8]))}]
    row = Logprobs(token_ids=[[ids[1], ids[1], 9]], logprobs=[[-0.25, -0.25, -3.0]], ranks=[1])
    c = only(step(op, out(ids[1:2], new_logprobs=row))).outputs[0]
    assert len(c.logprobs) == 1 and c.logprobs[0][ids[1]] == Logprob(-0.25, 1, ",")   # in top-k too
    assert c.cumulative_logprob == pytest.approx(-2.75)


def test_cumulative_logprob_is_none_without_logprobs(tok, ids):
    op = OutputProcessor(tok)
    add(op)
    c = only(step(op, out(ids[:1]))).outputs[0]
    assert c.cumulative_logprob is None and c.logprobs is None


def test_prompt_logprobs_accumulate_across_chunks(tok, ids):
    for kind in (CUMULATIVE, DELTA):
        op = OutputProcessor(tok)
        add(op, prompt_logprobs=1, output_kind=kind)
        first = Logprobs([[312, 1], [274, 2]], [[-1.0, -0.5], [-2.0, -0.1]], [2, 3])
        second = Logprobs([[303, 303], [318, 4]], [[-0.3, -0.3], [-4.0, -0.2]], [1, 5])
        r1 = step(op, out([], new_prompt_logprobs=first, num_cached_tokens=0))   # a prefill chunk
        r2 = step(op, out(ids[:1], new_prompt_logprobs=second))
        plp = only(r2).prompt_logprobs
        assert len(plp) == len(PROMPT) and plp[0] is None
        assert plp[1] == {312: Logprob(-1.0, 2, " capit"), 1: Logprob(-0.5, 1, tok.decode([1]))}
        assert plp[3] == {303: Logprob(-0.3, 1, " of")} and plp[4][318].rank == 5
        if kind is DELTA:        # given once, whole, with the first output that shows a token
            assert r1.request_outputs == []
            assert only(step(op, out(ids[1:2]))).prompt_logprobs == []
        else:
            assert only(r1).prompt_logprobs == plp[:3]


def test_num_cached_tokens_is_reported(tok, ids):
    op = OutputProcessor(tok)
    add(op)
    step(op, out(ids[:1], num_cached_tokens=4))
    assert only(step(op, out(ids[1:2]))).num_cached_tokens == 4


# -- beam search ----------------------------------------------------------------------------

def test_beam_hypotheses_are_reported_once_in_rank_order(tok, ids):
    op = BeamSearchOutputProcessor(tok)       # beam search's (beam_search/output_processor.py)
    add(op, n=2, beam_search=BeamSearchParams(beam_width=2), temperature=0)
    add(op, rid="plain")                       # a sampled request alongside: the base's way
    assert step(op, out(ids[:1], rid="plain")).request_outputs
    r = step(op, BeamSearchHypothesis("r", 1, ids[:3] + [EOS], finish_reason=FinishReason.STOP, stop_reason=EOS,
                                      cumulative_logprob=-3.0, score=-0.75),
             BeamSearchHypothesis("r", 0, ids[:2], finish_reason=FinishReason.LENGTH, cumulative_logprob=-1.0,
                                  score=-0.5))
    final = only(r)
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert [c.text for c in final.outputs] == ["Hello,", "Hello, my"]
    assert [(c.cumulative_logprob, c.score) for c in final.outputs] == [(-1.0, -0.5), (-3.0, -0.75)]
    assert [c.finish_reason for c in final.outputs] == ["length", "stop"]
    assert list(op.request_states) == ["plain"]


# -- the detokenizer ------------------------------------------------------------------------

def test_spaces_between_special_tokens_glues_consecutive_special_tokens():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()   # joins words with " "
    wp = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
    wp.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    text_ids = wp("hello <a><b> world").input_ids

    def stream(**kw):
        d = IncrementalDetokenizer(wp, [], **kw)
        return [d.step(i) for i in text_ids]

    assert stream(skip_special_tokens=False) == ["hello", " <a>", " <b>", " world"]
    assert stream(skip_special_tokens=False, spaces_between_special_tokens=False) == [
        "hello", " <a>", "<b>", " world"]
    assert stream(skip_special_tokens=True) == ["hello", "", "", " world"]


def test_a_prompt_ending_inside_a_character_never_leaks_into_the_output():
    """The prompt context seeds the decode stream; if it ends in half a UTF-8 character,
    the output's text must still hold only output text (found by bench.py's random
    prompts: the first output token brought the last prompt words with it)."""
    tok = make_tiny_tokenizer(tempfile.mkdtemp())
    head, tail = tok.encode("é", add_special_tokens=False)          # two byte tokens, no merge
    prompt = tok.encode("Hello, my name is", add_special_tokens=False) + [head]
    d = IncrementalDetokenizer(tok, prompt)
    text = "".join(d.step(t) for t in [tail] + tok.encode(" Paris", add_special_tokens=False))
    assert "name" not in text and text.endswith(" Paris")
