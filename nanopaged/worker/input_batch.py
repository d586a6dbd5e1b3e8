"""InputBatch: the worker's one record of every sequence it serves.

The runner never sees the scheduler's Sequence objects (they may live in another
process); it learns each sequence in full once (NewRequestData) and then as deltas
(CachedRequestData), and keeps what it learned here, in one place:

- per sequence, a `SeqState`: its tokens, block ids, num_computed_tokens, sampling
  params, and its seeded torch.Generator (requests with a seed);
- for the sequences with a penalty (repetition, frequency, presence), a row of two
  tensors, `prompt_mask` [capacity, vocab] bool (token in the prompt) and
  `output_counts` [capacity, vocab] int32 (times the token was generated). Counting
  the tokens anew every step would cost O(sequence length) Python per row; kept here,
  they are updated by one scatter per step (`append_output_tokens`).

Each step the sampler gets what it needs of these as a SamplingMetadata
(`make_sampling_metadata`), and holds nothing itself.

vLLM: `vllm/v1/worker/gpu_input_batch.py` (CachedRequestState, InputBatch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..messages import NewRequestData
from ..sampling_params import SamplingParams
from .sampling_metadata import SamplingMetadata

_INITIAL_CAPACITY = 8     # rows of the penalty state allocated the first time one is needed


@dataclass
class SeqState:
    """What the worker knows of one sequence (vLLM v1's CachedRequestState).

    Attributes:
        seq_id, index: the sequence and its index in its request.
        prompt_token_ids, output_token_ids: its tokens, as told by the scheduler (and,
            with async scheduling, the runner's own samples).
        sampling_params: its request's SamplingParams.
        block_ids: its block table (physical block ids in logical order).
        num_computed_tokens: tokens with K/V in the cache before this step.
        generator: its own random stream when its request has a seed, else None.
        counts_row: its row of InputBatch.prompt_mask / output_counts when it has a
            penalty, else None.
    """

    seq_id: int
    index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    counts_row: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n):end - n]


class InputBatch:
    """Every sequence the worker serves: `seqs` (seq_id -> SeqState) and the penalty
    rows (`prompt_mask`, `output_counts`: [capacity, vocab], one row per sequence with
    a penalty, allocated on first need, doubled when full; freed rows are reused).

    Args:
        vocab_size: the model's vocabulary (the width of the penalty rows).
        device: where the penalty rows and the generators live.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.seqs: dict[int, SeqState] = {}
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._free_rows: list[int] = []

    # -- learning and forgetting sequences ------------------------------------------------

    def add_sequence(self, new: NewRequestData) -> SeqState:
        """(Re)learn a sequence sent in full, dropping what was known of it: a fresh
        SeqState holding copies of the message's output and block lists (they are
        extended later; the message is not ours to change), and a penalty row set from
        its prompt and output so far when its params have a penalty.

        Its seeded generator is the one exception: a sequence re-sent in full (resumed
        after a preemption) keeps drawing from its stream where it was, so preemption
        never changes samples. A new one gets `_seeded_generator(seed, index)`.

        Raises:
            ValueError: a token id outside the vocabulary (penalty rows only).
        """
        old = self.seqs.get(new.seq_id)
        generator = old.generator if old is not None else None
        self.remove_sequence(new.seq_id)
        seed = new.sampling_params.seed
        if seed is not None and generator is None:
            generator = self._seeded_generator(seed, new.index)
        state = self.seqs[new.seq_id] = SeqState(
            new.seq_id, new.index, new.prompt_token_ids, list(new.output_token_ids), new.sampling_params,
            list(new.block_ids), new.num_computed_tokens, generator)
        if new.sampling_params.needs_token_counts:
            state.counts_row = self._take_row(new.prompt_token_ids, new.output_token_ids)
        return state

    def remove_sequence(self, seq_id: int) -> None:
        """Forget `seq_id`: its record, its generator and its penalty row (a no-op if
        it is unknown)."""
        state = self.seqs.pop(seq_id, None)
        if state is not None and state.counts_row is not None:
            self._free_rows.append(state.counts_row)

    def append_output_tokens(self, seq_ids: list[int], token_ids: list[int]) -> None:
        """New output tokens: token_ids[i] was generated by seq_ids[i] (flat, parallel
        lists; a sequence may appear more than once). Appended to each sequence's
        output, and counted in its penalty row by one scatter_add_ for the whole step.

        Raises:
            ValueError: lists of different lengths, or a counted id outside the vocabulary.
            KeyError: an unknown seq_id.
        """
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"append_output_tokens: {len(seq_ids)} seq_ids but {len(token_ids)} token_ids")
        flat = []                                # indices into output_counts.view(-1)
        for seq_id, t in zip(seq_ids, token_ids):
            state = self.seqs[seq_id]
            if state.counts_row is not None:
                self._check_id(t)
                flat.append(state.counts_row * self.vocab_size + t)
            state.output_token_ids.append(t)
        if flat:
            self.output_counts.view(-1).scatter_add_(
                0, torch.tensor(flat, dtype=torch.int64, device=self.device),
                torch.ones(len(flat), dtype=torch.int32, device=self.device))

    # -- what the sampler reads -----------------------------------------------------------

    def make_sampling_metadata(self, seq_ids: list[int],
                               extra_token_ids: list[list[int]] | None = None) -> SamplingMetadata:
        """The SamplingMetadata of a step whose row i samples for seq_ids[i] (a sequence
        may have several rows: a fork samples from its parent's row), with the penalty
        rows' prompt_mask / output_counts gathered ([num_penalty_rows, vocab] copies,
        in row order) and each row's generator.

        extra_token_ids[i] (speculative decoding): output tokens row i comes after that
        the record does not hold yet, the drafts before its position. Row j of a
        sequence verifying drafts d is sampled as if d[:j] had been generated: min_tokens,
        bad words and penalties see them (so greedy verification picks what plain
        decoding would).

        Raises:
            KeyError: an unknown seq_id.
        """
        states = [self.seqs[i] for i in seq_ids]
        extra = extra_token_ids or [[] for _ in states]
        outputs = [s.output_token_ids + e if e else s.output_token_ids for s, e in zip(states, extra)]
        counted = [(s.counts_row, e) for s, e in zip(states, extra) if s.counts_row is not None]
        prompt_mask = output_counts = None
        if counted:
            rows = torch.tensor([r for r, _ in counted], dtype=torch.int64, device=self.device)
            prompt_mask, output_counts = self.prompt_mask[rows], self.output_counts[rows]
            flat = [i * self.vocab_size + t for i, (_, e) in enumerate(counted) for t in e]
            if flat:                                   # the copies count the drafts too
                output_counts.view(-1).scatter_add_(
                    0, torch.tensor(flat, dtype=torch.int64, device=self.device),
                    torch.ones(len(flat), dtype=torch.int32, device=self.device))
        return SamplingMetadata.build([s.sampling_params for s in states], [s.generator for s in states],
                                      outputs, self.vocab_size, self.device, prompt_mask, output_counts)

    # -- helpers --------------------------------------------------------------------------

    def _seeded_generator(self, seed: int, index: int) -> torch.Generator:
        """A seeded request's i-th sequence draws from its own stream: the first from
        `seed` itself, the others from seeds derived from (seed, i), so the n samples
        differ and a rerun repeats them."""
        seed = seed if index == 0 else hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF
        return torch.Generator(device=self.device).manual_seed(seed)

    def _take_row(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """A free penalty row, set from a prompt and an output so far."""
        prompt, output = self._ids(prompt_token_ids), self._ids(output_token_ids)
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.prompt_mask[row] = False
        self.output_counts[row] = 0
        self.prompt_mask[row, prompt] = True
        self.output_counts[row].scatter_add_(
            0, output, torch.ones(len(output_token_ids), dtype=torch.int32, device=self.device))
        return row

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(_INITIAL_CAPACITY, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], mask[:old] = self.output_counts, self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self._free_rows.extend(range(new - 1, old - 1, -1))     # pop() hands out the lowest first

    def _check_id(self, t: int) -> None:
        # a flat index past the vocabulary would silently count into the next row
        if not 0 <= t < self.vocab_size:
            raise ValueError(f"token id {t} outside the vocabulary [0, {self.vocab_size})")

    def _ids(self, token_ids: list[int]) -> torch.Tensor:
        for t in token_ids:
            self._check_id(t)
        return torch.tensor(token_ids, dtype=torch.int64, device=self.device)
