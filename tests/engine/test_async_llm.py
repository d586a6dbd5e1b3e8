"""AsyncLLM and the EngineCore process (engine_core_client.py): streams equal the
offline engine, leaving a stream aborts the request (C23), a dead core raises
EngineDeadError at once, and no core process outlives its AsyncLLM or its parent."""
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nanopaged import LLM, SamplingParams
from nanopaged.engine.async_llm import AsyncLLM, EngineDeadError
from nanopaged.messages import EngineCoreRequestType
from nanopaged.sampling_params import RequestOutputKind

pytestmark = pytest.mark.timeout(180)

DELTA = RequestOutputKind.DELTA
PROMPTS = ["The capital of France is", "Hello, my name is", "Paged attention splits", "The KV cache"]
# recompute, no swap pool: an engine starts without measuring preemption costs (~4 s less)
ENGINE_ARGS = dict(num_gpu_blocks=48, block_size=4, max_num_seqs=8, preemption_mode="recompute",
                   num_cpu_blocks=0, dtype="float32")


def pid_alive(pid: int) -> bool:
    """True while pid runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


async def settled(predicate, timeout=5.0):
    """wait_until, inside the event loop: lets an abandoned generator's aclose() run
    (asyncio closes an async generator left by `break` from the loop, soon after)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return predicate()


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loop):
    eng = AsyncLLM(str(tiny_model_dir), **ENGINE_ARGS)
    yield eng
    pid = eng.engine_core.proc.pid
    eng.shutdown()
    loop.run_until_complete(asyncio.sleep(0))          # let the output handler see its cancel
    assert not pid_alive(pid), "the EngineCore process outlived shutdown()"


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), **ENGINE_ARGS)


async def collect(engine, prompt, params, request_id):
    """(token ids, text, finish_reason) of completion 0 from a DELTA stream."""
    ids, text, reason = [], "", None
    async for out in engine.generate(prompt, params, request_id):
        for c in out.outputs:
            if c.index == 0:
                ids += c.token_ids
                text += c.text
                reason = c.finish_reason or reason
    return ids, text, reason


def test_concurrent_streams_equal_the_offline_engine(engine, offline, loop):
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True, output_kind=DELTA)
              for i in range(len(PROMPTS))]
    params += [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10, output_kind=DELTA)
               for i in range(len(PROMPTS))]
    prompts = PROMPTS * 2

    async def run():
        return await asyncio.gather(*[collect(engine, p, sp, f"c{i}")
                                      for i, (p, sp) in enumerate(zip(prompts, params))])

    got = loop.run_until_complete(run())
    want = offline.generate(prompts, params, use_tqdm=False)
    for (ids, text, reason), w in zip(got, want):
        assert ids == w.outputs[0].token_ids
        assert text == w.outputs[0].text
        assert reason == w.outputs[0].finish_reason
    assert loop.run_until_complete(settled(lambda: engine.get_stats()["num_free_gpu_blocks"] == 48))


def test_cumulative_and_final_only_kinds(engine, offline, loop):
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]

    async def run(kind):
        return [out async for out in engine.generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=kind))]

    cumulative = loop.run_until_complete(run(RequestOutputKind.CUMULATIVE))
    assert len(cumulative) == 6 and cumulative[-1].outputs[0].token_ids == want.token_ids
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    final = loop.run_until_complete(run(RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == want.text


def test_stop_string_ends_the_stream(engine, offline, loop):
    full = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    stop = full[5:8]
    want = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                       stop=[stop]), use_tqdm=False)[0].outputs[0]
    ids, text, reason = loop.run_until_complete(collect(
        engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                           output_kind=DELTA), "stop"))
    assert (text, reason) == (want.text, "stop") and stop not in text


