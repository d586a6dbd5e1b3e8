"""StructuredOutputScheduler: the scheduler's side of structured outputs (chapter 18).

It gives each constrained sequence its own matcher when the request is added, feeds it
every token appended (a complete language stops the sequence: `check_grammar_stop`),
lists the step's constrained rows in the runner message (structured_output_seq_ids),
and fills their masks on demand (`get_grammar_bitmask`, which the engine core calls
between the forward and sampling). The matchers are structured_output.py's.
vLLM v1: the structured-output calls of `vllm/v1/core/sched/scheduler.py`.
"""
from __future__ import annotations

import logging

from ..messages import EngineCoreRequest, GrammarOutput, SchedulerOutput
from ..core.scheduler import Scheduler
from ..core.scheduler_output import ScheduledStep
from ..core.sequence import Sequence, SequenceGroup, SequenceStatus
from .manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def check_grammar_stop(seq: Sequence, request_id: str, token: int) -> SequenceStatus | None:
    """Feed seq's new token to its matcher; the finished status that gives it, or None
    (also without a grammar). FINISHED_STOPPED when the language allows nothing more;
    FINISHED_ABORTED, logged, when the token breaks the grammar (the mask was not applied)."""
    if seq.grammar is None:
        return None
    if not seq.grammar.accept_token(token):
        logger.error("request %r: token %d breaks its structured output (%s); aborting it",
                     request_id, token, seq.grammar.error())
        return SequenceStatus.FINISHED_ABORTED
    return SequenceStatus.FINISHED_STOPPED if seq.grammar.terminated else None


class StructuredOutputScheduler(Scheduler):
    """The scheduler with matchers for requests with SamplingParams.structured_outputs.

    Attributes:
        structured_output_manager: compiles the matchers and fills the masks; the engine
            core sets it (None: a constrained request is a ValueError at add_request).
    """

    structured_output_manager: StructuredOutputManager | None = None

    def _make_group(self, request: EngineCoreRequest) -> SequenceGroup:
        """Each sequence gets its own matcher (the n samples diverge).

        Raises:
            ValueError: with beam search, without a manager, or a spec that does not compile.
        """
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and request.beam_search is not None:
            raise ValueError("structured_outputs work with sampling only, not with beam search")
        if constraint is not None and self.structured_output_manager is None:
            raise ValueError("this scheduler has no StructuredOutputManager")
        group = super()._make_group(request)
        for seq in group.seqs if constraint is not None else []:
            seq.grammar = self.structured_output_manager.grammar_for(constraint, request.eos_token_ids)
        return group

    def _check_stop(self, seq: Sequence, group: SequenceGroup, token: int) -> SequenceStatus | None:
        status = super()._check_stop(seq, group, token)
        return check_grammar_stop(seq, group.request_id, token) or status     # the grammar's word wins

    def _after_schedule(self, step: ScheduledStep, samples: list[bool], out: SchedulerOutput) -> None:
        """The constrained rows that sample: a row per position verified, then the forks'."""
        super()._after_schedule(step, samples, out)
        for s, sample in zip(step.scheduled, samples):
            if sample and s.seq.grammar is not None:
                out.structured_output_seq_ids += [s.seq.seq_id] * (1 + len(s.spec_token_ids))
                out.structured_output_seq_ids += [f.seq_id for f in s.forks]

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput:
        """The masks of a scheduled step's constrained rows, from their matchers as they are
        now. Call it once, before the step is taken in (async: while its forward runs)."""
        grammars = {}
        for seq_id in scheduler_output.structured_output_seq_ids:
            seq = self.queues.seqs.get(seq_id, (None,))[0]
            grammars[seq_id] = seq.grammar if seq is not None and not seq.status.is_finished else None
        return self.structured_output_manager.grammar_bitmask(scheduler_output, grammars)
