"""RunnerView: what the model runner knows of each sequence, so a step's message carries
only what is new to it.

The runner keeps its own record of every sequence (tokens, block ids,
num_computed_tokens), built from the messages alone; each SchedulerOutput (messages.py)
sends a sequence as NewRequestData (no current record: everything), as a
CachedRequestData delta (tokens and blocks added since), or names it in
finished_seq_ids (drop it). A sequence whose tokens or blocks changed other than by
growing (preempted, swapped in, replaced by a fork) is forgotten here and sent in full.
vLLM v1: `vllm/v1/core/sched/output.py` and its scheduler's cached-request bookkeeping.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..messages import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from .scheduler_output import ScheduledStep
    from .sequence import Sequence, SequenceGroup


class RunnerView:
    """The scheduler's view of the runner's per-sequence record."""

    # does the runner append the tokens it samples itself? (then a token the scheduler
    # appends in place of the sampled one makes its record stale)
    runner_appends_samples = False

    def __init__(self) -> None:
        # seq_id -> tokens the runner knows of it, for sequences whose record is current
        self.known: dict[int, int] = {}
        self.finished_seq_ids: set[int] = set()        # left since the last message

    def forget(self, seq_id: int) -> None:
        """seq's record at the runner is stale (or gone): send it in full next time."""
        self.known.pop(seq_id, None)

    def finished(self, seq_id: int) -> None:
        """seq left the engine: the next message tells the runner to drop its record."""
        self.known.pop(seq_id, None)
        self.finished_seq_ids.add(seq_id)

    def known_after(self, seq: Sequence, sample: bool) -> int:
        """Tokens the runner knows of seq after this step's message (sample: the step samples for seq)."""
        return seq.num_tokens

    def message(self, step: ScheduledStep, samples: list[bool],
                message_cls: type[SchedulerOutput] = SchedulerOutput) -> SchedulerOutput:
        """The step's SchedulerOutput (a message_cls, the scheduler's subclass of it when
        a feature adds fields); the view becomes what the runner knows after it.
        samples[i]: step.scheduled[i] samples (asked before the step's tokens count).
        Reads sequences, writes none."""
        out = message_cls(blocks_to_copy=step.blocks_to_copy, blocks_to_swap_out=step.blocks_to_swap_out,
                          blocks_to_swap_in=step.blocks_to_swap_in, finished_seq_ids=self.finished_seq_ids)
        self.finished_seq_ids = set()
        cached = out.scheduled_cached_reqs
        for s, sample in zip(step.scheduled, samples):
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
            self.known[seq.seq_id] = self.known_after(seq, sample)
            for fork in s.forks if sample else []:       # samples only: its blocks come when it forks
                out.scheduled_new_reqs.append(new_request_data(fork, s.seq_group, []))
                out.num_scheduled_tokens[fork.seq_id] = 0
                out.sample_from[fork.seq_id] = seq.seq_id
        return out


def new_request_data(seq: Sequence, group: SequenceGroup, block_ids: list[int]) -> NewRequestData:
    """seq in full, for a runner that has no current record of it."""
    return NewRequestData(seq.seq_id, seq.index, seq.prompt_token_ids, list(seq.output_token_ids),
                          group.sampling_params, list(block_ids), seq.num_computed_tokens)
