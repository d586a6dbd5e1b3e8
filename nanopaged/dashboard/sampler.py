"""The live dashboard's data: build_snapshot reads the engine's state into a
DashboardSnapshot (dashboard/messages.py), and DashboardSampler, an event observer,
gathers each step's decisions and hands out a snapshot at most 5 times a second.

    sampler = DashboardSampler()
    core.observers.append(sampler)         # only while a viewer watches: else no cost at all
    core.step()
    sampler.end_step(core.num_steps)       # this step's decisions become one DashboardStep
    snapshot = sampler.poll(core)          # a snapshot, or None within 0.2 s of the last one

The state (pool, queues, block tables) is read from the scheduler and block manager;
the decisions exist only as the step's events (events.py). The steps between two
snapshots ride in the next one (the last MAX_STEPS of them). In a server the sampler
is a watcher of the core process (engine_core_client.CoreWatcher); the tracer's replay
page (dashboard/replay.py) polls it after every step. The pictures are trace/view.py's.

With multi-LoRA each request names its adapter (lora_names: the scheduler's table).
With pipeline parallelism (chapter 20) the scheduler has batches in flight
(PipelineScheduler.in_flight_batches, seq ids); a snapshot names their requests, and
each DashboardStep the batches that were in flight during it (batches_during_step).
In a server's engine core a snapshot also says what each stage is doing and on which
batch, as its workers report it (stage_rows; multiproc/stage_progress.py). The tracer's
replay has no stage rows: its engine (LLMEngine) is read between its steps, where the
workers' live states would be a race, not a replay.
"""
from __future__ import annotations

import time
from collections import deque

from .messages import DashboardRequest, DashboardSequence, DashboardSnapshot, DashboardStage, DashboardStep
from ..events import (BlockCached, BlockFreed, CopyOnWrite, DraftsVerified, Event, Preempted, RequestAdded, RequestFinished, SequenceScheduled)

SNAPSHOT_INTERVAL_S = 0.2    # at most 5 snapshots a second: a snapshot takes CPU from the
                             # server it watches, and a viewer does not need more
MAX_STEPS = 20               # the decisions of at most this many steps per snapshot
RATE_WINDOW_S = 1.0          # tokens_per_s: generated tokens over the last second
MAX_BLOCKS = 16384           # per pool: the first this many blocks are drawn (a tiny model's
                             # default swap pool has millions; nobody reads a grid that big)


def in_flight_batches(engine_core) -> list[tuple[int, ...]] | None:
    """The seq ids of each batch in flight, oldest first; None when the scheduler keeps
    no batches in flight (no pipeline parallelism: one batch at a time)."""
    batches = getattr(engine_core.scheduler, "in_flight_batches", None)
    return None if batches is None else [tuple(b) for b in batches]


def lora_names(engine_core) -> dict[str, str] | None:
    """request id -> the name of its LoRA adapter, for the requests that run with one;
    None when the engine serves no adapters. The dashboard's one meeting with multi-LoRA:
    it reads LoRAScheduler.lora_requests."""
    loras = getattr(engine_core.scheduler, "lora_requests", None)
    return None if loras is None else {rid: lora.lora_name for rid, lora in loras.items()}


def batches_during_step(before: list[tuple[int, ...]], after: list[tuple[int, ...]],
                        scheduled: list[int]) -> list[tuple[int, ...]]:
    """The batches in flight during one engine step, oldest first, from those in flight
    before and after it and the seq ids it scheduled: the batch it took in (the oldest
    before it; with none, the one it sent and took in at once: what it scheduled that is
    not still in flight), then those still in flight. PipelineEngineCore.step takes in
    exactly one batch when any is in flight."""
    if before:
        taken = before[0]
    else:
        held = {i for b in after for i in b}
        taken = tuple(i for i in dict.fromkeys(scheduled) if i not in held)
    return ([taken] if taken else []) + list(after)


def _batches(batches: list[tuple[int, ...]], seq_request: dict[int, str]) -> list[dict]:
    """[{"request_ids", "seq_ids"}] of each batch ("?" for a sequence nobody named)."""
    return [{"request_ids": list(dict.fromkeys(seq_request.get(i, "?") for i in b)), "seq_ids": list(b)}
            for b in batches]


