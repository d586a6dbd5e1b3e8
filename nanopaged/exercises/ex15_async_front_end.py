"""Exercise 15 (chapter 15): AsyncLLM's front end, streams and the one output handler."""
from __future__ import annotations

import asyncio
import functools
from contextlib import contextmanager

NUMBER = 15
CHAPTER = "15-entry-layer.md"
TITLE = "AsyncLLM: one queue per stream, one output handler"
TARGETS = ["nanopaged.engine.async_llm:AsyncLLM.generate",
           "nanopaged.engine.async_llm:AsyncLLM._handle_outputs"]
TASK = """
Write the two halves of AsyncLLM's front end. `generate` is one request's stream: check,
tokenize (self.processor), give the request a queue of its own, send it to the core,
then yield what arrives in that queue until the last output; and however the caller
leaves the loop early (break, cancellation, an error), abort the request so the core
frees its blocks. `_handle_outputs` is the one task for all requests: it awaits each
step's EngineCoreOutputs, runs the OutputProcessor on them and puts each RequestOutput
in its request's queue; it sends stop-string matches back to the core, a request the
core refused gets a ValueError, and when the core dies every waiting stream gets the
EngineDeadError. The checks run the real EngineCore in this process behind a stand-in
for the core process's client (the same methods as AsyncMPClient), so your code is
what the streams go through.
"""
HINT = """
generate: `self._check_alive()`, `self._start_output_handler()`, `number =
next(self._request_counter)`, pick an id if none (f"async-{number}"), refuse a str
already in self._internal_ids (a non-str is a TypeError). The core knows the request by
an internal id of its own, f"{request_id}-{number}", so a caller may reuse request_id
at once without getting a left request's late outputs: `request, prompt_text =
self.processor.process_inputs(internal_id, ...)`, make an asyncio.Queue,
`self.output_processor.add_request(request, prompt_text, request.sampling_params.n)`,
register the queue under the internal id and self._internal_ids[request_id] = internal_id,
then in a try: `self.engine_core.add_request(request)` and loop on `await queue.get()`:
None means aborted (return), an exception is raised, otherwise set its request_id back to
the caller's, yield it and stop after the one with .finished. In `finally`: pop the queue
and the id (if it still maps to this request), and if the last output was not seen,
`self._abort_nowait([internal_id])`.
_handle_outputs: `while True: outputs = await self.engine_core.get_output_async()`;
keep outputs.scheduler_stats in self._stats; for each of outputs.rejected_requests,
forget it in the output processor and put ValueError(message) in its queue;
`processed = self.output_processor.process_outputs(outputs)`; put each of
processed.request_outputs in its queue (a queue may be gone: the caller left); send
processed.seqs_to_stop with self.engine_core.stop_sequences. Catch EngineDeadError
around the loop and put it in every queue.
"""


class _CoreHere:
    """AsyncMPClient's methods over an EngineCore in this process: the checks' stand-in
    for the core process (your functions are swapped in here only; a child process
    would not have them). Whenever the output handler awaits get_output_async and a
    request is unfinished, it runs one step, as EngineCoreProc.run does in its own
    process; after `die_after_steps` steps it dies as a killed process would."""

    def __init__(self, config, model_path) -> None:
        from nanopaged.engine.engine_core import EngineCore
        from nanopaged.features import Composition
        from nanopaged.model.config import ModelConfig

        self.core = Composition.of(config).build(EngineCore, "engine_core")(config, model_path,
                                                                           ModelConfig.from_pretrained(model_path))
        self.initial_stats = self.core.get_stats()
        self.dead_reason: str | None = None
        self._closed = False
        self._news = False                    # something to report even without a step
        self._rejected: dict[str, str] = {}
        self.die_after_steps: int | None = None

    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def _check_alive(self) -> None:
        from nanopaged.utils.proc import EngineDeadError

        if self._closed:
            raise EngineDeadError("the EngineCore process was shut down")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def add_request(self, request) -> None:
        self._check_alive()
        try:
            self.core.add_request(request)
        except (ValueError, TypeError) as e:       # EngineCoreProc refuses it the same way
            self._rejected[request.request_id] = str(e)
        self._news = True

    def abort_requests(self, request_ids) -> None:
        if request_ids and not self._closed and not self.is_dead():
            self.core.abort_requests(request_ids)
            self._news = True

    def stop_sequences(self, seqs) -> None:
        self._check_alive()
        self.core.stop_sequences(seqs)
        self._news = True

    async def get_output_async(self):
        from nanopaged.utils.proc import EngineDeadError
        from nanopaged.messages import EngineCoreOutputs

        while True:
            self._check_alive()
            if self.core.has_unfinished_requests():
                if self.die_after_steps is not None and self.core.num_steps >= self.die_after_steps:
                    self.dead_reason = "the EngineCore process (pid 0) died: killed by SIGKILL"
                    raise EngineDeadError(self.dead_reason)
                outputs = self.core.step()
            elif self._news or self._rejected:
                outputs = EngineCoreOutputs()
            else:
                await asyncio.sleep(0.002)            # idle: wait for a request
                continue
            outputs.rejected_requests, self._rejected, self._news = self._rejected, {}, False
            outputs.scheduler_stats = self.core.get_stats()
            await asyncio.sleep(0)                    # the streams get a turn between steps
            return outputs

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.shutdown()


