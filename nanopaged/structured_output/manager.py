"""Structured outputs: keep a sequence inside a language, one token mask per step.

A request with `SamplingParams.structured_outputs` (a JSON schema, a regex, a list of
choices or a grammar) must produce text of that language. The grammar library
(llguidance) turns the constraint into a *matcher*: a parser that has read the
sequence's output so far and can say, for every token of the vocabulary, whether the
text stays a prefix of some string of the language if that token comes next. That
answer is a bitmask of ceil(vocab_size / 32) int32 words per sequence; the model
runner sets the logit of every forbidden token to -inf before sampling, so whatever
the sampler draws (greedy or at any temperature) keeps the output valid.

Who does what (vLLM v1's split, `vllm/v1/structured_output/`):

- the Processor checks the spec when the request arrives (`grammar_spec`,
  `validate`): a bad schema or regex is a ValueError before any work is done;
- the scheduler gives each constrained sequence its own matcher when the request is
  added (`StructuredOutputManager.grammar_for`: compiled once per distinct spec, then
  copied) and keeps it in its table by seq_id (StructuredOutputScheduler.grammars),
  feeds it every token it appends (`Grammar.accept_token`) and finishes the sequence
  when the matcher says the language allows nothing more;
- after each schedule(), `StructuredOutputManager.grammar_bitmask` fills the mask of
  every constrained row that samples in that step: a `GrammarOutput` message
  (messages.py here) to the runner, which applies it to the logits
  (sampler.apply_grammar_bitmask).

The matcher state lives only here, in the core, beside the tokens it has read: a
preempted sequence (swap or recompute) keeps its tokens and so its matcher; the runner
never sees one. Why llguidance and not xgrammar, and how the mask meets async
scheduling: chapters/18-structured-outputs.md.
"""
from __future__ import annotations

import json
import logging
import time

import torch

from ..sampling_params import StructuredOutputsParams
from ..utils.checks import check_json_nesting
from ..utils.math_utils import cdiv
from .messages import GrammarOutput

logger = logging.getLogger(__name__)


# The whitespace a JSON constraint allows between two JSON tokens, by default: up to 4
# spaces or tabs, or one line break with up to 32 of them after it (pretty-printed JSON
# to nesting depth 8 at 4 spaces). vLLM allows any run of whitespace there
# ([ \t\n\r]+); with that, SmolLM2-135M at temperature 1.0 spent all 160 of its
# max_tokens on newlines in 1 of 40 samples (the test in test_structured_outputs.py),
# so its JSON never closed. A bounded run ends that; the structure still leaves
# the model free to indent as it likes.
DEFAULT_JSON_WHITESPACE = r"[ \t]{0,4}(\n[ \t]{0,32})?"


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for a constraint; the key of the cache.

    JSON schemas and json_object allow DEFAULT_JSON_WHITESPACE between tokens unless
    whitespace_pattern or disable_any_whitespace (none at all) says otherwise.
    choice becomes the Lark grammar `start: "a" | "b" | ...`; grammar accepts Lark
    or GBNF.

    Raises:
        ValueError: json that is not JSON text or a dict, or JSON text nested deeper
            than MAX_NESTING_DEPTH (utils/checks.py); a grammar that cannot be read as
            Lark or GBNF. The message names the field.
    """
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            check_json_nesting("StructuredOutputsParams.json", schema)    # json.loads recurses
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON object (a schema), got "
                             f"{type(schema).__name__}")
        if params.whitespace_pattern is not None:
            options = {"whitespace_pattern": params.whitespace_pattern}
        elif params.disable_any_whitespace:
            options = {"whitespace_flexible": False}
        else:
            options = {"whitespace_pattern": DEFAULT_JSON_WHITESPACE}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"StructuredOutputsParams.grammar: {e}") from None


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the field and llguidance's message (with the position)
    if the constraint does not compile: an invalid schema, a regex with an unclosed
    group, a grammar with a syntax error. No tokenizer needed (the Processor's check)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_spec(params))
    if error:
        raise ValueError(f"StructuredOutputsParams.{params.kind} does not compile: {error}")


class Grammar:
    """One sequence's matcher (vLLM's StructuredOutputGrammar): what it has read decides
    which tokens may come next.

    Attributes:
        matcher: the llguidance.LLMatcher.
        terminated: the language is complete: the matcher allows nothing more (it read
            the last character of a choice, a fully matched regex, or an eos token at
            a point where the language may end).
    """

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.terminated = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the matcher refused it (only possible
        if the token was drawn without this step's mask); it is then in an error state."""
        if self.terminated:
            return True
        ok = self.matcher.consume_token(token_id)
        self.terminated = self.matcher.is_stopped()
        return ok

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of token_ids, from the first, the matcher would accept in a row (its
        state unchanged): speculative decoding cuts a sequence's drafts there, so a
        proposal the grammar forbids is rejected at its position (vLLM v1 does the same;
        StructuredOutputScheduler._num_tokens_allowed)."""
        return 0 if self.terminated else self.matcher.validate_tokens(token_ids)

    def allowed_token_ids(self) -> list[int]:
        """The token ids the matcher allows next (for the tracer and the course: the
        engine itself only ever uses the packed bitmask)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten().nonzero().flatten().tolist()

    def error(self) -> str:
        """The matcher's error message, "" if none."""
        return self.matcher.get_error()


