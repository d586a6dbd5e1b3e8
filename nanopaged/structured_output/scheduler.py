"""StructuredOutputScheduler: the scheduler's side of structured outputs (chapter 18).

It gives each constrained sequence its own matcher when the request is added, in its
table by seq_id (`grammars`; dropped when the request leaves), feeds it every token
appended (a complete language stops the sequence: `check_grammar_stop`), notes each
step's constrained rows that sample when it is scheduled, and fills their masks on
demand (`get_grammar_bitmask`, which the engine core calls between the forward and
sampling). The matchers are manager.py's. The runner needs no list of the rows: each
sequence's SamplingParams say whether it is constrained (model_runner.py here).

Structured outputs meet speculative decoding over the drafts and nowhere else. Going in,
spec_decode/scheduler.py's take_drafts asks the scheduler hook `_num_tokens_allowed`
(core/scheduler.py) how many of a sequence's proposals the grammar allows, which this
class answers with the matcher (Grammar.validate_tokens), and cuts them there. Coming
out, the drafts a step verifies are named by its message (`scheduled_spec_decode_tokens`,
set by speculative decoding's scheduler before this class's `_after_schedule` runs; vLLM's
grammar bitmask reads the same field), and get a mask row each, the mask after the drafts
before it (manager.grammar_bitmask).
vLLM v1: the structured-output calls of `vllm/v1/core/sched/scheduler.py`.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from ..messages import EngineCoreRequest, SchedulerOutput
from ..core.scheduler import Scheduler
from ..core.scheduler_output import ScheduledStep
from ..core.sequence import Sequence, SequenceGroup, SequenceStatus
from .manager import Grammar, StructuredOutputManager
from .messages import GrammarOutput

logger = logging.getLogger(__name__)


def check_grammar_stop(grammar: Grammar | None, request_id: str, token: int) -> SequenceStatus | None:
    """Feed a sequence's new token to its matcher; the finished status that gives it, or
    None (also without a grammar). FINISHED_STOPPED when the language allows nothing
    more; FINISHED_ABORTED, logged, when the token breaks the grammar (the mask was not
    applied)."""
    if grammar is None:
        return None
    if not grammar.accept_token(token):
        logger.error("request %r: token %d breaks its structured output (%s); aborting it",
                     request_id, token, grammar.error())
        return SequenceStatus.FINISHED_ABORTED
    return SequenceStatus.FINISHED_STOPPED if grammar.terminated else None


@dataclass
class _ConstrainedRows:
    """A scheduled step's constrained rows, kept until its masks are made."""

    message: weakref.ref              # the step's SchedulerOutput (its id is the key)
    seq_ids: list[int]                # the sequence of each row, in the runner's order
    drafts: dict[int, list[int]]      # seq_id -> the drafts it verifies (a row per position)


class StructuredOutputScheduler(Scheduler):
    """The scheduler with matchers for requests with SamplingParams.structured_outputs.

    Attributes:
        structured_output_manager: compiles the matchers and fills the masks; the engine
            core sets it (None: a constrained request is a ValueError at add_request).
        grammars: seq_id -> its matcher (manager.Grammar), which has read every token of
            its output_token_ids, for each constrained sequence; kept across preemption
            (it keeps its tokens), dropped when its request leaves.
    """

    structured_output_manager: StructuredOutputManager | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grammars: dict[int, Grammar] = {}
        # id(step message) -> its constrained rows, from schedule() until get_grammar_bitmask
        self._rows: dict[int, _ConstrainedRows] = {}

    def _make_group(self, request: EngineCoreRequest) -> SequenceGroup:
        """Each sequence gets its own matcher (the n samples diverge).

        Raises:
            ValueError: without a manager, or a spec that does not compile.
        """
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and self.structured_output_manager is None:
            raise ValueError("this scheduler has no StructuredOutputManager")
        group = super()._make_group(request)
        if constraint is not None:
            grammars = {s.seq_id: self.structured_output_manager.grammar_for(constraint, request.eos_token_ids)
                        for s in group.seqs}
            self.grammars.update(grammars)          # all or none: grammar_for may raise
        return group

    def _request_removed(self, group: SequenceGroup) -> None:
        super()._request_removed(group)
        for seq in group.seqs:
            self.grammars.pop(seq.seq_id, None)

    def _check_stop(self, seq: Sequence, group: SequenceGroup, token: int) -> SequenceStatus | None:
        status = super()._check_stop(seq, group, token)
        grammar = self.grammars.get(seq.seq_id)
        return check_grammar_stop(grammar, group.request_id, token) or status     # the grammar's word wins

    def _num_tokens_allowed(self, seq: Sequence, token_ids: list[int]) -> int:
        """Where structured outputs meet speculative decoding (the module doc): a
        constrained sequence's proposals are cut before the first one its grammar forbids."""
        grammar = self.grammars.get(seq.seq_id)
        allowed = super()._num_tokens_allowed(seq, token_ids)
        return allowed if grammar is None else min(allowed, grammar.validate_tokens(token_ids))

    def _after_schedule(self, step: ScheduledStep, samples: list[bool], out: SchedulerOutput) -> None:
        """The constrained rows that sample: a row per position verified, then the forks'."""
        super()._after_schedule(step, samples, out)
        verified = getattr(out, "scheduled_spec_decode_tokens", {})     # where drafts meet (module doc)
        seq_ids, drafts = [], {}
        for s, sample in zip(step.scheduled, samples):
            if sample and s.seq.seq_id in self.grammars:
                own = verified.get(s.seq.seq_id, [])
                seq_ids += [s.seq.seq_id] * (1 + len(own))
                seq_ids += [f.seq_id for f in s.forks]
                if own:
                    drafts[s.seq.seq_id] = list(own)
        for key in [k for k, rows in self._rows.items() if rows.message() is None]:
            del self._rows[key]                 # a step that failed before its masks were made
        if seq_ids:
            self._rows[id(out)] = _ConstrainedRows(weakref.ref(out), seq_ids, drafts)

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The masks of a scheduled step's constrained rows, from their matchers as they are
        now; None when the step has none. Call it once, before the step is taken in
        (async: while its forward runs)."""
        rows = self._rows.pop(id(scheduler_output), None)
        if rows is None or rows.message() is not scheduler_output:
            return None
        grammars = {}
        for seq_id in rows.seq_ids:
            seq = self.queues.seqs.get(seq_id, (None,))[0]
            grammars[seq_id] = self.grammars.get(seq_id) if seq is not None and not seq.status.is_finished else None
        return self.structured_output_manager.grammar_bitmask(rows.seq_ids, rows.drafts, grammars)
