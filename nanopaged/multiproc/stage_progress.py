"""Stage progress: which batch each pipeline stage is on and what it is doing, for the
live dashboard, which shows each stage's batch.

MultiprocExecutor makes a board of one 8-byte word per stage: a file in its folder,
mapped into memory (mmap) by the engine-core process and by each stage's first
tensor-parallel rank. That rank is its word's only writer; the dashboard reads the
board when it builds a snapshot (dashboard/sampler.py). A word is

    batch << 3 | state        one aligned 8-byte store: a reader never sees half of one

batch: the executor's call id of the batch's execute_model, which the engine core's
batch queue knows too (0: no batch yet); state: an index into STATES. A rank stores a
few words per step whether or not anybody watches (nanoseconds each); nothing else
happens until a snapshot reads them. Ranks on another host cannot map node 0's file:
their stages are not on the board, and the dashboard says "unknown". nanopaged's own:
vLLM has no dashboard.
"""
from __future__ import annotations

import mmap

# idle: waiting for its next message; preparing: its record, block moves and inputs
# (ModelRunner.execute_model before the forward); receiving: blocked in recv, waiting for
# the previous stage's hidden states; computing: its layers (the last stage: also the
# norm, logits and sampling); sending: from the send on (pipeline/hop.py's send waits for
# the previous send to complete) until its answer is out
STATES = ("idle", "preparing", "receiving", "computing", "sending")
IDLE, PREPARING, RECEIVING, COMPUTING, SENDING = range(len(STATES))
_WORD = 8                  # bytes per stage


class StageBoard:
    """The board of num_stages words in the file at `path`, mapped into this process.

    Args:
        path: the file (the executor's folder).
        num_stages: pipeline_parallel_size.
        create: write the file first, every word 0 (stage idle, no batch yet).
    """

    def __init__(self, path: str, num_stages: int, create: bool = False) -> None:
        self.path, self.num_stages = path, num_stages
        if create:
            with open(path, "wb") as f:
                f.write(bytes(_WORD * num_stages))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _WORD * num_stages)     # the mapping outlives the file object
        self.words = memoryview(self._map).cast("q")

    def read(self) -> list[tuple[int, str]]:
        """Per stage, (batch, state name) as its writer last stored them."""
        return [(word >> 3, STATES[word & 7]) for word in self.words.tolist()]


class StageReporter:
    """One stage's writer: its word on `board`, or with no board a private word nobody
    reads (a stage on another host, or a runner built in tests), so callers never check.

    Attributes:
        batch: the batch it is on, or last finished.
    """

    def __init__(self, board: StageBoard | None = None, stage: int = 0) -> None:
        self.board = board                 # keeps the mapping alive
        self._words = board.words if board is not None else memoryview(bytearray(_WORD)).cast("q")
        self._index = stage if board is not None else 0
        self.batch = 0

    def begin(self, batch: int) -> None:
        """The stage starts on `batch` (the executor's call id): preparing."""
        self.batch = batch
        self.set(PREPARING)

    def call(self, worker, call_id: int, method: str, args: tuple):
        """worker.<method>(*args) (a Worker, for the call call_id of the executor), the
        stage's progress reported around it: an execute_model starts batch call_id, and
        every call ends idle; the runner reports the states between
        (pipeline_model_runner.py; a sample_tokens finishes the same batch)."""
        if method == "execute_model":
            self.begin(call_id)
        try:
            result = getattr(worker, method)(*args)
        finally:
            self.set(IDLE)
        if method == "initialize_kv_cache":                 # the runner exists from now on
            worker.model_runner.stage_progress = self
        return result

    def set(self, state: int) -> None:
        """The stage is now in `state` (an index into STATES) on its batch."""
        self._words[self._index] = self.batch << 3 | state