# the tiny model, a pool of 32 blocks of 4; no swap pool (so no cost measurement at start)
_ENGINE_ARGS = dict(block_size=4, num_gpu_blocks=32, attention_backend="torch", preemption_mode="recompute",
                    num_cpu_blocks=0)


@contextmanager
def _front_end():
    """A real AsyncLLM on the tiny model, its core in this process (_CoreHere)."""
    import nanopaged.engine.async_llm as async_llm

    from . import tiny_model_folder

    saved, async_llm.AsyncMPClient = async_llm.AsyncMPClient, _CoreHere
    try:
        engine = async_llm.AsyncLLM(tiny_model_folder(), **_ENGINE_ARGS)
    finally:
        async_llm.AsyncMPClient = saved
    try:
        yield engine, engine.engine_core
    finally:
        engine.shutdown()


def _run(engine, scenario, seconds=15, why=("is the output handler started (self._start_output_handler()), and "
                                           "does every output go to its request's queue?")):
    """Run a coroutine to its end; a stream that never ends is a failure, not a hang,
    and an exception that ends the output handler task is raised here."""
    from nanopaged.utils.proc import EngineDeadError

    async def bounded():
        task = asyncio.ensure_future(scenario)
        deadline = asyncio.get_running_loop().time() + seconds
        while not task.done():
            await asyncio.wait({task}, timeout=0.05)
            handler = engine._output_handler
            if handler is not None and handler.done() and not handler.cancelled() and handler.exception():
                task.cancel()
                error = handler.exception()          # your _handle_outputs raised it
                if isinstance(error, EngineDeadError):
                    raise AssertionError(f"the output handler ended with the core's EngineDeadError ({error}) "
                                         "instead of passing it on: every waiting stream must get it in its "
                                         "queue, or they wait forever")
                raise error
            if not task.done() and asyncio.get_running_loop().time() > deadline:
                task.cancel()
                raise AssertionError(f"still waiting after {seconds} s: a stream never ended ({why})")
        return task.result()
    return asyncio.run(bounded())


def _params(max_tokens, **kw):
    from nanopaged import SamplingParams
    from nanopaged.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA, **kw)


async def _collect(engine, prompt, params, request_id):
    """The stream's outputs: [(token ids, finished, finish_reason)] of completion 0."""
    got = []
    async for out in engine.generate(prompt, params, request_id=request_id):
        got.append((list(out.outputs[0].token_ids), out.finished, out.outputs[0].finish_reason))
    return got


_PROMPTS = {"a": [1, 2, 3, 4, 5], "b": list(range(20, 33))}


