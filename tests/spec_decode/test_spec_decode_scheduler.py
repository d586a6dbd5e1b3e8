"""The speculative-decoding scheduler (spec_decode/scheduler.py: SpecDecodeScheduler), driven by
hand with no model: SchedulerOutput.num_blocks_taken_back says exactly what the runner
drops of a sequence's block ids before it appends a step's new ones, the count it used to
derive itself from num_computed_tokens (`del block_ids[cdiv(computed, block_size):]`)."""
import random

import pytest

from nanopaged.config import EngineConfig
from nanopaged.core.block_manager import BlockManager
from nanopaged.spec_decode.messages import SpecDecodeModelRunnerOutput
from nanopaged.spec_decode.scheduler import SpecDecodeScheduler
from nanopaged.messages import EngineCoreRequest
from nanopaged.sampling_params import SamplingParams
from nanopaged.utils.math_utils import cdiv

BLOCK = 4
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
         "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "unused"}}


@pytest.mark.parametrize("method", sorted(SPECS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_num_blocks_taken_back_is_what_the_runner_derived(method, seed):
    rng = random.Random(seed)
    config = EngineConfig(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=40, max_model_len=96,
                          preemption_mode="recompute", speculative_config=SPECS[method])
    sched = SpecDecodeScheduler(config, BlockManager(48, BLOCK))
    for i, n in enumerate([1, 2, 1, 1]):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(3, 14))]
        sched.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(n=n, max_tokens=rng.randrange(12, 30)),
                                            frozenset(), float(i)))
    runner: dict[int, list[int]] = {}          # seq_id -> the runner's record of its block ids
    taken_back = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        seqs = {s.seq_id: s for g in sched.requests.values() for s in g.seqs}
        # the runner's side: its record updated from the message, the old way
        for seq_id in so.finished_seq_ids:
            runner.pop(seq_id, None)
        for new in so.scheduled_new_reqs:
            runner[new.seq_id] = list(new.block_ids)
        c = so.scheduled_cached_reqs
        appending = set()
        for seq_id, blocks, replaced, computed in zip(c.seq_ids, c.new_block_ids, c.block_ids_replaced,
                                                      c.num_computed_tokens):
            if replaced:
                runner[seq_id] = list(blocks)
                continue
            appending.add(seq_id)
            derived = max(0, len(runner[seq_id]) - cdiv(computed, BLOCK))
            assert so.num_blocks_taken_back.get(seq_id, 0) == derived, (seq_id, so.num_blocks_taken_back)
            taken_back += derived
            del runner[seq_id][cdiv(computed, BLOCK):]
            runner[seq_id] += blocks
        assert set(so.num_blocks_taken_back) <= appending and all(so.num_blocks_taken_back.values())
        for seq_id in so.num_scheduled_tokens:
            assert runner[seq_id] == seqs[seq_id].block_table.block_ids, seq_id
        # a model that accepts a random number of each sequence's drafts, and proposes more
        sampling = [i for i, n in so.num_scheduled_tokens.items()
                    if n and seqs[i].num_computed_tokens + n >= seqs[i].num_tokens]
        sampling += [f for f, parent in so.sample_from.items() if parent in sampling]
        drafts = so.scheduled_spec_decode_tokens
        sched.update_from_output(so, SpecDecodeModelRunnerOutput(
            sampled_token_ids={i: rng.randrange(1, 50) for i in sampling},
            num_accepted_tokens={i: rng.randrange(len(d) + 1) for i, d in drafts.items()},
            draft_token_ids={i: [rng.randrange(1, 50) for _ in range(rng.randrange(5))] for i in sampling}))
    assert taken_back > 0, "no block was ever taken back: the test did not exercise the rollback"
    assert sched.block_manager.get_num_free_gpu_blocks() == 48
