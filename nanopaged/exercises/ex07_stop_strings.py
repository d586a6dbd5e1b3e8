"""Exercise 7 (chapter 07): stop strings, and the hold-back that keeps a stream honest."""
from __future__ import annotations

NUMBER = 7
CHAPTER = "07-engine-loop.md"
TITLE = "Stop strings and the streaming hold-back"
TARGETS = ["nanopaged.engine.output_processor:check_stop_strings",
           "nanopaged.engine.output_processor:_completion_output"]
TASK = """
Write the text side of stopping and streaming, which the OutputProcessor runs after every
step. `check_stop_strings` (defined in detokenizer.py) finds a stop string that the
step's new text completes and says where to cut the text; `_completion_output` builds
what a user is shown of a completion: all of it, or in DELTA mode only what is new,
holding back the last characters of a running completion that might be the start of a
stop string, because text once shown cannot be taken back. Every request the engine
serves is detokenized, stopped and streamed by your code.
"""
HINT = """
check_stop_strings: a match the previous call did not see must end inside the new text,
so search each stop string s only from max(0, len(text) - new_char_count - len(s) + 1)
(str.find has a start argument). Among matches, the one whose end comes first wins, the
longer (earlier start) on a tie. Return (s, cut) with cut = its end if include_in_output,
else its start; None when nothing matches (or nothing is new, or stop is empty).

_completion_output: a running completion (comp.finished is False) shows its text up to
len(comp.text) - stop_buffer_length (not below 0); a finished one shows all of it. In
DELTA mode it shows text from comp.num_shown_chars and token ids (and logprob dicts)
from comp.num_shown_tokens, then moves those two counters on. The result is a
CompletionOutput (outputs.py) carrying comp's index, finish_reason, stop_reason,
cumulative_logprob and score as they are.
"""


def check_finds_and_cuts():
    """a stop string that ends in the new text is found: the text is cut before it (after it with include_in_output)"""
    from nanopaged.engine.output_processor import check_stop_strings

    text = "The capital is Paris. Next"
    cases = [(("Paris", 6), None),                               # "Paris" ended before the new text
             (("Paris", 14), ("Paris", 15)), ((". N", 6), (". N", 20)), (("xyz", 26), None),
             (("Next", 0), None)]
    for (s, new), want in cases:
        got = check_stop_strings(text, new, [s], False)
        assert got == want, (f"text {text!r}, its last {new} characters new, stop [{s!r}]: you returned {got}, "
                             f"want {want}")
    got = check_stop_strings(text, 14, ["Paris"], True)
    assert got == ("Paris", 20), \
        f"the same with include_in_output=True: you returned {got}, want ('Paris', 20) (cut after the match)"
    assert check_stop_strings(text, 14, [], False) is None, "no stop strings: want None"


def check_only_new_matches():
    """only a match the previous call could not see counts: it must end in the new text, though it may start before it"""
    from nanopaged.engine.output_processor import check_stop_strings

    text = "abc stop abc sto"
    assert check_stop_strings(text, 3, ["stop"], False) is None, (
        f"text {text!r} (last 3 new): 'stop' ended long before the new text; a previous call reported it "
        "already, so this one must return None")
    text += "p"
    got = check_stop_strings(text, 1, ["stop"], False)
    assert got == ("stop", 13), (f"text {text!r}, only the final 'p' new: 'stop' starts before the new text and ends "
                                 f"in it; you returned {got}, want ('stop', 13)")
    got = check_stop_strings("aaaa", 1, ["aa"], False)
    assert got == ("aa", 2), f"text 'aaaa', the last 'a' new, stop ['aa']: you returned {got}, want ('aa', 2)"


def check_first_match_wins():
    """when several stop strings match, the one that ends first wins (the longer one on a tie), whatever their order in the list"""
    from nanopaged.engine.output_processor import check_stop_strings

    text = "one two three"
    for stop, want in ((["three", "two"], ("two", 4)), (["two", "three"], ("two", 4)),
                       (["o", "two"], ("o", 0)), (["wo", "two"], ("two", 4)), (["th", "wo", "two"], ("two", 4))):
        got = check_stop_strings(text, len(text), stop, False)
        assert got == want, f"text {text!r}, all of it new, stop {stop}: you returned {got}, want {want}"