def test_c23_leaving_a_stream_aborts_the_request(engine, offline, loop):
    """Field case C23: a long stream left after two deltas leaves the core within one
    step, gets no more deltas, and returns every block; the next request is unaffected."""
    start_free = engine.get_stats()["num_total_gpu_blocks"]
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, output_kind=DELTA)

    async def leave_after_two():
        n = 0
        async for _ in engine.generate(PROMPTS[2], long, "long"):
            n += 1
            if n == 2:
                break
        return n, await settled(lambda: engine.get_stats()["num_free_gpu_blocks"] == start_free
                                and engine.get_stats()["num_running"] == 0)

    assert loop.run_until_complete(leave_after_two()) == (2, True)
    assert engine.get_stats()["num_unfinished_requests"] == 0
    # a cancelled task (an HTTP client gone) aborts too
    async def cancel_mid_stream():
        two_deltas = asyncio.Event()

        async def slow_client():
            n = 0
            async for _ in engine.generate(PROMPTS[2], long, "cancelled"):
                n += 1
                if n == 2:
                    two_deltas.set()
                    await asyncio.sleep(60)

        task = asyncio.ensure_future(slow_client())
        await two_deltas.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await settled(lambda: engine.get_stats()["num_free_gpu_blocks"] == start_free
                             and engine.get_stats()["num_running"] == 0)

    assert loop.run_until_complete(cancel_mid_stream())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=DELTA)
    ids, _, _ = loop.run_until_complete(collect(engine, PROMPTS[3], params, "after"))
    assert ids == offline.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture
def two_busy_processes():
    """Two processes that spin on the CPU beside the test (a loaded machine); ended by pid."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait(timeout=10)


@pytest.mark.timeout(300)
def test_a_request_id_reused_right_after_leaving_gets_only_its_own_tokens(engine, offline, loop,
                                                                         two_busy_processes):
    """Field case C49 (C49r in CASES.md). Leave a long stream under id X after two outputs, then at once send
    a short request under X again. The first request's last outputs may still be on their way from the
    core (it has not seen the abort yet); they must not reach the second request. With
    one id for both they did, on a loaded CPU: the 24-token request ended with hundreds
    of tokens (vLLM #23697 is the same class). Each request has an internal id of its own."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=DELTA)
    short = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=DELTA)
    want = offline.generate(PROMPTS[1], short, use_tqdm=False)[0].outputs[0].token_ids

    async def one_round():
        stream = engine.generate(PROMPTS[0], long, "X")
        n = 0
        async for out in stream:
            assert out.request_id == "X"
            n += 1
            if n == 2:
                break
        await stream.aclose()
        ids = []
        async for out in engine.generate(PROMPTS[1], short, "X"):
            assert out.request_id == "X"
            ids += out.outputs[0].token_ids
        return ids

    for round_ in range(20):
        ids = loop.run_until_complete(one_round())
        assert ids == want, f"round {round_}: {len(ids)} tokens, want the 24 of the second request"
    assert loop.run_until_complete(settled(lambda: engine.get_stats()["num_running"] == 0))


def test_check_health_pings_the_core(engine, loop):
    """check_health waits for the core's answer to a ping: a frozen core (SIGSTOP) is
    EngineUnresponsiveError, and healthy again once it runs (SIGCONT)."""
    from nanopaged.engine.async_llm import EngineUnresponsiveError
    loop.run_until_complete(engine.check_health(timeout=10))
    pid = engine.engine_core.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(EngineUnresponsiveError, match=f"pid {pid}.*within 0.5 s"):
            loop.run_until_complete(engine.check_health(timeout=0.5))
    finally:
        os.kill(pid, signal.SIGCONT)
    loop.run_until_complete(engine.check_health(timeout=10))
    assert not engine._pings                           # no answer left waiting


def test_the_heartbeat_keeps_the_core_heard_and_a_frozen_one_ages(engine, loop):
    """start_heartbeat pings the core, one ping at a time; seconds_since_heard(), which
    never waits, is the age of the core's last message: small while it idles, growing
    while it is frozen (SIGSTOP, one ping left unanswered, no pile), small again once it
    runs (SIGCONT). The server's /health reads it."""
    pid = engine.engine_core.proc.pid

    async def run():
        beat = engine.start_heartbeat(0.1)
        try:
            await asyncio.sleep(0.6)
            idle = engine.seconds_since_heard()
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(1.2)
                frozen, unanswered = engine.seconds_since_heard(), len(engine._pings)
            finally:
                os.kill(pid, signal.SIGCONT)
            await settled(lambda: engine.seconds_since_heard() < 0.5)
            return idle, frozen, unanswered, engine.seconds_since_heard()
        finally:
            beat.cancel()
            await asyncio.sleep(0)

    idle, frozen, unanswered, again = loop.run_until_complete(run())
    assert idle < 0.5 and frozen > 1.0 and unanswered == 1 and again < 0.5, (idle, frozen, unanswered, again)
    assert not engine._pings