def stage_rows(reports: list[tuple[int, str] | None], in_flight: dict[int, tuple[int, ...]],
               tensor_parallel_size: int, seq_request: dict[int, str]) -> list[DashboardStage]:
    """One DashboardStage per stage, from what its first rank reported, reports[stage] =
    (batch, state) (batch 0: none yet) or None (another host's: "unknown"), and the
    batches in flight by number, batch -> seq ids (PipelineEngineCore.stage_progress).
    A stage names its batch's requests while that batch is in flight; a batch taken in
    since (a stage still finishing its send, or idle after it) keeps its number only."""
    rows = []
    for stage, report in enumerate(reports):
        ranks = list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size))
        if report is None:
            rows.append(DashboardStage(stage, ranks, "unknown"))
            continue
        batch, state = report
        seq_ids = list(in_flight.get(batch, ()))
        request_ids = list(dict.fromkeys(seq_request.get(i, "?") for i in seq_ids))
        rows.append(DashboardStage(stage, ranks, state, batch or None, request_ids, seq_ids))
    return rows


def pipeline_stages(engine_core, seq_request: dict[int, str]) -> list[DashboardStage]:
    """stage_rows of an engine core whose workers report their stages
    (PipelineEngineCore.stage_progress); [] for any other engine."""
    read = getattr(engine_core, "stage_progress", None)
    progress = None if read is None else read()
    if progress is None:
        return []
    reports, in_flight = progress
    return stage_rows(reports, in_flight, engine_core.config.parallel_config.tensor_parallel_size, seq_request)


def build_snapshot(engine_core, steps: list[DashboardStep], step: int, now: float,
                   tokens_per_s: float = 0.0, seq_request: dict[int, str] | None = None) -> DashboardSnapshot:
    """The engine's state as it is now, as a DashboardSnapshot.

    Args:
        engine_core: an EngineCore or an LLMEngine: anything with `scheduler`,
            `block_manager` and `weights` (read only, never changed).
        steps: the decisions to include (oldest first), e.g. from a DashboardSampler.
        step: the number of the last step the snapshot includes.
        now: the snapshot's `time` (seconds since the engine started).
        tokens_per_s: the generation rate to report in stats (the sampler measures it).
        seq_request: seq id -> request id of sequences that may have left the queues
            (finished while in flight), to name the in-flight batches' requests.

    The per-block lists cover the first MAX_BLOCKS blocks of each pool (num_gpu_blocks
    and num_cpu_blocks stay the pools' real sizes); block tables name every block.
    """
    s, bm = engine_core.scheduler, engine_core.block_manager
    num_gpu, num_cpu = min(bm.num_gpu_blocks, MAX_BLOCKS), min(bm.num_cpu_blocks, MAX_BLOCKS)
    # Every free block shares one empty owner list: pickle then writes it once, so a large
    # pool's snapshot costs little to send (readers never mutate).
    nobody: list[str] = []
    owners: list[list[str]] = [nobody] * num_gpu
    cpu_owners: dict[int, str] = {}       # only the held CPU blocks: most of the pool is free
    requests, named, adapters = [], dict(seq_request or {}), lora_names(engine_core) or {}
    for status, queue in (("running", s.running), ("swapped", s.swapped), ("waiting", s.waiting)):
        for group in queue:
            rid, seqs = group.request_id, []
            for seq in group.seqs:
                if seq.status.is_finished:          # its blocks are free already
                    continue
                table = list(seq.block_table.block_ids)
                for block_id in table:
                    if block_id >= (num_cpu if seq.is_swapped else num_gpu):
                        continue                    # past the drawn part of the pool
                    if seq.is_swapped:
                        cpu_owners[block_id] = rid
                    elif owners[block_id] is nobody:
                        owners[block_id] = [rid]
                    elif rid not in owners[block_id]:
                        owners[block_id].append(rid)
                named[seq.seq_id] = rid
                seqs.append(DashboardSequence(seq.seq_id, table, seq.is_swapped, seq.num_computed_tokens,
                                              seq.num_tokens))
            requests.append(DashboardRequest(rid, status, len(group.prompt_token_ids),
                                             sum(len(q.output_token_ids) for q in group.seqs), seqs,
                                             lora_name=adapters.get(rid)))
    total, free = bm.num_gpu_blocks, bm.get_num_free_gpu_blocks()
    queries = bm.prefix_cache_queries
    stats = {"tokens_per_s": tokens_per_s,
             "kv_usage": (total - free) / total if total else 0.0,
             "prefix_cache_hit_rate": bm.prefix_cache_hits / queries if queries else 0.0,
             "num_preemptions": s.num_preemptions,
             "num_copy_on_write": bm.num_copy_on_write,
             "num_generated_tokens": s.num_generated_tokens}
    return DashboardSnapshot(
        step=step, time=now, block_size=bm.block_size, num_gpu_blocks=total, num_cpu_blocks=bm.num_cpu_blocks,
        gpu_ref_count=list(bm.ref_count[:num_gpu]), gpu_cached=[h is not None for h in bm.block_hash[:num_gpu]],
        gpu_owners=owners, cpu_owners=cpu_owners, requests=requests,
        running=[g.request_id for g in s.running], waiting=[g.request_id for g in s.waiting],
        swapped=[g.request_id for g in s.swapped], steps=list(steps), stats=stats,
        pipeline_parallel_size=engine_core.config.parallel_config.pipeline_parallel_size,
        in_flight=_batches(in_flight_batches(engine_core) or [], named), stages=pipeline_stages(engine_core, named),
        weight_bytes=dict(engine_core.weights.bytes_by_format))


