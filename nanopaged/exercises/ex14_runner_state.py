"""Exercise 14 (chapter 14): the runner's own record of every sequence, from messages."""
from __future__ import annotations

NUMBER = 14
CHAPTER = "14-v1-split.md"
TITLE = "ModelRunner._update_states: the runner's record, from messages"
TARGETS = ["nanopaged.worker.model_runner:ModelRunner._update_states"]
TASK = """
The model runner never sees the scheduler's Sequence objects (they may live in another
process): it keeps its own record of every sequence, its InputBatch (a SeqState per
sequence, with the seeded generators and the penalty counts), and learns everything from
each step's SchedulerOutput. Write `_update_states`, which applies one message to that
record: forget the finished sequences, learn the ones sent in full (NewRequestData), and
apply the deltas of the ones it knows (CachedRequestData: new tokens, new block ids, or a
whole new table when block_ids_replaced). Every step of the engine starts with this
function.
"""
HINT = """
Three loops, in the docstring's order. A finished sequence:
self.input_batch.remove_sequence(seq_id) (a no-op for one it does not know). A new one:
self.input_batch.add_sequence(new), which copies the message's lists, keeps the
generator of a seeded sequence it already knows and counts its tokens (do not remove it
first: its generator would go with it). A known one: zip the five lists of
so.scheduled_cached_reqs; state = self.input_batch.seqs[seq_id]; state.block_ids =
list(blocks) if replaced else state.block_ids.extend(blocks); set
state.num_computed_tokens. Collect the (seq_id, token) pairs of every new token and give
them to self.input_batch.append_output_tokens once (it appends and counts them).
With speculative decoding (chapter 19) the scheduler may have taken back blocks that
the runner's table still holds: before extending a table, drop its last
so.num_blocks_taken_back.get(seq_id, 0) block ids.
"""


def _runner():
    """A ModelRunner with its record but no model (enough for _update_states)."""
    import torch

    from nanopaged.worker.input_batch import InputBatch
    from nanopaged.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.input_batch = InputBatch(320, runner.device)
    runner.block_size = 4
    return runner


def _new(seq_id, prompt, output, block_ids, computed, **params):
    from nanopaged import SamplingParams
    from nanopaged.messages import NewRequestData

    return NewRequestData(seq_id, 0, list(prompt), list(output), SamplingParams(**params), list(block_ids), computed)


def _message(new=(), cached=(), finished=()):
    """A SchedulerOutput with NewRequestData `new` and cached deltas `cached`, each
    (seq_id, new tokens, new block ids, replaced, num_computed_tokens)."""
    from nanopaged.messages import CachedRequestData, SchedulerOutput

    c = CachedRequestData()
    for seq_id, tokens, blocks, replaced, computed in cached:
        c.seq_ids.append(seq_id)
        c.new_token_ids.append(list(tokens))
        c.new_block_ids.append(list(blocks))
        c.block_ids_replaced.append(replaced)
        c.num_computed_tokens.append(computed)
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=c, finished_seq_ids=set(finished))


def _record(runner, seq_id):
    s = runner.input_batch.seqs.get(seq_id)
    assert s is not None, f"after the message, the runner has no SeqState for sequence {seq_id}"
    return (list(s.prompt_token_ids), list(s.output_token_ids), list(s.block_ids), s.num_computed_tokens)


def check_new_in_full():
    """a sequence sent in full (NewRequestData) becomes a SeqState of its own: its fields, in copies the message cannot change"""
    runner = _runner()
    first = _new(3, [1, 2, 3, 4, 5, 6], [], [5, 2], 0)
    resumed = _new(7, [9, 9, 9], [11, 12], [4, 0], 4)        # after a recompute, 4 tokens cached
    runner._update_states(_message(new=[first, resumed]))
    for msg in (first, resumed):
        want = (msg.prompt_token_ids, msg.output_token_ids, msg.block_ids, msg.num_computed_tokens)
        got = _record(runner, msg.seq_id)
        assert got == want, (f"sequence {msg.seq_id}: (prompt, output, block ids, num_computed_tokens) "
                             f"is {got}, the message said {want}")
        assert runner.input_batch.seqs[msg.seq_id].sampling_params is msg.sampling_params, \
            f"sequence {msg.seq_id}: its sampling_params are not the message's"
    first.block_ids.append(99)
    resumed.output_token_ids.append(99)
    seqs = runner.input_batch.seqs
    assert seqs[3].block_ids == [5, 2] and seqs[7].output_token_ids == [11, 12], (
        "changing the message's lists afterwards changed the runner's record (block ids "
        f"{seqs[3].block_ids}, output {seqs[7].output_token_ids}): keep copies, "
        "since the runner extends them in place later and the message is not its own")


