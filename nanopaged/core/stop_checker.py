"""check_stop: has the token a sequence just got finished it?

After each forward pass the scheduler appends every sampled token (update_from_output)
and asks this file whether the sequence is done, by vLLM's rules and in vLLM's order:
an eos or a stop token id (once min_tokens are out), then max_tokens, then
max_model_len. It only answers; the scheduler finishes the sequence and frees its
blocks. A structured output also stops once its grammar is complete
(`check_grammar_stop`). Stop *strings* need text, so the OutputProcessor checks them.
vLLM: `vllm/v1/core/sched/utils.py` (`check_stop`); v0's
`vllm/engine/output_processor/stop_checker.py` (`StopChecker`).
"""
from __future__ import annotations

import logging

from .sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


def check_stop(seq: Sequence, group: SequenceGroup, max_model_len: int) -> SequenceStatus | None:
    """The finished status seq's last output token gives it, or None when it goes on.

    In this order: eos (unless ignore_eos), then a stop token id, once min_tokens are
    out: FINISHED_STOPPED; seq.stop_reason is set to the token only for a stop token
    id the user asked for, and stays None for an eos (vLLM's rule: stop_reason is a
    stop string or a stop_token_ids id, never the eos; issue 34). Then max_tokens
    outputs, or prompt + output reaching max_model_len (the Processor admits only
    prompt + max_tokens <= max_model_len): FINISHED_LENGTH. seq.status is left alone:
    the scheduler frees the blocks first, then sets it.
    """
    params, token = group.sampling_params, seq.output_token_ids[-1]
    num_out = len(seq.output_token_ids)
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token in group.request.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in params.stop_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
    if num_out >= params.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None


def check_grammar_stop(seq: Sequence, request_id: str, token: int) -> SequenceStatus | None:
    """Feed the token seq just got to its structured-output matcher (structured_output.py);
    the finished status that gives it, or None (also when it has no grammar).

    FINISHED_STOPPED when the language allows nothing more ("stop", even on the
    max_tokens-th token). FINISHED_ABORTED, logged as an error, when the token breaks
    the grammar: that cannot happen when the step's mask was applied, and if it does,
    the output has left the language and no mask can bring it back.
    """
    if seq.grammar is None:
        return None
    if not seq.grammar.accept_token(token):
        logger.error("request %r: token %d breaks its structured output (%s); aborting it",
                     request_id, token, seq.grammar.error())
        return SequenceStatus.FINISHED_ABORTED
    return SequenceStatus.FINISHED_STOPPED if seq.grammar.terminated else None
