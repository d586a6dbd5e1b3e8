"""A headless node: `python -m nanopaged.serve --headless` on a host other than node 0.

It serves no API: it reads node 0's plan from the rendezvous store (multinode.py), starts
this node's ranks with node 0's settings and this host's model folder, tells node 0
when they are ready, then watches them and node 0 until one of them ends. vLLM:
`run_headless` in vllm/entrypoints/cli/serve.py.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import time
from datetime import timedelta

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..utils.proc import exit_reason, spawn_child, stop_processes, wait_ready
from .multinode import HEARTBEAT_S, KEY, NodePlan, grid, join_timeout_s, local_ranks, node_name, node_timeout_s

_STARTUP_TIMEOUT_S = 600.0      # loading a shard, at most (as multiproc_executor's)


def run_headless(config, model_path, model_config) -> int:
    """Serve node config.node_rank: read node 0's plan, start this node's ranks with
    node 0's settings (and this node's model folder), then watch them and node 0.

    Returns the exit status: 0 when node 0 shut the engine down, or on SIGTERM / SIGINT
    (the ranks are ended and node 0 told); 1 when a rank died or node 0 died or was lost.

    Raises:
        ValueError: node_rank 0, or settings that differ from node 0's (nnodes, the
            parallel sizes, the model); node 0 is told too.
        RuntimeError: node 0 not found within NANOPAGED_JOIN_TIMEOUT_S, or a rank failed
            to start (node 0 is told).
    """
    if config.node_rank == 0:
        raise ValueError("--headless runs a node other than node 0 (node 0 runs the engine): "
                         "give --node-rank between 1 and --nnodes - 1")
    stop_signal: list[str] = []

    def on_signal(signum, frame):
        stop_signal.append(signal.Signals(signum).name)
    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _join(config, model_path, model_config, stop_signal)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _join(config, model_path, model_config, stop_signal: list[str]) -> int:
    """run_headless once its signal handlers are set."""
    import torch.distributed as dist

    r, addr, port = config.node_rank, config.master_addr, config.master_port
    deadline = time.monotonic() + join_timeout_s()
    try:
        _wait_for_port(addr, port, deadline, stop_signal)      # quietly: torch logs each failed try
        store = dist.TCPStore(addr, port, is_master=False,
                              timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
        plan: NodePlan = pickle.loads(store.get(KEY + "plan"))
    except _Signalled:
        return 0
    except Exception as e:        # OSError, torch's DistNetworkError / DistStoreError
        raise RuntimeError(f"node 0 did not answer at {addr}:{port} within {join_timeout_s():.0f} s "
                           f"(NANOPAGED_JOIN_TIMEOUT_S): is it started, with the same --master-addr and "
                           f"--master-port? ({type(e).__name__})") from None
    host = f"{socket.gethostname()} pid {os.getpid()}"
    problem = None
    if grid(config) != plan.grid:
        ours = ", ".join(f"{k}={v}" for k, v in grid(config).items())
        theirs = ", ".join(f"{k}={v}" for k, v in plan.grid.items())
        problem = f"node {r} has {ours} but node 0 has {theirs}"
    elif model_config != plan.model_config:
        problem = f"node {r}'s model ({model_path}) differs from node 0's (its config.json)"
    elif store.add(KEY + f"node{r}", 1) > 1:
        problem = f"another node already joined as node_rank={r}"
    if problem:
        me = node_name(r, local_ranks(plan.world_size, config.nnodes, r), host)
        store.set(KEY + "refused", f"{me} refused to join: {problem}")
        raise ValueError(problem)
    return _HeadlessNode(config, plan, model_path, host, stop_signal).run()


def _wait_for_port(addr: str, port: int, deadline: float, stop_signal: list[str]) -> None:
    """Until something listens at addr:port. Raises OSError at the deadline, _Signalled
    on SIGTERM / SIGINT."""
    while True:
        if stop_signal:
            raise _Signalled(stop_signal[0])
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class _HeadlessNode:
    """A headless node's life: its sockets, its ranks, its loop."""

    def __init__(self, config, plan: NodePlan, model_path, host: str, stop_signal: list[str]) -> None:
        self.r, self.host, self.stop_signal = config.node_rank, host, stop_signal
        self.ctx = zmq.Context()
        self.report = self.ctx.socket(zmq.PUSH)
        self.report.connect(plan.report_addresses[self.r])
        self.pings = self.ctx.socket(zmq.SUB)
        self.pings.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.pings.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.pings.connect(plan.ping_address)
        self.last_ping = time.monotonic()
        self.ready = False
        self.ranks = local_ranks(plan.world_size, config.nnodes, self.r)
        self.me = node_name(self.r, self.ranks, host)
        self.procs = []
        self.plan, self.model_path = plan, model_path

    def _send(self, kind: str, payload=None) -> None:
        self.report.send(pickle.dumps((kind, payload)))

    def check(self) -> None:
        """Raise _Stop when node 0 stops the engine (or a rank ended as told by it),
        _Signalled on SIGTERM / SIGINT, _NodeZeroLost, or _RankDied."""
        if self.stop_signal:
            raise _Signalled(self.stop_signal[0])
        while self.pings.poll(0):
            kind, reason = pickle.loads(self.pings.recv())
            self.last_ping = time.monotonic()
            if kind == "stop":
                raise _Stop(reason)
        for rank, proc in zip(self.ranks, self.procs):
            if proc.poll() == 0:            # node 0 told it to shut down
                raise _Stop(None)
            if proc.poll() is not None:
                raise _RankDied(rank, f"rank {rank} (pid {proc.pid}) on {self.me} died: "
                                   f"{exit_reason(proc.returncode)}")
        if self.monitor.poll(0) and recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
            raise _NodeZeroLost("node 0 disconnected: its engine process is gone")
        silent = time.monotonic() - self.last_ping
        if self.ready and silent > node_timeout_s():
            raise _NodeZeroLost(f"node 0 said nothing for {silent:.0f} s (NANOPAGED_NODE_TIMEOUT_S)")

    def start_ranks(self) -> None:
        threads = None if "OMP_NUM_THREADS" in os.environ else max(1, len(os.sched_getaffinity(0)) // len(self.ranks))
        ready = {}
        try:
            for rank in self.ranks:
                settings = dict(self.plan.settings, rank=rank, input_address=self.plan.input_addresses[rank],
                                model_path=str(self.model_path), num_threads=threads)
                proc, fd = spawn_child("nanopaged.worker.multiproc_executor:WorkerProc", settings)
                self.procs.append(proc)
                ready[fd] = (f"rank {rank} (pid {proc.pid}) on {self.me}", proc)
            wait_ready(ready, _STARTUP_TIMEOUT_S, check=self.check)
        finally:
            for fd in ready:
                os.close(fd)

    def run(self) -> int:
        status, normal = 1, False
        try:
            self._send("hello", self.host)
            self.start_ranks()
            self._send("ready")
            self.ready = True
            next_beat = 0.0
            while True:
                if time.monotonic() >= next_beat:
                    self._send("alive")
                    next_beat = time.monotonic() + HEARTBEAT_S
                self.check()
                time.sleep(0.1)
        except _Stop as stop:
            normal = stop.reason is None
            status = 0 if normal else 1
            if not normal:
                print(f"nanopaged.worker.headless: error: node 0's engine died: {stop.reason}", flush=True)
        except _Signalled as sig:
            status = 0
            self._send("left", (None, f"{self.me} was stopped ({sig})"))
        except _NodeZeroLost as e:
            print(f"nanopaged.worker.headless: error: {e}", flush=True)
        except RuntimeError as e:         # a rank died or failed to start: node 0 ends the engine
            self._send("died", (getattr(e, "rank", None), str(e)))
            print(f"nanopaged.worker.headless: error: {e}", flush=True)
        finally:
            self._end(normal)
        return status

    def _end(self, normal: bool) -> None:
        if not normal:                    # the group is broken: no rank can stop gracefully
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
        stop_processes(self.procs)        # after a normal stop they go by themselves
        self.report.close(linger=1000)
        self.pings.close(linger=0)
        self.monitor.close(linger=0)
        self.ctx.term()


class _Signalled(Exception):
    """SIGTERM or SIGINT reached the headless node."""


class _RankDied(RuntimeError):
    """A rank of this node ended by itself."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class _NodeZeroLost(Exception):
    """Node 0 is gone (disconnected or silent)."""


class _Stop(Exception):
    """Node 0 said stop; reason None: a normal shutdown."""

    def __init__(self, reason: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
