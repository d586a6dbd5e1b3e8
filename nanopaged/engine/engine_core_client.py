"""EngineCoreClient: how a front end talks to the EngineCore, here or in another process.

The core (engine_core.py) is tokens in, tokens out, so it can live anywhere:

    InprocClient   the core in this process, every call straight through (LLMEngine,
                   so LLM and the tests: one process to debug).
    AsyncMPClient  the core in a child process (EngineCoreProc), for AsyncLLM and the
                   server: while the child runs a forward, the parent tokenizes,
                   detokenizes and serves HTTP.

The two processes speak over ZeroMQ sockets on a private ipc:// path (pyzmq, as vLLM),
with the dataclasses of messages.py, pickled (vLLM uses msgspec; the socket is private):

    front end  --(EngineCoreRequestType, payload)-->  EngineCoreProc     input socket
    front end  <--EngineCoreOutputs | EngineCoreDead--  EngineCoreProc   output socket

Watchers (CoreWatcher) run inside the child, started by a WATCH message, and add
payloads to its outputs: the loop calls them at named points and knows nothing else.

Failure: if the child dies, every caller waiting on it gets an `EngineDeadError` at once
(the child's last message says why, or a thread sees the process end). The child exits
when its parent does (it checks each second, and on Linux the kernel kills it too).
vLLM: `vllm/v1/engine/core_client.py`, `vllm/v1/engine/core.py` (EngineCoreProc).
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import traceback
from typing import Protocol

import zmq
import zmq.asyncio

from ..messages import EngineCoreDead, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from ..utils.proc import (EngineDeadError, exit_child, exit_reason, read_settings, report_ready, spawn_child,
                          stop_processes, wait_ready)

_STARTUP_TIMEOUT_S = 600.0        # loading a model and building the kernels, at most
_SEND_TIMEOUT_MS = 5000           # a send waits this long for the child at most


class InprocClient:
    """The core in this process. Args: engine_core: an EngineCore."""

    def __init__(self, engine_core) -> None:
        self.engine_core = engine_core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def stop_sequences(self, seqs: list[tuple[str, int]]) -> None:
        self.engine_core.stop_sequences(seqs)

    def get_output(self) -> EngineCoreOutputs:
        """Run one step and return its outputs."""
        return self.engine_core.step()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


# -- the child process --------------------------------------------------------------------

class CoreWatcher(Protocol):
    """Something that watches the core from inside its process and sends what it sees
    with the outputs (e.g. the live viewer's DashboardSampler). Started and stopped by
    WATCH messages; a payload it returns (not None) rides in
    EngineCoreOutputs.watcher_outputs under its name."""

    def watch(self, engine_core) -> None:
        """WATCH on, the first or a later one: attach (e.g. as an event observer)."""

    def unwatch(self, engine_core) -> None:
        """WATCH off: detach; the watcher is dropped."""

    def after_step(self, engine_core, stepped: bool) -> object | None:
        """Outputs are about to go (stepped: after a step, else only news): a payload or None."""

    def before_rest(self, engine_core) -> object | None:
        """The loop is about to block for input: a payload it owes now, or None."""

    def wants_wake(self) -> bool:
        """Asked each second while the loop blocks: True wakes it (before_rest runs next)."""


class EngineCoreProc:
    """The loop of the core's own process: take in what the front end sent, step while
    there is work, send each step's outputs back (with the core's stats).

    Requests arrive between steps, so a new one joins the very next batch; an abort
    frees the request's blocks before the next step (tests/engine/test_engine.py::
    test_abort_frees_blocks). When idle it
    blocks on the input socket, waking each second to check that its parent lives and
    to ask its watchers (CoreWatcher) whether they want it awake.
    """

    def __init__(self, engine_core, input_address: str, output_address: str, parent_pid: int) -> None:
        self.engine_core = engine_core
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_address)
        self.pongs: list[int] = []                 # PINGs taken in, answered with the next outputs
        self.watchers: dict[str, CoreWatcher] = {}

    def run(self) -> None:
        """Serve until SHUTDOWN or the parent's death. Exceptions propagate."""
        core = self.engine_core
        while True:
            idle = not core.has_unfinished_requests()
            if idle:                        # about to block: what the watchers owe goes first
                owed = self._watcher_outputs(lambda w: w.before_rest(core))
                if owed:
                    self._send(EngineCoreOutputs(scheduler_stats=core.get_stats(), watcher_outputs=owed))
            rejected, changed = self._process_input(block=idle)
            if rejected is None:
                return                                     # shut down
            stepped = core.has_unfinished_requests()
            if stepped:
                outputs = core.step()
            elif changed or rejected:
                outputs = EngineCoreOutputs()              # only news: stats, rejections
            else:
                continue
            outputs.rejected_requests = rejected
            outputs.scheduler_stats = core.get_stats()
            outputs.pongs, self.pongs = self.pongs, []
            outputs.watcher_outputs = self._watcher_outputs(lambda w: w.after_step(core, stepped))
            self._send(outputs)

    def _watcher_outputs(self, hook) -> dict[str, object]:
        """name -> hook(watcher), for the watchers whose hook returned a payload."""
        payloads = {name: hook(w) for name, w in self.watchers.items()}
        return {name: p for name, p in payloads.items() if p is not None}

    def watch(self, name: str, factory) -> None:
        """WATCH: start watcher `name` (factory() builds it, once) or, factory None, stop it."""
        if factory is None:
            watcher = self.watchers.pop(name, None)
            if watcher is not None:
                watcher.unwatch(self.engine_core)
            return
        if name not in self.watchers:
            self.watchers[name] = factory()
        self.watchers[name].watch(self.engine_core)

    def _process_input(self, block: bool) -> tuple[dict[str, str] | None, bool]:
        """Handle every waiting message (waiting for one first if block). Returns the
        requests refused at add (id -> message) and whether anything changed; None for
        the first after a SHUTDOWN or the parent's death."""
        rejected: dict[str, str] = {}
        changed = False
        if block:
            self.engine_core.executor.check_health()        # another node may be gone meanwhile
            while not self.input.poll(1000):
                if os.getppid() != self.parent_pid:
                    return None, False
                self.engine_core.executor.check_health()
                if any(w.wants_wake() for w in self.watchers.values()):
                    return rejected, False
        while self.input.poll(0):
            kind, payload = pickle.loads(self.input.recv())
            changed = True
            if kind is EngineCoreRequestType.ADD:
                try:
                    self.engine_core.add_request(payload)
                except (ValueError, TypeError) as e:        # the request's fault, not ours
                    rejected[payload.request_id] = str(e)
            elif kind is EngineCoreRequestType.ABORT:
                self.engine_core.abort_requests(payload)
            elif kind is EngineCoreRequestType.STOP_SEQUENCES:
                self.engine_core.stop_sequences(payload)
            elif kind is EngineCoreRequestType.PING:
                self.pongs.append(payload)
            elif kind is EngineCoreRequestType.WATCH:
                self.watch(*payload)
            elif kind is EngineCoreRequestType.SHUTDOWN:
                return None, changed
        return rejected, changed

    def _send(self, message) -> None:
        self.output.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    @staticmethod
    def main() -> None:
        """The child's entry point (`python -c "...EngineCoreProc.main()"`): read the
        settings the parent pickled to stdin, build the core, say ready (or why not) on
        the pipe the parent named, then serve."""
        (config, model_path, input_address, output_address), ready_fd = read_settings()
        parent_pid = os.getppid()

        def start():
            from ..model.config import ModelConfig
            from ..features import Composition
            from .engine_core import EngineCore

            composition = Composition.of(config)
            core = composition.build(EngineCore, "engine_core")(config, model_path,
                                                                ModelConfig.from_pretrained(model_path),
                                                                composition=composition)
            return (core, EngineCoreProc(core, input_address, output_address, parent_pid)), core.get_stats()

        core, proc = report_ready(ready_fd, start)
        exit_code = 0
        try:
            proc.run()
        except EngineDeadError as e:           # a worker or node is gone: its reason is the cause
            proc._send(EngineCoreDead(str(e)))
            exit_code = 1
        except BaseException:                  # a bug: tell the front end where, then go
            proc._send(EngineCoreDead(traceback.format_exc()))
            exit_code = 1
        core.shutdown()                        # tensor-parallel workers, if any
        proc.input.close(linger=0)
        proc.output.close(linger=1000)         # up to 1 s to deliver the last message
        proc.ctx.term()
        exit_child(exit_code)


