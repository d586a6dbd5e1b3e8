"""check_stop: has the token a sequence just got finished it?

After each forward pass the scheduler appends every sampled token (update_from_output)
and asks this file whether the sequence is done, by vLLM's rules and in vLLM's order:
an eos or a stop token id (once min_tokens are out), then max_tokens, then
max_model_len. It only answers; the scheduler finishes the sequence and frees its
blocks. Stop *strings* need text, so the OutputProcessor checks them.
vLLM: `vllm/v1/core/sched/utils.py` (`check_stop`); v0's
`vllm/engine/output_processor/stop_checker.py` (`StopChecker`).
"""
from __future__ import annotations

from .sequence import Sequence, SequenceGroup, SequenceStatus


def check_stop(seq: Sequence, group: SequenceGroup, max_model_len: int) -> SequenceStatus | None:
    """The finished status seq's last output token gives it, or None when it goes on.

    In this order: eos (unless ignore_eos), then a stop token id, once min_tokens are
    out: FINISHED_STOPPED; seq.stop_reason is set to the token only for a stop token
    id the user asked for, and stays None for an eos (vLLM's rule: stop_reason is a
    stop string or a stop_token_ids id, never the eos; tests/engine/test_admission.py::
    test_stop_reason_is_none_on_eos_and_the_id_for_a_stop_token_id). Then max_tokens
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