class StructuredOutputManager:
    """Compiles constraints (once per distinct spec) and fills the step's bitmask
    (vLLM v1's StructuredOutputManager, `vllm/v1/structured_output/__init__.py`).

    Args:
        model_path: the model folder; its tokenizer is loaded on the first
            constrained request (the core has no tokenizer otherwise).
        vocab_size: the model's vocabulary size (the width of its logits, in tokens).

    Attributes:
        num_compiled: distinct specs compiled so far (each one once).
        mask_seconds: total seconds spent filling bitmasks (the bench reads it).
        num_mask_rows: rows filled so far.
    """

    def __init__(self, model_path, vocab_size: int) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._ll_tokenizers: dict[frozenset[int], object] = {}
        self._compiled: dict[tuple[str, frozenset[int]], object] = {}   # spec -> a fresh matcher
        self.num_compiled = 0
        self.mask_seconds = 0.0
        self.num_mask_rows = 0
        self.mask_words = cdiv(vocab_size, 32)        # int32 words per bitmask row

    def _ll_tokenizer(self, eos_token_ids: frozenset[int]):
        """llguidance's view of the tokenizer (each token's bytes), built once per set
        of eos ids: it walks the whole vocabulary."""
        tok = self._ll_tokenizers.get(eos_token_ids)
        if tok is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.model_path)
            tok = llguidance.hf.from_tokenizer(hf, max(self.vocab_size, len(hf)),
                                               eos_token=sorted(eos_token_ids) or None)
            self._ll_tokenizers[eos_token_ids] = tok
            self.mask_words = cdiv(tok.vocab_size, 32)
        return tok

    def grammar_for(self, params: StructuredOutputsParams, eos_token_ids: frozenset[int]) -> Grammar:
        """A new matcher for one sequence, in the start state. The first request with a
        given spec compiles it (a few ms for a nested JSON schema); later ones, and a
        request's other n - 1 sequences, get a copy of the compiled matcher.

        Raises:
            ValueError: the spec does not compile (llguidance's message).
        """
        import llguidance

        spec = grammar_spec(params)
        key = (spec, eos_token_ids)
        template = self._compiled.get(key)
        if template is None:
            template = llguidance.LLMatcher(self._ll_tokenizer(eos_token_ids), spec, log_level=0)
            if template.is_error():
                raise ValueError(f"StructuredOutputsParams.{params.kind} does not compile: {template.get_error()}")
            self._compiled[key] = template
            self.num_compiled += 1
        return Grammar(template.deep_copy())

    def grammar_bitmask(self, seq_ids: list[int], drafts: dict[int, list[int]],
                        grammars: dict[int, Grammar | None]) -> GrammarOutput:
        """The bitmask of a step's constrained rows, one per seq id of `seq_ids`, in that
        order. `grammars` maps those seq ids to their current Grammar, or None for a
        sequence that finished since it was scheduled (async scheduling): its row allows
        every token, and the token drawn there is discarded anyway.

        Bit j of word w of a row is token 32 * w + j: 1 = allowed.

        A sequence verifying drafts d (drafts[seq_id], speculative decoding) has k + 1
        rows in a row: row j is the mask after d[:j], so the matcher reads each draft
        before the next row and is rolled back to where it was at the end.
        """
        start = time.perf_counter()
        bitmask = torch.full((len(seq_ids), self.mask_words), -1, dtype=torch.int32)
        num_read: dict[int, int] = {}           # seq_id -> drafts its matcher has read here
        for row, seq_id in enumerate(seq_ids):
            grammar = grammars.get(seq_id)
            if grammar is None:
                continue
            if seq_id in num_read:              # the next row of a verifying sequence
                grammar.matcher.consume_token(drafts[seq_id][num_read[seq_id]])
                num_read[seq_id] += 1
            else:
                num_read[seq_id] = 0
            # llguidance writes the row in place
            grammar.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), 4 * self.mask_words)
        for seq_id, n in num_read.items():
            if n:
                grammars[seq_id].matcher.rollback(n)
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_rows += len(seq_ids)
        return GrammarOutput(list(seq_ids), bitmask)