def check_hold_back_and_deltas():
    """a running completion holds back its last len(longest stop) - 1 characters; in DELTA mode the pieces add up to the whole text"""
    from nanopaged.engine.output_processor import CompletionState, _completion_output

    steps = [("Hel", [1], None), ("Hello wo", [2, 3], None), ("Hello world", [4], None),
             ("Hello world!", [5], "stop")]
    comp, cumulative = CompletionState(0, None, want_logprobs=False), CompletionState(0, None, False)
    shown_delta, shown_cumulative = [], []
    for text, ids, finish in steps:
        for c in (comp, cumulative):
            c.text, c.token_ids, c.finish_reason = text, c.token_ids + ids, finish
        d = _completion_output(comp, 2, delta=True)
        shown_delta.append((d.text, d.token_ids, d.finish_reason))
        shown_cumulative.append(_completion_output(cumulative, 2, delta=False).text)
    want = ["H", "Hello ", "Hello wor", "Hello world!"]
    assert shown_cumulative == want, (f"hold back 2 characters while running, cumulative mode: shown "
                                      f"{shown_cumulative}, want {want} (all of it once finished)")
    want = [("H", [1], None), ("ello ", [2, 3], None), ("wor", [4], None), ("ld!", [5], "stop")]
    assert shown_delta == want, f"the same in DELTA mode: shown (text, token_ids, finish_reason) {shown_delta}, want {want}"
    short = CompletionState(0, None, False)
    short.text, short.token_ids = "ab", [9]
    got = _completion_output(short, 5, delta=True).text
    assert got == "", f"a running text of 2 characters, holding back 5: shown {got!r}, want ''"


def _letters(tokenizer):
    return [i for i in range(320) if tokenizer.decode([i]).strip()
            and all(c.isascii() and (c.isalpha() or c == " ") for c in tokenizer.decode([i]))]


def _stream(requests):
    """Stream requests on the tiny model: {request_id: [(text, token_ids, finish_reason, stop_reason) per output]}."""
    from nanopaged import LLM

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=64, attention_backend="torch")
    engine, seen = llm.engine, {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            for c in o.outputs:
                seen.setdefault(f"{o.request_id}[{c.index}]", []).append(
                    (c.text, list(c.token_ids), c.finish_reason, c.stop_reason))
    return seen


def check_engine_streams_the_same():
    """streamed with stop strings (DELTA and cumulative), the engine shows the same pieces and stops at the same place on your code"""
    from transformers import AutoTokenizer

    from nanopaged import SamplingParams
    from nanopaged.sampling_params import RequestOutputKind

    from . import engines_own, tiny_model_folder

    go = dict(temperature=0, max_tokens=16, ignore_eos=True,     # letters only: printable text
              allowed_token_ids=_letters(AutoTokenizer.from_pretrained(tiny_model_folder())))
    delta = RequestOutputKind.DELTA
    requests = {"ish": ("Hello, my name is", SamplingParams(stop=["ish"], output_kind=delta, **go)),
                "two": ("Hello, my name is", SamplingParams(stop=["ance", "an"], output_kind=delta, **go)),
                "include": ("Hello, my name is", SamplingParams(stop=["Par"], include_stop_str_in_output=True,
                                                               output_kind=delta, **go)),
                "cumulative": ("The capital of France is", SamplingParams(stop=["xyz", "ed", "it"], **go))}
    got = _stream(requests)
    with engines_own():
        want = _stream(requests)
    assert any(w[-1][3] is not None for w in want.values()), "(setup) no stop string matched in the engine's own run"
    for rid in want:
        g, w = got.get(rid, []), want[rid]
        if g == w:
            continue
        i = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        yours = g[i] if i < len(g) else "nothing"
        params = requests[rid[:-3]][1]
        raise AssertionError(
            f"request {rid} ({params.output_kind.name}, stop {params.stop}): its output {i} (text, token_ids, "
            f"finish_reason, stop_reason) was {yours} with your code, {w[i] if i < len(w) else 'nothing'} with the "
            f"engine's own; the texts shown: {[t for t, *_ in g]} vs {[t for t, *_ in w]}")


CHECKS = [check_finds_and_cuts, check_only_new_matches, check_first_match_wins, check_hold_back_and_deltas,
          check_engine_streams_the_same]