def test_abort_with_an_error_raises_it_in_the_stream(engine, loop):
    """abort(ids, error): the generate loop raises error (a stopping server tells its
    clients so) and the request leaves the core; running_request_ids() lists the
    caller's ids."""
    class Stopping(Exception):
        pass

    async def run():
        got, ids = [], None
        with pytest.raises(Stopping, match="the server is shutting down"):
            async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True,
                                                                        output_kind=DELTA), "to-stop"):
                got.append(out)
                if len(got) == 1:
                    ids = engine.running_request_ids()
                    await engine.abort(ids, Stopping("the server is shutting down"))
        return ids, engine.running_request_ids(), await settled(lambda: engine.get_stats()["num_running"] == 0)

    ids, after, settled_ok = loop.run_until_complete(run())
    assert ids == ["to-stop"] and after == [] and settled_ok


def test_abort_ends_the_stream_quietly(engine, loop):
    async def run():
        got = []
        async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True,
                                                                    output_kind=DELTA), "to-abort"):
            got.append(out)
            if len(got) == 1:
                await engine.abort("to-abort")
        return got, await settled(lambda: engine.get_stats()["num_running"] == 0)

    got, settled_ok = loop.run_until_complete(run())
    assert not got[-1].finished and settled_ok


def test_bad_requests_raise_and_the_engine_keeps_serving(engine, loop):
    async def first(prompt, params, request_id=None):
        gen = engine.generate(prompt, params, request_id)
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()                         # leaves the request: it is aborted

    with pytest.raises(ValueError, match="prompt is empty"):
        loop.run_until_complete(first("", SamplingParams()))
    with pytest.raises(ValueError, match="max_model_len=256"):
        loop.run_until_complete(first(list(range(1, 300)), SamplingParams()))
    with pytest.raises(TypeError, match="prompt"):
        loop.run_until_complete(first(3.5, SamplingParams()))
    with pytest.raises(TypeError, match="request_id must be a str, got int"):
        loop.run_until_complete(first(PROMPTS[0], SamplingParams(), 7))
    # refused by the core itself: more KV blocks than the whole pool (48 blocks of 4)
    with pytest.raises(ValueError, match="KV cache holds only 48 blocks"):
        loop.run_until_complete(first(list(range(1, 200)), SamplingParams(), "too-big"))

    async def duplicate():
        a = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, output_kind=DELTA), "dup")
        await a.__anext__()
        try:
            with pytest.raises(ValueError, match="already in use"):
                await first(PROMPTS[1], SamplingParams(), "dup")
        finally:
            await a.aclose()

    loop.run_until_complete(duplicate())
    assert loop.run_until_complete(first(PROMPTS[0], SamplingParams(max_tokens=2))).outputs
    assert loop.run_until_complete(settled(lambda: engine.get_stats()["num_free_gpu_blocks"] == 48))


def test_admission_bounds_and_stop_reason_as_the_offline_engine(engine, loop):
    """Issue 34 through AsyncLLM (the server's engine): n past max_num_seqs (8 here),
    logprobs past max_logprobs and prompt + max_tokens past max_model_len raise the
    Processor's ValueError on the first output, nothing queued; an eos ends a stream
    with stop_reason None, a stop_token_ids id with the id."""
    async def first(params):
        gen = engine.generate(PROMPTS[0], params)
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    for params, message in ((SamplingParams(n=9), r"SamplingParams.n=9 is more than max_num_seqs=8"),
                            (SamplingParams(logprobs=21), r"SamplingParams.logprobs=21 is more than max_logprobs=20"),
                            (SamplingParams(max_tokens=1000), r"This model's maximum context length is 256 tokens. "
                                                              r"However, you requested 10\d\d tokens")):
        with pytest.raises(ValueError, match=message):
            loop.run_until_complete(first(params))
    eos, stop = 0, 7                                   # the tiny model's eos id; a logit bias picks the token

    async def ends(params):
        outs = [o async for o in engine.generate(PROMPTS[0], params)]
        c = outs[-1].outputs[0]
        return c.finish_reason, c.stop_reason

    assert loop.run_until_complete(ends(SamplingParams(temperature=0, logit_bias={eos: 100}, output_kind=DELTA))) \
        == ("stop", None)
    assert loop.run_until_complete(ends(SamplingParams(temperature=0, logit_bias={stop: 100}, stop_token_ids=[stop],
                                                       output_kind=DELTA))) == ("stop", stop)
    assert loop.run_until_complete(settled(lambda: engine.get_stats()["num_free_gpu_blocks"] == 48))