# -- the parent's side -----------------------------------------------------------------

class AsyncMPClient:
    """The core in a child process, for an asyncio front end (AsyncLLM).

    Args:
        config: a resolved EngineConfig (max_model_len filled in).
        model_path: the local model folder.

    Sending (add_request, abort_requests, stop_sequences) is synchronous: it queues the
    message and returns (it waits only while the child's connection is being made, 5 s
    at most); `get_output_async` awaits the next EngineCoreOutputs.

    Raises:
        RuntimeError: the child failed to start (its traceback is in the message).
    """

    def __init__(self, config, model_path) -> None:
        self._dir = tempfile.mkdtemp(prefix="nanopaged-")
        input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self.sync_ctx = zmq.Context()              # sending never waits: a plain socket
        self.input = self.sync_ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self.input.bind(input_address)
        self.ctx = zmq.asyncio.Context()           # receiving is awaited
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(output_address)
        self._output_address = output_address
        self.dead_reason: str | None = None
        self._closed = False

        # a fresh interpreter, told its settings on stdin (utils/proc.py, spawn_child)
        self.proc, ready_r = spawn_child("nanopaged.engine.engine_core_client:EngineCoreProc",
                                         (config, str(model_path), input_address, output_address))
        try:
            name = f"the EngineCore process (pid {self.proc.pid})"
            self.initial_stats = wait_ready({ready_r: (name, self.proc)}, _STARTUP_TIMEOUT_S)[ready_r]
        except BaseException:
            self.shutdown()
            raise
        finally:
            os.close(ready_r)
        self._watcher = threading.Thread(target=self._watch, name="EngineCoreWatcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Wait for the child to end; if nobody asked it to, wake the output reader with
        an EngineCoreDead of our own (the child's own message, if any, comes first)."""
        self.proc.wait()
        if self._closed:
            return
        sock = self.sync_ctx.socket(zmq.PUSH)     # a socket of this thread's own
        try:
            sock.connect(self._output_address)
            sock.send(pickle.dumps(EngineCoreDead(exit_reason(self.proc.returncode))))
        finally:
            sock.close(linger=1000)

    # -- to the core --------------------------------------------------------------------

    def is_dead(self) -> bool:
        """True once the child is gone without being asked to go (sets dead_reason)."""
        if self.dead_reason is None and not self._closed and self.proc.poll() is not None:
            self.dead_reason = self._died(exit_reason(self.proc.returncode))
        return self.dead_reason is not None

    def _send(self, kind: EngineCoreRequestType, payload) -> None:
        if self._closed:
            raise EngineDeadError("the EngineCore process was shut down")
        if self.is_dead():
            raise EngineDeadError(self.dead_reason)
        try:      # waits only while the child's connection is being made (or it is stuck)
            self.input.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))
        except zmq.Again:
            if self.is_dead():
                raise EngineDeadError(self.dead_reason) from None
            raise RuntimeError(f"the EngineCore process took no message for {_SEND_TIMEOUT_MS} ms; "
                               "it is stuck") from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed and not self.is_dead():
            try:
                self._send(EngineCoreRequestType.ABORT, list(request_ids))
            except EngineDeadError:               # died meanwhile: nothing left to abort
                pass

    def stop_sequences(self, seqs: list[tuple[str, int]]) -> None:
        self._send(EngineCoreRequestType.STOP_SEQUENCES, list(seqs))

    def watch(self, name: str, factory) -> None:
        """Start the core's watcher `name`, built there by factory() (a class or function,
        pickled by reference), or stop it when factory is None (CoreWatcher)."""
        self._send(EngineCoreRequestType.WATCH, (name, factory))

    def ping(self, number: int) -> None:
        """Ask the core to answer `number` in the pongs of its next outputs."""
        self._send(EngineCoreRequestType.PING, number)

    # -- from the core ------------------------------------------------------------------

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message from the core. Raises EngineDeadError when the core is gone."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        message = pickle.loads(await self.output.recv())
        if isinstance(message, EngineCoreDead):
            self.dead_reason = self._died(message.reason)
            raise EngineDeadError(self.dead_reason)
        return message

    def _died(self, reason: str) -> str:
        return f"the EngineCore process (pid {self.proc.pid}) died: {reason}"

    def shutdown(self) -> None:
        """Ask the child to stop, wait up to 5 s, then terminate / kill it; close the
        sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            try:
                self.input.send(pickle.dumps((EngineCoreRequestType.SHUTDOWN, None)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:                 # no peer: the terminate below does it
                pass
        stop_processes([self.proc])
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        self.sync_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
