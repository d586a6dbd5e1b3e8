"""Speculative decoding's messages: the base step messages with the drafts added.

The scheduler sends a SpecDecodeSchedulerOutput (SpecDecodeScheduler.scheduler_output_cls)
and the runner answers a SpecDecodeModelRunnerOutput (SpecDecodeModelRunner.runner_output_cls);
each is the base message (messages.py) plus the fields below, registered here to cross
hosts (utils/codec.py). vLLM v1 keeps the same fields on its base messages
(`vllm/v1/core/sched/output.py`, `vllm/v1/outputs.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..messages import ModelRunnerOutput, SchedulerOutput
from ..utils import codec


@dataclass
class SpecDecodeSchedulerOutput(SchedulerOutput):
    """SchedulerOutput plus the drafts each sequence verifies.

    Attributes:
        scheduled_spec_decode_tokens: seq_id -> the draft tokens it verifies this step
            (vLLM v1's name). Its num_scheduled_tokens counts them: 1 + len(drafts), its
            last token and then the drafts, and the step samples one row per position
            (k + 1 rows). (With structured outputs, such a sequence has k + 1 mask rows
            too, one per position: structured_output/scheduler.py.)
    The blocks rolled back past the accepted drafts are the base field
    num_blocks_taken_back.
    """

    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class SpecDecodeModelRunnerOutput(ModelRunnerOutput):
    """ModelRunnerOutput plus what the drafts came to, and the next ones.

    Attributes:
        num_accepted_tokens: seq_id -> how many of its drafts (scheduled_spec_decode_tokens,
            in order) it accepted, for sequences that verified drafts this step. Its new
            tokens are drafts[:num_accepted] + [sampled_token_ids[seq_id]]: its
            sampled_token_ids entry is the token after the accepted drafts (the target's
            own token where it rejected one, or the bonus token when it accepted all).
        draft_token_ids: seq_id -> the tokens proposed for its next step (may be empty).
            They follow the tokens this step gave it.
    """

    num_accepted_tokens: dict[int, int] = field(default_factory=dict)
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)


codec.register(SpecDecodeSchedulerOutput, SpecDecodeModelRunnerOutput)