def test_a_killed_core_fails_every_stream_at_once(tiny_model_dir):
    eng = AsyncLLM(str(tiny_model_dir), **ENGINE_ARGS)
    pid = eng.engine_core.proc.pid
    params = SamplingParams(max_tokens=None, ignore_eos=True, output_kind=DELTA)

    async def run():
        started = [asyncio.Event() for _ in range(3)]

        async def stream(i):
            async for _ in eng.generate(PROMPTS[i], params):
                started[i].set()
        tasks = [asyncio.ensure_future(stream(i)) for i in range(3)]
        for event in started:
            await event.wait()
        os.kill(pid, signal.SIGKILL)                   # mid-stream: each has had a delta
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        return results, time.monotonic() - t0

    loop = asyncio.new_event_loop()
    try:
        results, _ = loop.run_until_complete(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert f"(pid {pid}) died: killed by SIGKILL" in str(results[0])
        assert eng.errored
        with pytest.raises(EngineDeadError):
            loop.run_until_complete(eng.check_health())
        with pytest.raises(EngineDeadError):
            loop.run_until_complete(eng.generate(PROMPTS[0], params).__anext__())
    finally:
        eng.shutdown()
        loop.run_until_complete(asyncio.sleep(0))      # let the output handler see its cancel
        loop.close()
    assert not pid_alive(pid)


def test_a_core_that_raises_says_why(tiny_model_dir):
    eng = AsyncLLM(str(tiny_model_dir), **ENGINE_ARGS)
    loop = asyncio.new_event_loop()

    async def run():
        gen = eng.generate(PROMPTS[0], SamplingParams(max_tokens=None, ignore_eos=True, output_kind=DELTA))
        await gen.__anext__()
        eng.engine_core._send(EngineCoreRequestType.STOP_SEQUENCES, None)   # not a list: the core fails
        async for _ in gen:
            pass

    try:
        with pytest.raises(EngineDeadError, match="TypeError"):
            loop.run_until_complete(asyncio.wait_for(run(), 10))
    finally:
        eng.shutdown()
        loop.run_until_complete(asyncio.sleep(0))      # let the output handler see its cancel
        loop.close()


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_no_core_process_outlives_its_parent(tiny_model_dir, tmp_path, how):
    """The parent exits without calling shutdown() (cleanup at exit), or is SIGKILLed
    (no cleanup runs at all): either way the core process goes too."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from nanopaged.engine.async_llm import AsyncLLM
        eng = AsyncLLM({str(tiny_model_dir)!r}, num_gpu_blocks=16, preemption_mode="recompute")
        print(eng.engine_core.proc.pid, flush=True)
        sys.stdin.readline()                      # until the test says go
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        if how == "kill":
            parent.kill()
        else:
            parent.stdin.write("go\n")
            parent.stdin.flush()
        parent.wait(30)
        assert wait_until(lambda: not pid_alive(child), timeout=10), "orphaned EngineCore process"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_async_scheduling_in_the_core_process(tiny_model_dir, offline):
    """The core process with async scheduling on (chapter 16): the same streams, and a
    stream left early still frees its blocks."""
    eng = AsyncLLM(str(tiny_model_dir), async_scheduling=True, **ENGINE_ARGS)
    loop = asyncio.new_event_loop()
    params = [SamplingParams(temperature=0, max_tokens=5 + 4 * i, ignore_eos=True, output_kind=DELTA)
              for i in range(len(PROMPTS))]

    async def run():
        got = await asyncio.gather(*[collect(eng, p, sp, f"o{i}")
                                     for i, (p, sp) in enumerate(zip(PROMPTS, params))])
        gen = eng.generate(PROMPTS[0], SamplingParams(max_tokens=150, ignore_eos=True, output_kind=DELTA))
        await gen.__anext__()
        await gen.aclose()
        return got, await settled(lambda: eng.get_stats()["num_free_gpu_blocks"] == 48
                                  and eng.get_stats()["num_running"] == 0)

    try:
        got, freed = loop.run_until_complete(run())
    finally:
        eng.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    want = offline.generate(PROMPTS, params, use_tqdm=False)
    assert [g[0] for g in got] == [w.outputs[0].token_ids for w in want]
    assert freed
