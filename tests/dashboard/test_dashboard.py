"""The live dashboard's data (dashboard/sampler.py, issue 27): build_snapshot reads the
pool, the queues and the block tables as the engine has them; DashboardSampler gathers
each step's decisions and hands out a snapshot at most every 0.2 s, the steps between
coalesced; the core process listens only while a viewer watches, and a viewer sees the
state the engine rests in, also right after a step inside the 0.2 s window. With
pipeline parallelism a snapshot names the batches in flight, and in an engine core what
each stage is doing and on which batch, as its workers report it (stage_progress.py)."""
import asyncio
import dataclasses
import json
import time

import pytest

from nanopaged import EngineConfig, LLMEngine, SamplingParams
from nanopaged.dashboard.sampler import MAX_STEPS, DashboardSampler, build_snapshot, stage_rows
from nanopaged.dashboard.serving import WATCHER
from nanopaged.engine.engine_core_client import EngineCoreProc
from nanopaged.multiproc.executor import MultiprocExecutor
from nanopaged.multiproc.stage_progress import COMPUTING, IDLE, SENDING, STATES, StageBoard, StageReporter

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine(folder, **kw) -> LLMEngine:
    kw = {"num_gpu_blocks": 32, "block_size": 4, "attention_backend": "torch", "num_cpu_blocks": 0, **kw}
    return LLMEngine(EngineConfig(model=str(folder), **kw))


def snapshot(eng):
    return build_snapshot(eng, [], eng.num_steps, 0.0)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_running_request_shows_its_blocks_with_owner_and_ref_count(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request("a", list(range(1, 8)), GREEDY)              # 7 tokens: 2 blocks of 4
    eng.step()
    snap = snapshot(eng)
    seq = eng.requests["a"].seqs[0]
    table = seq.block_table.block_ids
    assert snap.running == ["a"] and snap.waiting == snap.swapped == []
    (req,) = snap.requests
    assert (req.request_id, req.status, req.num_prompt_tokens, req.num_output_tokens) == ("a", "running", 7, 1)
    assert req.prompt is None and req.output is None                # the core has no text
    (dseq,) = req.seqs
    assert (dseq.seq_id, dseq.block_table, dseq.on_cpu, dseq.num_computed_tokens, dseq.num_tokens) == (
        seq.seq_id, table, False, 7, 8)
    for b in range(snap.num_gpu_blocks):
        assert (snap.gpu_owners[b], snap.gpu_ref_count[b]) == ((["a"], 1) if b in table else ([], 0))
    assert snap.stats["kv_usage"] == pytest.approx(len(table) / 32)
    assert json.loads(json.dumps(dataclasses.asdict(snap)))["requests"][0]["seqs"][0]["block_table"] == table


def test_each_request_names_its_lora_adapter(tiny_model_dir, tmp_path):
    """With enable_lora a request's row names the adapter it runs with (lora_name, read
    from the scheduler's table by sampler.lora_names), None for the base model, in the
    JSON the page gets too; an engine without LoRA has no table."""
    from nanopaged import LoRARequest
    from nanopaged.dashboard.sampler import lora_names
    from nanopaged.lora.random_adapter import write_random_adapter
    eng = engine(tiny_model_dir, enable_lora=True, max_loras=1)
    folder = write_random_adapter(tmp_path / "sql", eng.model_config)
    eng.add_request("a", list(range(1, 8)), GREEDY, lora_request=LoRARequest("sql", 1, str(folder)))
    eng.add_request("b", list(range(1, 8)), GREEDY)
    eng.step()
    snap = snapshot(eng)
    assert {r.request_id: r.lora_name for r in snap.requests} == {"a": "sql", "b": None}
    assert [r["lora_name"] for r in json.loads(json.dumps(dataclasses.asdict(snap)))["requests"]] == ["sql", None]
    assert lora_names(engine(tiny_model_dir)) is None


def test_n2_shares_its_prompt_blocks_with_ref_count_2_then_all_free_or_cached(tiny_model_dir):
    eng = engine(tiny_model_dir)
    sampler = DashboardSampler()
    eng.add_observer(sampler)
    eng.add_request("a", list(range(1, 10)), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6,
                                                            ignore_eos=True))
    eng.step()                                       # the prefill, then the fork
    sampler.end_step(eng.num_steps)
    snap = snapshot(eng)
    (req,) = snap.requests
    t0, t1 = (s.block_table for s in req.seqs)
    assert len(req.seqs) == 2 and t0 == t1           # forked: one table, held twice
    assert all(snap.gpu_ref_count[b] == 2 and snap.gpu_owners[b] == ["a"] for b in t0)
    eng.step()                                       # both write into the shared last block
    sampler.end_step(eng.num_steps)
    cow = [c for s in sampler.steps for c in s.copy_on_write]
    assert len(cow) == 1 and cow[0]["src"] == t0[-1]
    while eng.has_unfinished_requests():
        eng.step()
    snap = snapshot(eng)
    assert snap.requests == [] and snap.running == []
    assert all(r == 0 and o == [] for r, o in zip(snap.gpu_ref_count, snap.gpu_owners))
    assert snap.gpu_cached[t0[0]] and snap.gpu_cached[t0[1]]    # the full prompt blocks: free, cached
    assert snap.stats["num_copy_on_write"] == 1