@functools.cache
def _llm_tokens(rid: str, max_tokens: int) -> tuple[list[int], str]:
    """What LLM.generate (which never goes through AsyncLLM) makes of _PROMPTS[rid]:
    (token ids, text)."""
    from nanopaged import LLM

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), **_ENGINE_ARGS)
    out = llm.generate([_PROMPTS[rid]], _params(max_tokens), use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def check_two_streams():
    """two streams at once: each one's DELTA outputs add up to the tokens LLM.generate gives, and only the last says finished"""
    lengths = {"a": 3, "b": 6}
    with _front_end() as (engine, _):
        async def both():
            return await asyncio.gather(*(_collect(engine, _PROMPTS[rid], _params(n), rid)
                                          for rid, n in lengths.items()))
        results = dict(zip(lengths, _run(engine, both())))
    for rid, outs in results.items():
        tokens, want = [t for ids, _, _ in outs for t in ids], _llm_tokens(rid, lengths[rid])[0]
        assert tokens == want, f"stream {rid!r}: its deltas add up to {tokens}, LLM.generate gives {want}"
        finished = [f for _, f, _ in outs]
        assert finished and finished[-1] and not any(finished[:-1]), \
            f"stream {rid!r}: finished flags {finished}: only the last output may be finished"
        assert outs[-1][2] == "length", f"stream {rid!r} ended with finish_reason {outs[-1][2]!r}, not 'length'"


def check_leaving_aborts():
    """leaving a stream early aborts its request: the core frees its blocks at once, the front end forgets it, the other stream goes on"""
    with _front_end() as (engine, client):
        scheduler = client.core.scheduler

        async def leave_a():
            gen = engine.generate(_PROMPTS["a"], _params(100), request_id="a")
            async for _ in gen:
                break
            await gen.aclose()                   # the generator's finally runs now
            assert "a" not in scheduler.requests, (
                "stream 'a' was closed after its first output, but the core still runs request 'a' "
                f"(it holds {len(scheduler.requests['a'].seqs[0].block_table.block_ids)} blocks): "
                "leaving the loop must abort it")

        async def both():
            return await asyncio.gather(leave_a(), _collect(engine, _PROMPTS["b"], _params(6), "b"))
        _, outs_b = _run(engine, both())
        stats = engine.get_stats()
    tokens, want_b = [t for ids, _, _ in outs_b for t in ids], _llm_tokens("b", 6)[0]
    assert tokens == want_b, f"stream 'b' (the one that stayed) got {tokens}, LLM.generate gives {want_b}"
    assert stats["num_unfinished_requests"] == 0, \
        f"after both streams ended the front end still follows {stats['num_unfinished_requests']} request(s)"
    assert client.core.get_stats()["num_free_gpu_blocks"] == 32, "blocks are still held after both streams ended"


def check_stop_string():
    """a stop string the front end finds ends the stream with 'stop' and stops the sequence in the core too"""
    text = _llm_tokens("b", 12)[1]
    start = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable()
                 and text.find(text[i:i + 2]) == i)          # two plain characters, first seen there
    stop = text[start:start + 2]
    with _front_end() as (engine, client):
        scheduler = client.core.scheduler

        async def stream():
            outs = await _collect(engine, _PROMPTS["b"], _params(60, stop=[stop]), "b")
            return outs, "b" in scheduler.requests
        outs, still_running = _run(engine, stream())
    assert outs and outs[-1][1] and outs[-1][2] == "stop", \
        f"stop string {stop!r}: the stream ended with (finished, finish_reason) {outs[-1][1:] if outs else None}"
    assert not still_running, (f"the stream ended at stop string {stop!r}, but the core still runs the request "
                               "(up to max_tokens=60): send processed.seqs_to_stop to self.engine_core.stop_sequences")


def check_core_dies():
    """when the core dies, every waiting stream raises EngineDeadError (none hangs), and so does a new request"""
    import logging

    from nanopaged.utils.proc import EngineDeadError

    log = logging.getLogger("nanopaged.engine.async_llm")       # the handler logs the death:
    level = log.level                                                 # expected here, so quiet
    log.setLevel(logging.CRITICAL)
    with _front_end() as (engine, client):
        client.die_after_steps = 3

        async def scenario():
            results = await asyncio.gather(*(_collect(engine, _PROMPTS[rid], _params(50), rid) for rid in _PROMPTS),
                                           return_exceptions=True)
            try:
                await _collect(engine, [7, 8, 9], _params(5), "late")
                late = None
            except BaseException as e:
                late = e
            return results, late
        try:
            results, late = _run(engine, scenario(), seconds=10, why=(
                "the core died after 3 steps: get_output_async raised EngineDeadError; does every "
                "waiting stream get it in its queue, and raise it?"))
        finally:
            log.setLevel(level)
    for r in [*results, late]:
        if isinstance(r, NotImplementedError):
            raise r
    for rid, r in zip(_PROMPTS, results):
        assert isinstance(r, EngineDeadError), (
            f"stream {rid!r} " + (f"raised {type(r).__name__}: {r}" if isinstance(r, BaseException)
                                  else f"ended without an error after {len(r)} outputs")
            + ", not EngineDeadError, when the core died")
    assert isinstance(late, EngineDeadError), \
        f"a request made after the core died gave {late!r}, not EngineDeadError"


def check_refused_request():
    """a request the core refuses (a prompt bigger than the whole KV pool) raises ValueError in its stream, and is forgotten"""
    with _front_end() as (engine, _):
        async def scenario():
            try:
                await _collect(engine, list(range(1, 151)), _params(4), "big")    # 38 blocks of 4 > 32
                return None
            except ValueError as e:
                return e
        error = _run(engine, scenario(), seconds=10, why=(
            "the core refused it: its id and message came in outputs.rejected_requests; does its "
            "queue get a ValueError, and does the stream raise it?"))
        left = engine.get_stats()["num_unfinished_requests"]
        followed = engine.output_processor.has_unfinished_requests()
    assert error is not None and "blocks" in str(error), \
        f"a prompt of 150 tokens for a pool of 32 blocks of 4: the stream raised {error!r}, not the core's ValueError"
    assert left == 0 and not followed, \
        "the refused request is still followed by the front end (its queue, or the output processor)"


CHECKS = [check_two_streams, check_leaving_aborts, check_stop_string, check_core_dies, check_refused_request]