def check_deltas():
    """a known sequence takes its deltas: tokens appended, block ids appended, the whole table when block_ids_replaced"""
    runner = _runner()
    runner._update_states(_message(new=[_new(0, [1, 2, 3, 4, 5, 6], [], [0, 1], 0)]))
    steps = [((0, [44], [], False, 6), ([44], [0, 1], 6)),              # a decode, no new block
             ((0, [12], [5], False, 7), ([44, 12], [0, 1, 5], 7)),      # a decode into a new block
             ((0, [3], [0, 1, 8], True, 8), ([44, 12, 3], [0, 1, 8], 8))]   # copy-on-write replaced block 5
    for delta, (output, blocks, computed) in steps:
        runner._update_states(_message(cached=[delta]))
        got = _record(runner, 0)[1:]
        assert got == (output, blocks, computed), (
            f"after the delta (tokens {delta[1]}, block ids {delta[2]}, replaced {delta[3]}, "
            f"num_computed_tokens {delta[4]}) the record has output {got[0]}, block ids {got[1]}, "
            f"num_computed_tokens {got[2]}; it should have {output}, {blocks}, {computed}")


def check_finished_and_generators():
    """a finished sequence is forgotten (record, generator, penalty counts); a seeded one keeps its generator when re-sent in full"""
    runner = _runner()
    seeded = _new(4, [1, 2, 3], [], [0], 0, temperature=1.0, seed=7, repetition_penalty=1.2)
    runner._update_states(_message(new=[seeded, _new(5, [6, 7], [], [1], 0)]))
    batch = runner.input_batch
    assert 4 in batch.seqs and 5 in batch.seqs, \
        "the new sequences have no record (self.input_batch.add_sequence)"
    gen = batch.seqs[4].generator
    assert gen is not None, "a sequence of a request with a seed got no generator"
    assert batch.seqs[5].generator is None, "a sequence without a seed got a generator of its own"
    assert batch.seqs[4].counts_row is not None, \
        "no penalty counts for a sequence with repetition_penalty (self.input_batch.add_sequence)"
    runner._update_states(_message(new=[_new(4, [1, 2, 3], [8, 9], [2], 0, temperature=1.0, seed=7,
                                             repetition_penalty=1.2)]))   # resumed after a preemption
    assert batch.seqs[4].generator is gen, (
        "a seeded sequence sent in full again (resumed after a preemption) got a new generator: "
        "its stream must go on where it was, or preemption would change its samples")
    row = batch.seqs[4].counts_row
    runner._update_states(_message(finished=[4, 5]))
    assert 4 not in batch.seqs and 5 not in batch.seqs, \
        "finished sequences are still in the record (self.input_batch.remove_sequence)"
    assert row in batch._free_rows, "a finished sequence's penalty row was not freed"


def check_engine_runs_on_it():
    """the engine runs on your record: n > 1, preemption, prefix caching, penalties, seeds, async scheduling on and off: its own tokens"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    shared = list(range(40, 52))
    prompts = [shared + [1, 2], shared + [3], list(range(100, 107)), [7, 8, 9]]
    params = [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=9, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    # 14 blocks of 4 are too few for all of it at once: 4 preemptions (5 with async
    # scheduling), each sending its sequences in full again when they resume; their
    # recomputed prompts hit the prefix cache. (A swapped-in sequence is re-sent in full
    # the same way.)
    for engine_args in (dict(), dict(async_scheduling=True)):
        try:
            same_as_engines_own(prompts, params, num_gpu_blocks=14, num_cpu_blocks=0, preemption_mode="recompute",
                                **engine_args)
        except AssertionError as e:
            raise AssertionError(f"async scheduling {'on' if engine_args else 'off'}: {e}") from None


CHECKS = [check_new_in_full, check_deltas, check_finished_and_generators, check_engine_runs_on_it]