def test_the_sampler_coalesces_steps_into_at_most_one_snapshot_per_interval(tiny_model_dir):
    eng = engine(tiny_model_dir)
    clock = FakeClock()
    sampler = DashboardSampler(start=clock(), clock=clock)
    eng.add_observer(sampler)
    eng.add_request("a", list(range(1, 8)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    snaps = []
    for _ in range(5):                               # within one interval: one snapshot, the first
        eng.step()
        sampler.end_step(eng.num_steps)
        snaps.append(sampler.poll(eng))
    assert snaps[0] is not None and snaps[1:] == [None] * 4
    assert [s.step for s in snaps[0].steps] == [1]
    assert snaps[0].steps[0].scheduled == [{"request_id": "a", "seq_id": 0, "kind": "prefill", "num_tokens": 7}]
    clock.now += 0.25                                # past the 0.2 s interval
    snap = sampler.poll(eng)
    assert [s.step for s in snap.steps] == [2, 3, 4, 5] and snap.step == 5 and snap.time == pytest.approx(0.25)
    assert all(s.scheduled[0]["kind"] == "decode" for s in snap.steps)
    assert snap.stats["tokens_per_s"] == pytest.approx(4 / 0.25)     # 4 tokens since the first snapshot
    assert sampler.poll(eng) is None and sampler.poll(eng, force=True) is not None
    for _ in range(MAX_STEPS + 5):                   # more steps than a snapshot carries: the latest
        eng.step()
        sampler.end_step(eng.num_steps)
    clock.now += 1.0
    snap = sampler.poll(eng)
    assert len(snap.steps) == MAX_STEPS and snap.steps[-1].step == eng.num_steps


def test_the_first_step_after_a_rest_is_shown_at_once(tiny_model_dir):
    """The snapshot taken as the engine goes idle does not hold back the next burst: a
    burst shorter than the interval (a fast CPU, a short request) is still seen running.
    CI on a faster CPU caught this: each round of a server test fell inside 0.2 s."""
    eng = engine(tiny_model_dir)
    clock = FakeClock()
    sampler = DashboardSampler(start=clock(), clock=clock)
    eng.add_observer(sampler)
    assert sampler.poll(eng, resting=True).requests == []           # idle: the rest snapshot
    clock.now += 0.01                                               # well inside 0.2 s
    eng.add_request("a", list(range(1, 8)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.step()
    sampler.end_step(eng.num_steps)
    snap = sampler.poll(eng)
    assert snap is not None and snap.requests[0].status == "running"
    eng.step()                                                      # after that, the interval again
    sampler.end_step(eng.num_steps)
    assert sampler.poll(eng) is None


def test_preemption_is_a_decision_of_its_step(tiny_model_dir):
    eng = engine(tiny_model_dir, num_gpu_blocks=6, preemption_mode="recompute")
    sampler = DashboardSampler()
    eng.add_observer(sampler)
    for rid in "ab":
        eng.add_request(rid, list(range(1, 9)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        sampler.end_step(eng.num_steps)
        seen += [p for s in sampler.steps for p in s.preempted]
        sampler.steps.clear()
    assert {"request_id": "b", "mode": "recompute"} in seen


def test_the_core_process_listens_only_while_a_viewer_watches(tiny_model_dir, tmp_path):
    eng = engine(tiny_model_dir)
    core = eng.engine_core
    proc = EngineCoreProc(core, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", parent_pid=0)
    try:
        assert list(core.observers) == [] and proc.watchers == {}
        proc.watch("dashboard", DashboardSampler)
        sampler = proc.watchers["dashboard"]
        assert list(core.observers) == [sampler] and sampler._now
        assert sampler.start == core.start_time      # snapshots' time counts from the engine's start
        proc.watch("dashboard", DashboardSampler)   # a second viewer: still one observer
        assert len(core.observers) == 1 and proc.watchers == {"dashboard": sampler}
        proc.watch("dashboard", None)
        assert list(core.observers) == [] and proc.watchers == {}
    finally:
        proc.input.close(linger=0)
        proc.output.close(linger=0)
        proc.ctx.term()


def test_as_a_core_watcher_the_sampler_owes_the_resting_state_and_a_zero_rate_a_second_later(tiny_model_dir):
    """The CoreWatcher hooks EngineCoreProc calls: a snapshot at once for a new viewer,
    the interval after a step, one owed before the loop rests, and a wake a second later
    for the 0 tokens/s snapshot (then nothing until something changes)."""
    eng = engine(tiny_model_dir)
    core, clock = eng.engine_core, FakeClock()
    sampler = DashboardSampler(clock=clock)
    sampler.watch(core)
    assert sampler.after_step(core, stepped=False).requests == []         # a viewer joined: at once
    assert sampler.before_rest(core) is None and not sampler.wants_wake()  # nothing new
    eng.add_request("a", list(range(1, 8)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    clock.now += 0.05
    while eng.has_unfinished_requests():
        eng.step()
        assert sampler.after_step(core, stepped=True) is None              # inside the 0.2 s interval
    rest = sampler.before_rest(core)
    assert [s.step for s in rest.steps] == [1, 2] and rest.stats["tokens_per_s"] > 0
    assert not sampler.wants_wake()
    clock.now += 1.0
    assert sampler.wants_wake()
    assert sampler.before_rest(core).stats["tokens_per_s"] == 0
    assert not sampler.wants_wake() and sampler.before_rest(core) is None
    sampler.unwatch(core)
    assert list(core.observers) == []


def test_a_viewer_gets_the_idle_state_at_once_and_the_final_state_after_a_burst(tiny_model_dir):
    from nanopaged.engine.async_llm import AsyncLLM
    from nanopaged.sampling_params import RequestOutputKind

    async def main():
        llm = AsyncLLM(str(tiny_model_dir), num_gpu_blocks=32, block_size=4, attention_backend="torch",
                       preemption_mode="recompute", num_cpu_blocks=0)
        try:
            got = []
            llm.watch(WATCHER, DashboardSampler, got.append)
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert got and got[0].requests == [] and sum(got[0].gpu_ref_count) == 0   # idle: at once
            await asyncio.sleep(0.25)                # past the 0.2 s interval: the first step's snapshot goes at once
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            [out async for out in llm.generate(list(range(1, 10)), params, "r")]
            # the last steps fell inside the 0.2 s window: flushed before the core blocks
            deadline = time.monotonic() + 10
            while (got[-1].requests or got[-1].step == 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            last = got[-1]
            assert last.requests == [] and sum(last.gpu_ref_count) == 0 and last.step >= 4
            assert any(s.requests and s.requests[0].status == "running" for s in got)
            assert len(got) <= 2 + (time.monotonic() - start) / 0.2 + 1
            llm.unwatch(WATCHER)
        finally:
            llm.shutdown()

    start = time.monotonic()
    asyncio.run(main())


def test_a_huge_pool_is_drawn_up_to_max_blocks(tiny_model_dir, monkeypatch):
    """The per-block lists stop at MAX_BLOCKS (the tiny model's default swap pool has
    millions of blocks); the pool sizes stay the real ones, block tables stay whole."""
    import nanopaged.dashboard.sampler as dashboard
    monkeypatch.setattr(dashboard, "MAX_BLOCKS", 8)
    eng = engine(tiny_model_dir, num_gpu_blocks=32, num_cpu_blocks=40)
    eng.add_request("a", list(range(1, 40)), GREEDY)              # 39 tokens: 10 blocks
    eng.step()
    snap = snapshot(eng)
    assert (snap.num_gpu_blocks, snap.num_cpu_blocks) == (32, 40)
    assert len(snap.gpu_ref_count) == len(snap.gpu_cached) == len(snap.gpu_owners) == 8
    assert snap.cpu_owners == {}                                   # nothing swapped out
    assert snap.requests[0].seqs[0].block_table == eng.requests["a"].seqs[0].block_table.block_ids
    assert len(snap.requests[0].seqs[0].block_table) == 10


def test_an_idle_engine_reports_zero_tokens_per_s_a_second_later(tiny_model_dir):
    """The flush when the engine goes idle still counts the last busy second; about a
    second later the core sends one more snapshot, with tokens_per_s 0 (not a stale rate
    for as long as the engine rests)."""
    from nanopaged.engine.async_llm import AsyncLLM
    from nanopaged.sampling_params import RequestOutputKind

    async def main():
        llm = AsyncLLM(str(tiny_model_dir), num_gpu_blocks=32, block_size=4, attention_backend="torch",
                       preemption_mode="recompute", num_cpu_blocks=0)
        try:
            got = []
            llm.watch(WATCHER, DashboardSampler, got.append)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            [out async for out in llm.generate(list(range(1, 10)), params, "r")]
            deadline = time.monotonic() + 10
            while not any(s.stats["tokens_per_s"] > 0 for s in got) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert any(s.stats["tokens_per_s"] > 0 for s in got)
            while (got[-1].requests or got[-1].stats["tokens_per_s"] > 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert got[-1].requests == [] and got[-1].stats["tokens_per_s"] == 0
            count = len(got)
            await asyncio.sleep(1.5)                     # and then it rests: nothing more is sent
            assert len(got) == count
            llm.unwatch(WATCHER)
        finally:
            llm.shutdown()

    asyncio.run(main())


@pytest.fixture(scope="module")
def pp2(tiny_model_dir):
    """An engine of two pipeline stages in worker processes, shared by this file's pp=2
    tests (each of its steps can take a prompt's chunk of 8 tokens)."""
    eng = engine(tiny_model_dir, pipeline_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=8)
    yield eng
    eng.shutdown()


def test_at_pp2_the_snapshots_name_the_batches_in_flight_and_each_step_its_batches(pp2, tiny_model_dir):
    """Pipeline parallelism (chapter 20), two stages in worker processes, a token budget
    that one prompt's chunk fills: a and b go down the pipe in two batches. A snapshot
    names the requests of the batches in flight (the scheduler's in_flight_batches), and
    each step the batches in flight during it, oldest first: the one it took in, then
    the one it sent. They alternate, and no request is in two batches at once."""
    eng = pp2
    sampler = DashboardSampler()
    eng.add_observer(sampler)
    eng.add_request("a", list(range(1, 11)), GREEDY)          # 10 tokens: two chunks of the budget
    eng.add_request("b", list(range(21, 31)), GREEDY)
    snaps = []
    try:
        while eng.has_unfinished_requests():
            eng.step()
            sampler.end_step(eng.num_steps, eng)
            snaps.append(sampler.poll(eng, force=True))
            names = {s.seq_id: g.request_id for g in eng.scheduler.requests.values() for s in g.seqs}
            assert snaps[-1].in_flight == [{"request_ids": [names[i] for i in b], "seq_ids": b}
                                           for b in eng.scheduler.in_flight_batches]
    finally:
        eng.remove_observer(sampler)
    assert {s.pipeline_parallel_size for s in snaps} == {2}
    assert all(s.stages == [] for s in snaps)       # an LLMEngine, as the tracer reads: no stage rows
    assert [b["request_ids"] for b in snaps[0].in_flight] == [["b"]]         # a's first chunk taken in
    during = [[b["request_ids"] for b in step.in_flight] for s in snaps for step in s.steps]
    assert during[:4] == [[["a"], ["b"]], [["b"], ["a"]], [["a"], ["b"]], [["b"], ["a"]]], during
    assert all(len({r for b in d for r in b}) == sum(len(b) for b in d) for d in during), during
    assert during[-1] == [["b"]] or during[-1] == [] and during[-2] == [["b"]], during      # b's last, alone
    assert snaps[-1].in_flight == [] and snaps[-1].requests == []
    back = json.loads(json.dumps(dataclasses.asdict(snaps[1])))
    assert back["steps"][0]["in_flight"][0]["request_ids"] == ["b"] and back["pipeline_parallel_size"] == 2
    one = engine(tiny_model_dir)                     # pp=1: one batch at a time, nothing listed
    sampler = DashboardSampler()
    one.add_observer(sampler)
    one.add_request("a", list(range(1, 11)), GREEDY)
    one.step()
    sampler.end_step(one.num_steps, one)
    snap = sampler.poll(one, force=True)
    assert snap.pipeline_parallel_size == 1 and snap.in_flight == [] and snap.steps[0].in_flight == []
    assert build_snapshot(one.engine_core, [], 1, 0.0).stages == []          # no stages to report


def check_stage_rows(snap, core) -> None:
    """A snapshot's stage rows agree with the engine core's batch queue (its batches by
    the call ids of their execute_model): each stage names its batch's requests while
    that batch is in flight, exactly as the snapshot's in_flight list names them; a batch
    it names that is not in flight was taken in already (a stage finishing its send) or
    carried no tokens. Two stages never compute one batch at once, and a stage computes
    or sends only a batch the stage before it has reached."""
    queue = {b.future.call_id: b for b in core.batch_queue}
    batches = {n: tuple(b.scheduler_output.num_scheduled_tokens) for n, b in queue.items() if b.is_batch}
    assert [(st.stage, st.ranks) for st in snap.stages] == [(0, [0]), (1, [1])], snap.stages
    for st in snap.stages:
        assert st.state in STATES, st
        if st.batch in batches:
            assert tuple(st.seq_ids) == batches[st.batch], st
            assert {"request_ids": st.request_ids, "seq_ids": st.seq_ids} in snap.in_flight, (st, snap.in_flight)
        else:
            assert st.request_ids == st.seq_ids == [], st
            assert st.batch is None or st.batch < min(batches, default=st.batch + 1) or st.batch in queue, st
    computing = [st.batch for st in snap.stages if st.state == "computing"]
    assert len(set(computing)) == len(computing), snap.stages
    for before, st in zip(snap.stages, snap.stages[1:]):
        assert st.state not in ("computing", "sending") or (before.batch or 0) >= st.batch, snap.stages


def test_at_pp2_each_stage_names_the_batch_its_worker_reports_being_on(pp2):
    """Two stages in worker processes, each stage's first rank reporting on the board:
    snapshots taken in a loop while two batches are in flight (the engine core's queue
    filled, the oldest not yet taken in) agree with the batch queue (check_stage_rows),
    with states from the documented set; and some snapshot catches the pipeline full:
    the first stage busy on the newer batch while the last still holds the older one
    (computing it, or done with it before the core takes its output in). Both stages
    *computing* at once is not asked: on a loaded machine the OS may run the two stage
    processes one after the other, and the engine's claim is the order, not the overlap."""
    core = pp2.engine_core
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    pp2.add_request("c", list(range(41, 51)), params)
    pp2.add_request("d", list(range(61, 71)), params)
    full, polls = 0, 0
    while pp2.has_unfinished_requests():
        core._fill_queue()                                   # what step() does first
        numbers = [b.future.call_id for b in core.batch_queue if b.is_batch]
        deadline = time.monotonic() + 30
        while numbers:                                       # until the last stage is done with the oldest
            snap = build_snapshot(core, [], core.num_steps, 0.0)
            polls += 1
            check_stage_rows(snap, core)
            first, last = snap.stages
            if len(numbers) == 2 and first.state != "idle" and [first.batch, last.batch] == numbers[::-1]:
                full += 1
                break
            if (last.batch or 0) > numbers[0] or last.batch == numbers[0] and last.state == "idle":
                break
            assert time.monotonic() < deadline, snap.stages
        pp2.step()
    assert full, f"no snapshot of {polls} showed the first stage on the newer batch, the last on the older"
    assert core.stage_progress()[1] == {}                 # nothing left in flight


def test_stage_rows_name_a_stages_batch_while_it_is_in_flight():
    rows = stage_rows([(7, "sending"), (6, "computing"), (5, "idle"), None], {6: (1, 2), 7: (3,)}, 2,
                      {1: "a", 2: "a", 3: "b"})
    assert [dataclasses.astuple(r) for r in rows] == [
        (0, [0, 1], "sending", 7, ["b"], [3]),          # the newest batch, still leaving the first stage
        (1, [2, 3], "computing", 6, ["a"], [1, 2]),     # a request's two sequences: named once
        (2, [4, 5], "idle", 5, [], []),                 # batch 5 was taken in: its number only
        (3, [6, 7], "unknown", None, [], [])]           # another host's: nothing reported
    assert dataclasses.astuple(stage_rows([(0, "idle")], {}, 1, {})[0]) == (0, [0], "idle", None, [], [])


def test_the_board_carries_each_stages_word_and_another_hosts_stage_is_unknown(tmp_path):
    """stage_progress.py: a reporter's states reach a reader of the same file; the
    executor reports None for the stages whose first rank lives on another host."""
    board = StageBoard(str(tmp_path / "stages"), 3, create=True)
    assert board.read() == [(0, "idle")] * 3
    writer = StageReporter(StageBoard(str(tmp_path / "stages"), 3), stage=1)     # as a worker maps it
    writer.begin(41)
    assert board.read()[1] == (41, "preparing")
    writer.set(COMPUTING)
    StageReporter(StageBoard(str(tmp_path / "stages"), 3), stage=2).begin(40)
    assert board.read() == [(0, "idle"), (41, "computing"), (40, "preparing")]
    writer.set(SENDING)
    writer.set(IDLE)
    assert board.read()[1] == (41, "idle")
    StageReporter().begin(9)                              # no board: a private word nobody reads
    assert board.read() == [(0, "idle"), (41, "idle"), (40, "preparing")]
    executor = type("Grid", (), {"stage_board": board, "tensor_parallel_size": 2, "num_local_ranks": 4})()
    assert MultiprocExecutor.stage_progress(executor) == [(0, "idle"), (41, "idle"), None]     # ranks 4, 5 remote


def test_a_float32_model_shows_float32_weights_of_its_parameters_bytes(tiny_model_dir):
    """The snapshot's weight_bytes: the engine's WeightsInfo, one format for a float32
    model, its parameters' bytes."""
    eng = engine(tiny_model_dir, dtype="float32")
    params = sum(p.numel() * p.element_size() for p in eng.model_runner.model.parameters())
    assert snapshot(eng).weight_bytes == eng.weights.bytes_by_format == {"float32": params}
    assert eng.weights.describe() == f"float32 {params / 1e6:.1f} MB"
