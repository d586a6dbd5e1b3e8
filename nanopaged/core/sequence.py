"""Sequence and SequenceGroup: the engine's record of a request while it is served.

A *request* (one prompt plus its SamplingParams) is a SequenceGroup; each completion it
asks for is a Sequence (`n` of them, sharing prompt blocks). These are the scheduler's
own records, and only the scheduler changes them: it moves groups between its queues,
has the block manager give each Sequence a BlockTable, and appends the sampled tokens
(`Scheduler.update_from_output`). Nothing outside the EngineCore sees them; other layers
get messages (messages.py).

They hold the base engine's state only. A later feature keeps its own state of a
request beside them, in a table of its own keyed by seq_id (or request_id) that it
fills when the request is added and empties when it leaves (Scheduler._request_removed).

The one number that drives scheduling is `num_computed_tokens`: how many of the
sequence's tokens already have their K/V in the cache. A fresh request has 0, so its
next step computes the whole prompt (prefill); after that it is one behind its token
count, so each step computes exactly the last sampled token (decode). A request preempted
by recompute drops back to 0 and recomputes prompt + output in one pass. This is vLLM
v1's view (`vllm/v1/request.py`): prefill and decode are the same operation with
different lengths. Names follow vLLM v0's `vllm/sequence.py`.
"""
from __future__ import annotations

import enum

from ..messages import EngineCoreRequest, Logprobs
from ..sampling_params import SamplingParams
from .block_table import BlockTable


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life. WAITING -> RUNNING -> FINISHED_*, with
    RUNNING -> WAITING again when it is preempted by recompute."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()            # preempted by swap: its blocks are in the CPU pool
    FINISHED_STOPPED = enum.auto()   # hit EOS or a stop token
    FINISHED_LENGTH = enum.auto()    # hit max_tokens or max_model_len (or the pool's size)
    FINISHED_ABORTED = enum.auto()   # abort_request()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's CompletionOutput.finish_reason: "stop", "length", "abort" or None."""
        return _FINISH_REASON.get(self)


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
             SequenceStatus.FINISHED_ABORTED}
_FINISH_REASON = {SequenceStatus.FINISHED_STOPPED: "stop",
                  SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort"}


class Sequence:
    """One completion: its tokens, how many have K/V cached, and its block table.

    Attributes:
        seq_id: engine-wide unique id.
        index: which of its request's n sequences it is (0..n-1).
        prompt_token_ids / output_token_ids: token ids (ints).
        num_computed_tokens: tokens (from position 0) whose K/V are in the cache.
        block_table: where those K/V live (see block_table.py): ceil(num_computed_tokens
            / block_size) blocks, in the CPU swap pool while it is_swapped.
        block_hashes: prefix-cache hashes of its full blocks (kept across preemption).
        cache_salt: bytes its first block's hash starts from (vLLM's cache_salt), so
            that the same tokens computed under different weights or settings share no
            block; None (the default): the plain hashes.
        status: a SequenceStatus.
        stop_reason: the stop_token_ids id that finished it, if one did (None for an eos).
        num_prompt_logprobs: prompt positions whose logprobs were reported.
    No text and no random generator: strings live in the OutputProcessor, generators
    in the model runner (messages.py says why).
    """

    def __init__(self, seq_id: int, index: int, prompt_token_ids: list[int], block_size: int) -> None:
        self.seq_id = seq_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table = BlockTable(block_size)
        self.block_hashes: list[bytes] = []
        self.cache_salt: bytes | None = None
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | None = None
        self.num_prompt_logprobs = 0

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})")

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt plus output token ids (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n):end - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next forward pass must compute: the whole prompt on prefill, 1 on
        decode. (A scheduler whose steps run ahead of their outputs adds the tokens those
        steps will sample: Scheduler._num_pending_tokens.)"""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_swapped(self) -> bool:
        """Preempted by swap (status SWAPPED): its block table holds CPU swap-pool blocks."""
        return self.status == SequenceStatus.SWAPPED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def new_prompt_logprobs(self, start: int, logprobs: Logprobs) -> Logprobs | None:
        """The rows of `logprobs` (row j: the prompt token at start + 1 + j) not reported
        before (a recompute repeats rows), or None; they count as reported now."""
        skip = max(0, self.num_prompt_logprobs - start)
        if not logprobs.ranks[skip:]:
            return None
        self.num_prompt_logprobs = start + len(logprobs.ranks)
        return logprobs[skip:]


class SequenceGroup:
    """One request: a prompt, its SamplingParams and its sequences (vLLM v0's name).

    Attributes:
        request: the EngineCoreRequest it came from (ids, params, eos ids, arrival time).
        seqs: the group's sequences (len == sampling_params.n).
        num_cached_tokens: prompt tokens its first prefill found in the prefix cache.
    """

    def __init__(self, request: EngineCoreRequest, seqs: list[Sequence]) -> None:
        self.request = request
        self.seqs = seqs
        self.num_cached_tokens = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def arrival_time(self) -> float:
        """time.monotonic() when it was made, seconds; FCFS order."""
        return self.request.arrival_time

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.seqs})"

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        """The group's sequences, optionally only those with `status`."""
        return self.seqs if status is None else [s for s in self.seqs if s.status == status]

    def seqs_to_compute(self, status: SequenceStatus = SequenceStatus.WAITING) -> list[Sequence]:
        """The sequences (with `status`) that compute their own tokens. A fresh request
        (no output yet) is computed once, since its n sequences are identical; the
        others fork it when its prefill is done. After a recompute preemption the
        sequences differ and each is recomputed (sharing the prompt's full blocks)."""
        seqs = self.get_seqs(status)
        if seqs and all(not s.output_token_ids for s in seqs):
            return seqs[:1]
        return seqs

    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)
