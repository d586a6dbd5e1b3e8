"""AsyncLLM: the streaming entry point, for servers and anything built on asyncio.

    engine = AsyncLLM()                                   # starts the EngineCore process
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16,
                                     output_kind=RequestOutputKind.DELTA), "req-0"):
        print(out.outputs[0].text, end="", flush=True)

Three parts run at once (vLLM v1's picture):

    this process                                       the EngineCore process
    generate() per request: Processor -> add ------->  EngineCoreProc: schedule,
    output handler task: <--------- EngineCoreOutputs     forward, sample, step after step
        OutputProcessor (detokenize, stop strings),
        one asyncio.Queue per request -> generate() yields

Many `generate` calls share one engine: each has its own queue, and one task (the
output handler) reads every step's outputs and sorts them into the queues. The core
never waits for the front end, nor the front end for the core.

Signs of life: `start_heartbeat(interval)` pings the core every interval, and every
message the output handler reads stamps `seconds_since_heard()`: a live core is heard
from at least every interval plus one step; a frozen one ages (the server's /health).

Watchers: `watch(name, factory, callback)` runs a watcher inside the core process
(engine_core_client.CoreWatcher: the live dashboard's sampler is one), and the output
handler hands each payload it sends to `callback`; `unwatch(name)` stops it.

Leaving a `generate` loop early (break, the task cancelled, an HTTP client gone) aborts
the request: the core frees its blocks before its next step (tests/engine/
test_async_llm.py::test_c23_leaving_a_stream_aborts_the_request). If the
core process dies, every waiting `generate` raises `EngineDeadError` at once.
vLLM: `vllm/v1/engine/async_llm.py`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from typing import AsyncIterator, Callable

from ..config import EngineConfig
from ..features import Composition
from ..utils.proc import EngineDeadError
from .arg_utils import create_engine_config
from .engine_core_client import AsyncMPClient
from .output_processor import OutputProcessor
from ..outputs import RequestOutput
from .processor import Processor

__all__ = ["AsyncLLM", "EngineDeadError", "EngineUnresponsiveError"]

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0        # check_health's default wait; the server's /health limit of silence


class EngineUnresponsiveError(TimeoutError):
    """The core process lives but did not answer a ping in time: frozen (stopped,
    swapping, deadlocked) or in a step longer than the timeout."""


class AsyncLLM:
    """A streaming engine: the front end here, the EngineCore in a child process.

    Args:
        model: local Hugging Face model folder (model/registry.py), hub id, or None for the default model.
        **engine_args: the fields of EngineConfig (as LLM takes them).

    Attributes:
        tokenizer, config (the resolved EngineConfig), model_path.

    Raises:
        TypeError / ValueError: a bad engine argument, named with its value.
        RuntimeError: the core process failed to start (its traceback in the message).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.config, self.model_path, model_config = create_engine_config(EngineConfig(model=model, **engine_args))
        self.composition = Composition.of(self.config)     # the core process decides the same
        self.processor = self.composition.build(Processor, "processor").from_config(
            self.config, self.model_path, model_config)
        front_end = {"processor": Processor, "output_processor": OutputProcessor}
        for line in self.composition.describe(front_end):       # the core logs its own parts
            logger.info("%s", line)
        self.tokenizer = self.processor.tokenizer
        self.output_processor = self.composition.build(OutputProcessor, "output_processor")(self.tokenizer)
        self.engine_core = AsyncMPClient(self.config, self.model_path)
        self._stats: dict[str, int] = dict(self.engine_core.initial_stats)
        self._queues: dict[str, asyncio.Queue] = {}          # internal request id -> queue
        self._internal_ids: dict[str, str] = {}             # the caller's request id -> internal
        self._output_handler: asyncio.Task | None = None
        self._request_counter = itertools.count()
        self._pings: dict[int, asyncio.Future] = {}         # ping number -> its answer
        self._ping_counter = itertools.count()
        self._heartbeat: asyncio.Task | None = None
        self._last_heard = time.monotonic()                 # the core just said "ready"
        self._watchers: dict[str, Callable] = {}            # watcher name -> its callback
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)

    @property
    def errored(self) -> bool:
        """True once the core process is gone (every request then fails)."""
        return self.engine_core.is_dead()

    def _check_alive(self) -> None:
        """Raises EngineDeadError if the core process is gone (no message sent)."""
        if self.errored:
            raise EngineDeadError(self.engine_core.dead_reason)

    async def check_health(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Ask the core process whether its loop still turns: a PING it answers in the
        outputs after its current step (at once when idle).

        Args:
            timeout: seconds to wait for the answer. It must exceed the longest step
                (a full prefill budget of a large model on a slow CPU can take seconds).

        Raises:
            EngineDeadError: the core process is gone.
            EngineUnresponsiveError: it lives but did not answer within timeout.
        """
        self._check_alive()
        self._start_output_handler()
        number = next(self._ping_counter)
        answer = self._pings[number] = asyncio.get_running_loop().create_future()
        try:
            self.engine_core.ping(number)
            await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            self._check_alive()
            raise EngineUnresponsiveError(f"the EngineCore process (pid {self.engine_core.proc.pid}) "
                                          f"did not answer a ping within {timeout} s") from None
        finally:
            self._pings.pop(number, None)

    def start_heartbeat(self, interval_s: float) -> asyncio.Task:
        """Ping the core every interval_s seconds from now on (call it from the event
        loop), so that seconds_since_heard() stays below about interval_s plus one step
        while the core lives. One ping at a time: a frozen core is not sent a pile of
        them, and the next goes interval_s after its answer. Returns the heartbeat's
        task (cancel it to stop; shutdown() does)."""
        self._check_alive()
        self._start_output_handler()
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat(interval_s))
        return self._heartbeat

    async def _beat(self, interval_s: float) -> None:
        while not self.errored:
            number = next(self._ping_counter)
            answer = self._pings[number] = asyncio.get_running_loop().create_future()
            try:
                self.engine_core.ping(number)
                await answer                           # as long as it takes
            except EngineDeadError:
                return                                 # the core is gone: nothing to beat for
            except RuntimeError:                       # it took no message for 5 s: stuck, and aging
                pass
            finally:
                self._pings.pop(number, None)
            await asyncio.sleep(interval_s)

    def seconds_since_heard(self) -> float:
        """Seconds since the core's last message (a step's outputs, an answer to a
        ping) reached the output handler; it never waits. With the heartbeat on, a
        live core stays below about its interval plus the longest step."""
        return time.monotonic() - self._last_heard

    def get_stats(self) -> dict[str, int]:
        """The core's counters as of its last step or abort (EngineCore.get_stats: free
        and total KV blocks, running / waiting / swapped requests, preemptions,
        generated tokens, prefix-cache queries and hits, ...) plus
        num_unfinished_requests, the requests this front end still follows."""
        return {**self._stats, "num_unfinished_requests": len(self._queues)}

    # -- watchers of the core process ------------------------------------------------------

    def watch(self, name: str, factory, callback: Callable) -> None:
        """Run watcher `name` in the core process (built there once by factory(), a class
        or function pickled by reference: engine_core_client.CoreWatcher) and call
        callback(payload) with every payload it sends from now on (it may send one at
        once, idle or not). The callback runs in the output handler's task, after the
        step's outputs went through the OutputProcessor (so its state includes this
        step's tokens), and must not block. Watching a name again replaces its
        callback. Call it from the event loop."""
        self._check_alive()
        self._start_output_handler()
        self._watchers[name] = callback
        self.engine_core.watch(name, factory)

    def unwatch(self, name: str) -> None:
        """Stop watcher `name` in the core process, and its callback."""
        if self._watchers.pop(name, None) is not None and not self.errored and not self.engine_core._closed:
            self.engine_core.watch(name, None)

    async def generate(self, prompt, sampling_params=None, request_id: str | None = None,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Stream the RequestOutputs of one request, as its output_kind asks (DELTA:
        only what is new; CUMULATIVE: everything so far; FINAL_ONLY: one at the end).
        The last output has finished=True.

        Args:
            prompt: text, a list of token ids, or a chat (a list of {"role", "content"}
                dicts; the tokenizer's chat template applies).
            sampling_params: a SamplingParams (default SamplingParams()) or a
                BeamSearchParams.
            request_id: unique among running requests; None picks one. It may be used
                again as soon as its request ends or is left: the core knows each request
                by an internal id of its own (request_id + "-" + a counter), so outputs of
                a left request still on their way from the core never reach a new one
                (vLLM: the same cure for its issue #23697).
            lora_request: the LoRA adapter it runs with (a LoRARequest; needs
                enable_lora=True), or None for the base model.

        Raises (from the first iteration, before anything is queued):
            ValueError / TypeError: a bad prompt or parameter (Processor's messages name
                the field and value), a request_id in use, a prompt needing more KV
                blocks than the whole pool.
            EngineDeadError: the core process is gone (also mid-stream).
        """
        self._check_alive()
        self._start_output_handler()
        number = next(self._request_counter)
        if request_id is None:
            request_id = f"async-{number}"
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._internal_ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        internal_id = f"{request_id}-{number}"
        request, prompt_text = self.processor.process_inputs(internal_id, prompt, sampling_params,
                                                             lora_request=lora_request)
        queue: asyncio.Queue = asyncio.Queue()
        self.output_processor.add_request(request, prompt_text, request.sampling_params.n)
        self._queues[internal_id] = queue
        self._internal_ids[request_id] = internal_id
        finished = False
        try:
            self.engine_core.add_request(request)
            while not finished:
                out = await queue.get()
                if out is None:                        # aborted: the core has let it go
                    finished = True
                    return
                if isinstance(out, BaseException):
                    finished = True                    # nothing of it is left in the core
                    raise out
                finished = out.finished
                out.request_id = request_id            # the caller's id, not the core's
                yield out
        finally:
            # break, aclose(), cancellation, an exception: the request leaves the core
            self._queues.pop(internal_id, None)
            if self._internal_ids.get(request_id) == internal_id:
                del self._internal_ids[request_id]
            if not finished:
                self._abort_nowait([internal_id])

    async def abort(self, request_id: str | list[str], error: BaseException | None = None) -> None:
        """Abort request(s): they leave the core and free their blocks before its next
        step; their generate loops end without a final output, or raise `error` if one
        is given (a server stopping says so to its clients). Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        internal = [self._internal_ids.pop(rid) for rid in ids if rid in self._internal_ids]
        self._abort_nowait(internal)
        for rid in internal:
            queue = self._queues.pop(rid, None)
            if queue is not None:
                queue.put_nowait(error)

    def running_request_ids(self) -> list[str]:
        """The caller's ids of the requests whose generate loops still run."""
        return list(self._internal_ids)

    def _abort_nowait(self, ids: list[str]) -> None:
        self.output_processor.abort_requests(ids)
        if not self.errored:
            self.engine_core.abort_requests(ids)

    # -- the output handler ---------------------------------------------------------------

    def _start_output_handler(self) -> None:
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.get_running_loop().create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        """One task for all requests: each step's EngineCoreOutputs -> OutputProcessor
        -> the requests' queues; stop-string matches go back to the core."""
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                self._last_heard = time.monotonic()
                if outputs.scheduler_stats is not None:
                    self._stats = outputs.scheduler_stats
                for number in outputs.pongs:
                    answer = self._pings.get(number)
                    if answer is not None and not answer.done():
                        answer.set_result(None)
                for rid, message in outputs.rejected_requests.items():
                    self.output_processor.abort_requests([rid])
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(ValueError(message))
                processed = self.output_processor.process_outputs(outputs)
                for name, payload in outputs.watcher_outputs.items():   # after: the front end's state
                    callback = self._watchers.get(name)                   # has this step's tokens
                    if callback is not None:
                        callback(payload)
                for out in processed.request_outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                if processed.seqs_to_stop:
                    self.engine_core.stop_sequences(processed.seqs_to_stop)
        except EngineDeadError as e:
            logger.error("%s", e)
            for queue in self._queues.values():
                queue.put_nowait(e)
            for answer in self._pings.values():
                if not answer.done():
                    answer.set_exception(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:                         # a bug here must not hang callers
            logger.exception("AsyncLLM output handler failed")
            self.engine_core.dead_reason = f"the AsyncLLM output handler failed: {e!r}"
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(self.engine_core.dead_reason))

    def shutdown(self) -> None:
        """Stop the core process (it is gone when this returns) and the output handler.
        Idempotent; also runs when the AsyncLLM is garbage collected or at exit."""
        for task in (self._heartbeat, self._output_handler):
            if task is not None and not task.done():
                try:
                    task.cancel()
                except RuntimeError:                   # its loop is closed already
                    pass
        self._finalizer()
