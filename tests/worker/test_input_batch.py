"""InputBatch: the worker's one record per sequence (vLLM v1's InputBatch): tokens, block
ids, generator and the penalty counts rows, learned from messages, and the
SamplingMetadata the stateless Sampler reads."""

import pytest
import torch

from nanopaged import SamplingParams
from nanopaged.messages import NewRequestData
from nanopaged.worker.input_batch import InputBatch

CPU = torch.device("cpu")


def new_seq(seq_id, params, prompt, output=(), index=0, block_ids=()):
    return NewRequestData(seq_id, index, list(prompt), list(output), params, list(block_ids), 0)


# -- the record --------------------------------------------------------------------------

def test_add_sequence_keeps_copies_of_the_message_lists():
    batch, msg = InputBatch(10, CPU), new_seq(3, SamplingParams(), [1, 2], [4], block_ids=[5])
    state = batch.add_sequence(msg)
    msg.output_token_ids.append(9)
    msg.block_ids.append(9)
    assert batch.seqs[3] is state and (state.output_token_ids, state.block_ids) == ([4], [5])
    assert state.sampling_params is msg.sampling_params and state.generator is None


def test_a_seeded_sequence_keeps_its_generator_when_sent_in_full_again():
    batch, p = InputBatch(10, CPU), SamplingParams(seed=7)
    first = batch.add_sequence(new_seq(4, p, [1, 2])).generator
    assert torch.equal(first.get_state(), torch.Generator().manual_seed(7).get_state())
    torch.rand((), generator=first)                      # it has drawn once
    assert batch.add_sequence(new_seq(4, p, [1, 2], [3])).generator is first   # resumed
    batch.remove_sequence(4)
    assert 4 not in batch.seqs
    assert batch.add_sequence(new_seq(4, p, [1, 2])).generator is not first    # a new one


def test_the_i_th_sequence_of_a_seeded_request_draws_its_own_stream():
    batch, p = InputBatch(10, CPU), SamplingParams(seed=7)
    gens = [batch.add_sequence(new_seq(i, p, [1], index=i)).generator for i in range(2)]
    draws = [torch.rand((), generator=g).item() for g in gens]
    assert draws[0] != draws[1]


def test_append_output_tokens_rejects_unknown_sequences_and_uneven_lists():
    batch = InputBatch(10, CPU)
    batch.add_sequence(new_seq(0, SamplingParams(), [1]))
    with pytest.raises(KeyError):
        batch.append_output_tokens([1], [2])
    with pytest.raises(ValueError, match="seq_ids"):
        batch.append_output_tokens([0, 0], [2])


# -- the penalty rows --------------------------------------------------------------------

def test_sequence_without_penalties_allocates_no_counts():
    batch = InputBatch(100, CPU)
    batch.add_sequence(new_seq(1, SamplingParams(), [1, 2], [3]))
    assert batch.output_counts.shape == (0, 100) and batch.seqs[1].counts_row is None


def test_counts_follow_add_append_and_remove():
    batch, p = InputBatch(10, CPU), SamplingParams(repetition_penalty=1.1)
    batch.add_sequence(new_seq(7, p, [1, 2, 2], [3]))
    batch.add_sequence(new_seq(99, SamplingParams(), [1]))
    batch.append_output_tokens([7, 99, 7], [3, 5, 4])        # 99 has no counts: only appended
    row = batch.seqs[7].counts_row
    assert batch.output_counts[row].tolist() == [0, 0, 0, 2, 1, 0, 0, 0, 0, 0]
    assert batch.prompt_mask[row].nonzero().flatten().tolist() == [1, 2]
    assert batch.seqs[7].output_token_ids == [3, 3, 4] and batch.seqs[99].output_token_ids == [5]
    batch.remove_sequence(7)
    batch.add_sequence(new_seq(8, p, [9]))                   # reuses the freed row, cleared
    assert batch.seqs[8].counts_row == row and batch.output_counts[row].sum() == 0
    assert batch.prompt_mask[row].nonzero().flatten().tolist() == [9]


def test_add_sequence_resets_a_known_sequence():
    batch, p = InputBatch(10, CPU), SamplingParams(frequency_penalty=1.0)
    batch.add_sequence(new_seq(1, p, [1], [2, 2]))
    batch.add_sequence(new_seq(1, p, [3], [4]))              # e.g. after a preemption
    row = batch.seqs[1].counts_row
    assert batch.output_counts[row, [2, 4]].tolist() == [0, 1] and not batch.prompt_mask[row, 1]
    batch.add_sequence(new_seq(1, SamplingParams(), [3], [4]))   # no penalty any more: row freed
    assert batch.seqs[1].counts_row is None and batch._free_rows.count(row) == 1


def test_counts_grow_by_doubling_and_keep_existing_rows():
    batch, p = InputBatch(10, CPU), SamplingParams(presence_penalty=0.5)
    for s in range(9):
        batch.add_sequence(new_seq(s, p, [s], [s, s]))
    assert batch.output_counts.shape == (16, 10) and len(batch._free_rows) == 7
    for s in range(9):
        row = batch.seqs[s].counts_row
        assert batch.output_counts[row, s] == 2 and batch.prompt_mask[row].nonzero().tolist() == [[s]]


def test_append_output_tokens_rejects_an_id_outside_the_vocabulary():
    batch = InputBatch(10, CPU)
    batch.add_sequence(new_seq(0, SamplingParams(presence_penalty=0.5), [], []))
    with pytest.raises(ValueError, match="10"):
        batch.append_output_tokens([0], [10])


# -- what the sampler reads --------------------------------------------------------------

def test_sampling_metadata_carries_the_rows_counts_and_generators():
    batch = InputBatch(6, CPU)
    batch.add_sequence(new_seq(1, SamplingParams(presence_penalty=0.5), [0], [2, 2]))
    batch.add_sequence(new_seq(2, SamplingParams(seed=3), [1]))
    batch.add_sequence(new_seq(3, SamplingParams(repetition_penalty=2.0), [5], [4]))
    meta = batch.make_sampling_metadata([3, 2, 1, 3])        # a fork samples from its parent's row too
    assert meta.penalty_rows == [0, 2, 3]
    assert meta.output_counts.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 2, 0, 0, 0], [0, 0, 0, 0, 1, 0]]
    assert meta.prompt_mask.nonzero().tolist() == [[0, 5], [1, 0], [2, 5]]
    assert meta.generators == {1: batch.seqs[2].generator}
    assert meta.output_token_ids[2] is batch.seqs[1].output_token_ids    # live: min_tokens, bad words