class DashboardSampler:
    """An engine observer that gathers each step's decisions, and a rate limiter that
    turns the engine's state into a snapshot at most every `interval` seconds.

    Args:
        start: the engine's start time (time.monotonic()); snapshots' `time` counts from it.
        interval: the least time between two snapshots from `poll` (seconds).
        max_steps: the most DashboardSteps one snapshot carries (the latest ones).
        clock: time.monotonic, or a fake one in tests.

    Attributes:
        num_snapshots: snapshots built so far.
    """

    def __init__(self, start: float | None = None, interval: float = SNAPSHOT_INTERVAL_S,
                 max_steps: int = MAX_STEPS, clock=time.monotonic) -> None:
        self.clock, self.interval = clock, interval
        self.start = clock() if start is None else start
        self.current = DashboardStep(step=-1)              # the step being gathered
        self._verifying: dict | None = None                # a DraftsVerified whose BlockFreed may follow
        self.steps: deque[DashboardStep] = deque(maxlen=max_steps)   # since the last snapshot
        self.changed = False              # something happened since the last snapshot
        self.last_snapshot = float("-inf")
        self.resting = False              # the last snapshot was taken as the engine went idle
        self.last_rate = 0.0              # tokens_per_s of the last snapshot
        self.num_snapshots = 0
        self._now = False                 # a viewer joined: the next poll is forced
        self._generated: deque[tuple[float, int]] = deque()   # (time, num_generated_tokens)
        self._in_flight: list[tuple[int, ...]] = []           # the batches in flight after the last step
        self._seq_request: dict[int, str] = {}                # seq id -> request id, from the events
        self._finished: set[str] = set()

    def __call__(self, event: Event) -> None:
        """The observer (events.py): note a decision of the step being gathered."""
        self.changed = True
        if isinstance(event, RequestAdded):
            self._seq_request.update(dict.fromkeys(event.seq_ids, event.request_id))
        elif isinstance(event, RequestFinished):
            self._finished.add(event.request_id)
        if isinstance(event, SequenceScheduled):
            self._seq_request.update(dict.fromkeys((event.seq_id, *event.forks), event.request_id))
            self.current.scheduled.append({"request_id": event.request_id, "seq_id": event.seq_id,
                                           "kind": event.kind, "num_tokens": event.num_tokens})
        elif isinstance(event, Preempted):
            self.current.preempted.append({"request_id": event.request_id, "mode": event.mode})
        elif isinstance(event, CopyOnWrite):
            self.current.copy_on_write.append({"seq_id": event.seq_id, "src": event.src, "dst": event.dst})
        elif isinstance(event, DraftsVerified):
            self._verifying = {"request_id": event.request_id, "seq_id": event.seq_id,
                               "num_drafts": len(event.spec_token_ids), "num_accepted": event.num_accepted,
                               "taken_back": []}
            self.current.verified.append(self._verifying)
            return
        verifying = self._verifying
        if verifying is not None and isinstance(event, BlockFreed) and event.seq_id == verifying["seq_id"]:
            verifying["taken_back"].append(event.block_id)  # right after its DraftsVerified: a rollback
        elif not (verifying is not None and isinstance(event, BlockCached) and event.seq_id == verifying["seq_id"]):
            self._verifying = None        # (trace/scenarios.taken_back reads the events the same way)

    def end_step(self, step: int, engine_core=None) -> None:
        """A step has ended: its decisions become DashboardStep number `step`. With
        engine_core, the step also records the batches in flight during it
        (batches_during_step; pipeline parallelism)."""
        self.current.step = step
        after = None if engine_core is None else in_flight_batches(engine_core)
        if after is not None:
            during = batches_during_step(self._in_flight, after, [x["seq_id"] for x in self.current.scheduled])
            self.current.in_flight = _batches(during, self._seq_request)
            self._in_flight = after
            held = {i for b in after for i in b}           # forget the finished, once out of the pipe
            self._seq_request = {i: r for i, r in self._seq_request.items() if r not in self._finished or i in held}
            self._finished = {r for r in self._finished if r in self._seq_request.values()}
        self.steps.append(self.current)
        self.current = DashboardStep(step=-1)
        self.changed = True

    def poll(self, engine_core, force: bool = False, resting: bool = False) -> DashboardSnapshot | None:
        """A snapshot when something changed since the last one and `interval` has passed
        (or force: now, changed or not); else None, and the steps wait for the next one.
        resting: the engine is about to wait for work (implies force). The first change
        after a rest is snapshot at once: a burst shorter than `interval` is still seen."""
        now = self.clock()
        due = self.resting or now - self.last_snapshot >= self.interval
        if not (force or resting) and not (self.changed and due):
            return None
        rate = self._rate(now, engine_core.scheduler.num_generated_tokens)
        snapshot = build_snapshot(engine_core, self.steps, getattr(engine_core, "num_steps", 0),
                                  now - self.start, rate, self._seq_request)
        self.last_rate = rate
        self.steps.clear()
        self.changed, self.last_snapshot, self.resting = False, now, resting
        self.num_snapshots += 1
        return snapshot

    def rate_is_stale(self) -> bool:
        """The last snapshot reported tokens flowing, and a whole RATE_WINDOW_S has passed
        since: an idle engine owes its viewer one more snapshot, saying 0 tokens/s."""
        return self.last_rate > 0 and self.clock() - self.last_snapshot >= RATE_WINDOW_S

    def _rate(self, now: float, generated: int) -> float:
        """Generated tokens per second over about the last RATE_WINDOW_S."""
        samples = self._generated
        samples.append((now, generated))
        while len(samples) > 1 and samples[1][0] <= now - RATE_WINDOW_S:
            samples.popleft()
        t0, g0 = samples[0]
        return (generated - g0) / (now - t0) if now > t0 else 0.0

    # -- as a watcher of the core process (engine_core_client.CoreWatcher) -----------------

    def watch(self, engine_core) -> None:
        """A viewer joined: observe the core's events (once), snapshot at the next chance."""
        if self not in engine_core.observers:
            self.start = engine_core.start_time            # snapshots' time: since the engine started
            engine_core.observers.append(self)
            self._in_flight = in_flight_batches(engine_core) or []
        self._now = True

    def unwatch(self, engine_core) -> None:
        engine_core.observers.remove(self)

    def after_step(self, engine_core, stepped: bool) -> DashboardSnapshot | None:
        if stepped:
            self.end_step(engine_core.num_steps, engine_core)
        snapshot, self._now = self.poll(engine_core, force=self._now), False
        return snapshot

    def before_rest(self, engine_core) -> DashboardSnapshot | None:
        """The last change must not wait for the next step, and a stale rate gets its 0."""
        if self.changed or self.rate_is_stale():
            return self.poll(engine_core, resting=True)
        return None

    def wants_wake(self) -> bool:
        return self.rate_is_stale()
