"""RunnerView: what the model runner knows of each sequence, so a step's message carries
only what is new to it.

The runner keeps its own record of every sequence it has seen (worker/model_runner.py:
tokens, block ids, num_computed_tokens), built from the messages alone. The scheduler
keeps this view of that record, and each SchedulerOutput (messages.py) says per sequence:

    new        (NewRequestData)      the runner has no current record: everything, in full
    cached     (CachedRequestData)   it has one: only the tokens and blocks added since
    forgotten  (finished_seq_ids)    it may drop its record

A sequence whose tokens or blocks changed other than by growing (preempted, swapped back
in, a beam that forked, a restart after a failure) is forgotten here (`forget`) and so
sent in full again. vLLM v1: `vllm/v1/core/sched/output.py` and the cached-request
bookkeeping of `vllm/v1/core/sched/scheduler.py`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..messages import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from .sequence import Sequence, SequenceGroup


class RunnerView:
    """The scheduler's view of the runner's per-sequence record.

    Args:
        async_scheduling: the runner appends its own samples (chapter 16), so after a
            step it also knows the tokens that step and the steps in flight sample.
    """

    def __init__(self, async_scheduling: bool) -> None:
        self.async_scheduling = async_scheduling
        # seq_id -> tokens the runner knows of it, for sequences whose record is current
        # (tokens only grow; anything else makes it unknown: sent in full again)
        self.known: dict[int, int] = {}
        self.finished_seq_ids: set[int] = set()        # left since the last message

    def forget(self, seq_id: int) -> None:
        """seq's record at the runner is stale (or gone): send it in full next time."""
        self.known.pop(seq_id, None)

    def finished(self, seq_id: int) -> None:
        """seq left the engine: the next message tells the runner to drop its record."""
        self.known.pop(seq_id, None)
        self.finished_seq_ids.add(seq_id)

    def message(self, scheduled: list, samples: list[bool],
                blocks_to_copy: list[tuple[int, int]], blocks_to_swap_out: list[tuple[int, int]],
                blocks_to_swap_in: list[tuple[int, int]]) -> SchedulerOutput:
        """The step's SchedulerOutput, and the view updated to what the runner will know
        after it. scheduled: the step's batch, in order (the scheduler's own records,
        ScheduledSequence of scheduler_output.py, never sent); samples[i]: scheduled[i] samples
        this step (ScheduledSequence.samples, asked before the step's tokens count).
        Reads sequences, writes none of them."""
        out = SchedulerOutput(blocks_to_copy=blocks_to_copy, blocks_to_swap_out=blocks_to_swap_out,
                              blocks_to_swap_in=blocks_to_swap_in, finished_seq_ids=self.finished_seq_ids)
        self.finished_seq_ids = set()
        cached = out.scheduled_cached_reqs
        for s, sample in zip(scheduled, samples):
            seq, start = s.seq, s.seq.num_computed_tokens
            known = self.known.get(seq.seq_id)
            if known is not None:
                cached.seq_ids.append(seq.seq_id)
                cached.new_token_ids.append(seq.output_token_ids[known - len(seq.prompt_token_ids):])
                cached.new_block_ids.append(list(seq.block_table.block_ids) if s.table_replaced
                                            else seq.block_table.block_ids[s.num_blocks_before:])
                cached.block_ids_replaced.append(s.table_replaced)
                cached.num_computed_tokens.append(start)
            else:
                out.scheduled_new_reqs.append(new_request_data(seq, s.seq_group, seq.block_table.block_ids))
            out.num_scheduled_tokens[seq.seq_id] = s.num_new_tokens
            out.total_num_scheduled_tokens += s.num_new_tokens
            # async: the runner appends its own samples, so it will know the in-flight
            # ones and this step's too
            self.known[seq.seq_id] = seq.num_tokens + (seq.num_output_placeholders + sample
                                                       if self.async_scheduling else 0)
            if not sample:
                continue                     # a chunk: nobody samples yet
            if seq.grammar is not None:     # a row per position verified, then the forks'
                out.structured_output_seq_ids += [seq.seq_id] * (1 + len(s.spec_token_ids))
                out.structured_output_seq_ids += [f.seq_id for f in s.forks]
            for fork in s.forks:             # samples only: its blocks come when it forks
                out.scheduled_new_reqs.append(new_request_data(fork, s.seq_group, []))
                out.num_scheduled_tokens[fork.seq_id] = 0
                out.sample_from[fork.seq_id] = seq.seq_id
        return out


def new_request_data(seq: Sequence, group: SequenceGroup, block_ids: list[int]) -> NewRequestData:
    """seq in full, for a runner that has no current record of it."""
    return NewRequestData(seq.seq_id, seq.index, seq.prompt_token_ids, list(seq.output_token_ids),
                          group.sampling_params, list(block_ids), seq.num_computed_tokens)
