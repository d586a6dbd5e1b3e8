"""Exercise 18 (chapter 18): a grammar's token bitmask, applied to the logits."""
from __future__ import annotations

NUMBER = 18
CHAPTER = "18-structured-outputs.md"
TITLE = "apply_grammar_bitmask: forbidden tokens get -inf"
TARGETS = ["nanopaged.worker.sampler:apply_grammar_bitmask"]
TASK = """
Structured outputs end in one small function. The grammar library fills, for each
constrained row of the step, a bitmask over the vocabulary: int32 words, bit j of word
w standing for token 32 * w + j, 1 = allowed. Before anything is sampled, every token
a row's mask forbids must get the logit -inf, so that the sampler cannot draw it.
Write `apply_grammar_bitmask`: in place, only in the rows listed, with tokens past the
mask's width forbidden too.
"""
HINT = """
Unpack the bits: (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
gives [rows, words, 32], and .flatten(1) puts token 32 * w + j at column 32 * w + j.
Careful with bit 31: it is the sign bit of an int32, and >> keeps the sign; & 1 still
gives the right bit. Pad (with False) or cut the result to the logits' vocabulary
width. Then logits[rows] = logits[rows].masked_fill(~allowed, float("-inf")) with rows
as an index tensor (mask row i goes to logits row rows[i]; the rows need not be in
order). No rows: nothing to do.
"""


def _words(allowed: list[set[int]], num_words: int):
    """int32 bitmask [len(allowed), num_words] allowing the given token ids per row."""
    import torch

    mask = torch.zeros(len(allowed), num_words, dtype=torch.int64)
    for i, tokens in enumerate(allowed):
        for t in tokens:
            mask[i, t // 32] |= 1 << (t % 32)
    return torch.where(mask >= 1 << 31, mask - (1 << 32), mask).to(torch.int32)   # as int32 bits


def _forbidden(row) -> set[int]:
    return {i for i, v in enumerate(row.tolist()) if v == float("-inf")}


def check_bits():
    """bit j of word w is token 32*w + j: the allowed tokens keep their logits, every other one gets -inf (bits 0, 31 and 63 too)"""
    import torch

    from nanopaged.worker.sampler import apply_grammar_bitmask

    vocab = 64
    allowed = [{0, 5, 31, 32, 63}, {1, 30, 33, 62}, set(range(64)) - {31}]
    logits = torch.arange(3 * vocab, dtype=torch.float32).reshape(3, vocab)
    original = logits.clone()
    apply_grammar_bitmask(logits, [0, 1, 2], _words(allowed, 2))
    for i, ok in enumerate(allowed):
        want = set(range(vocab)) - ok
        got = _forbidden(logits[i])
        assert got == want, (f"row {i} allows tokens {sorted(ok) if len(ok) < 10 else 'all but 31'}: you set "
                             f"-inf on {sorted(got)[:12]}{'...' if len(got) > 12 else ''}, it should be "
                             f"{sorted(want)[:12]}{'...' if len(want) > 12 else ''}")
        kept = [t for t in ok if logits[i, t] != original[i, t]]
        assert not kept, f"row {i}: the allowed tokens {kept} had their logits changed"


def check_rows():
    """only the listed rows change, mask row i going to logits row rows[i] (in any order); no rows, no change"""
    import torch

    from nanopaged.worker.sampler import apply_grammar_bitmask

    logits = torch.randn(4, 40)
    original = logits.clone()
    apply_grammar_bitmask(logits, [], torch.zeros(0, 2, dtype=torch.int32))
    assert torch.equal(logits, original), "with no rows, the logits changed"
    apply_grammar_bitmask(logits, [3, 1], _words([{7}, {8, 9}], 2))
    for row, want in ((0, set()), (1, set(range(40)) - {8, 9}), (2, set()), (3, set(range(40)) - {7})):
        got = _forbidden(logits[row])
        assert got == want, (f"rows [3, 1], masks allowing {{7}} and {{8, 9}}: logits row {row} has -inf on "
                             f"{len(got)} tokens, it should have {len(want)}"
                             + (" (it is not listed: it must not change)" if not want else
                                f" (all but {sorted(set(range(40)) - want)})"))
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2]), "a row not listed changed"


def check_widths():
    """a mask narrower than the vocabulary forbids the tokens past it; a wider one's extra bits are ignored"""
    import torch

    from nanopaged.worker.sampler import apply_grammar_bitmask

    narrow = torch.zeros(1, 40)                          # 40 tokens, one word of mask: 32..39 forbidden
    apply_grammar_bitmask(narrow, [0], _words([{2, 31}], 1))
    want = set(range(40)) - {2, 31}
    assert _forbidden(narrow[0]) == want, (f"vocabulary 40, a mask of 1 word allowing {{2, 31}}: -inf on "
                                           f"{sorted(_forbidden(narrow[0]))}, it should be {sorted(want)}")
    wide = torch.zeros(1, 40)                            # 3 words = 96 bits for 40 tokens
    apply_grammar_bitmask(wide, [0], _words([{0, 39, 40, 95}], 3))
    assert wide.shape == (1, 40) and _forbidden(wide[0]) == set(range(1, 39)), (
        f"vocabulary 40, a mask of 3 words allowing {{0, 39, 40, 95}}: logits of shape {list(wide.shape)}, "
        f"-inf on {sorted(_forbidden(wide[0]))}, it should be 1..38 only")


def check_engine_follows_the_grammar():
    """the engine on your mask: a regex [0-9]{3}-[a-z]{2} and a choice, n=2 at temperature 1: outputs that match, and the engine's own tokens"""
    import logging
    import re

    from nanopaged import LLM, SamplingParams, StructuredOutputsParams

    from . import same_as_engines_own, tiny_model_folder

    pattern, choices = r"[0-9]{3}-[a-z]{2}", ["Paris", "London", "Rome"]
    params = [SamplingParams(n=2, temperature=1.0, seed=s, max_tokens=20, structured_outputs=c)
              for s, c in ((1, StructuredOutputsParams(regex=pattern)), (2, StructuredOutputsParams(choice=choices)))]
    prompts = [[1, 2, 3, 4], list(range(20, 30))]
    engine_args = dict(preemption_mode="recompute", num_cpu_blocks=0)
    # A token that breaks the grammar gets the sequence aborted, with a long warning
    # from the scheduler; the check says it in a line instead.
    log = logging.getLogger("nanopaged.core.scheduler")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=64, attention_backend="torch", **engine_args)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, ok, what in ((outs[0], lambda t: re.fullmatch(pattern, t), f"a match of {pattern}"),
                              (outs[1], lambda t: t in choices, f"one of {choices}")):
            for c in out.outputs:
                assert ok(c.text), (f"a completion is {c.text!r} (finish_reason {c.finish_reason}), not {what}"
                                    + (": the scheduler aborted it when a token the grammar forbids was drawn"
                                       if c.finish_reason == "abort" else ""))
        same_as_engines_own(prompts, params, **engine_args)
    finally:
        log.setLevel(level)


CHECKS = [check_bits, check_rows, check_widths, check_engine_follows_the_grammar]
