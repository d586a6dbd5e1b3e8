"""A headless node: `python -m nanopaged.serve --headless` on a host other than node 0.

It serves no API: it joins node 0 on its control port (multinode.py: CURVE with keys
from the cluster secret), gets the plan, starts this node's ranks with node 0's
settings and this host's model folder, tells node 0 when they are ready, then watches
them and node 0 until one of them ends. vLLM:
`run_headless` in vllm/entrypoints/cli/serve.py.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..utils import codec
from ..utils.proc import exit_reason, spawn_child, stop_processes, wait_ready
from .cluster_auth import HANDSHAKE_FAILED, SECRET_ENV, ClusterAuth, cluster_secret, interface_of, own_address
from .multinode import (HEARTBEAT_S, Join, NodePlan, Ping, Refused, Report, grid, join_timeout_s, local_ranks, node_name, node_timeout_s)

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0      # loading a shard, at most (as multiproc_executor's)


def run_headless(config, model_path, model_config) -> int:
    """Serve node config.parallel_config.node_rank: read node 0's plan, start this node's ranks with
    node 0's settings (and this node's model folder), then watch them and node 0.

    Returns the exit status: 0 when node 0 shut the engine down, or on SIGTERM / SIGINT
    (the ranks are ended and node 0 told); 1 when a rank died or node 0 died or was lost.

    Raises:
        ValueError: node_rank 0; no cluster secret, or one node 0 does not hold (the
            CURVE handshake fails; node 0 logs the refused connection); settings that
            differ from node 0's (nnodes, the parallel sizes, the model), which node 0
            refuses and ends its own start with.
        RuntimeError: node 0 not found within NANOPAGED_JOIN_TIMEOUT_S, or a rank failed
            to start (node 0 is told).
    """
    if config.parallel_config.node_rank == 0:
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
    secret = cluster_secret(config)
    node = _HeadlessNode(config, model_path, secret, stop_signal)
    try:
        plan = node.join(model_config)
    except _Signalled:
        node.close()
        return 0
    except BaseException:
        node.close()
        raise
    return node.run(plan)


class _HeadlessNode:
    """A headless node's life: its control connection to node 0, its ranks, its loop."""

    def __init__(self, config, model_path, secret: bytes, stop_signal: list[str]) -> None:
        self.config, self.r, self.stop_signal = config, config.parallel_config.node_rank, stop_signal
        self.host = f"{socket.gethostname()} pid {os.getpid()}"
        self.secret, self.model_path = secret, model_path
        self.node_0 = f"{config.parallel_config.master_addr}:{config.parallel_config.master_port}"
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.DEALER)
        ClusterAuth(self.ctx, secret).connect_to(self.control)
        self.monitor = self.control.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.control.connect(f"tcp://{socket.gethostbyname(config.parallel_config.master_addr)}:{config.parallel_config.master_port}")
        self.last_ping = time.monotonic()
        self.ready = False
        self.procs = []
        self.me = f"node {self.r} ({self.host})"

    def _send(self, message) -> None:
        self.control.send(codec.encode(message))

    def join(self, model_config) -> NodePlan:
        """Ask node 0 to join (again each second until it answers) and return its plan.

        Raises:
            ValueError: node 0 refused this node (its settings or model differ, or its
                cluster secret: the handshake failed).
            RuntimeError: no answer within NANOPAGED_JOIN_TIMEOUT_S.
            _Signalled: SIGTERM / SIGINT.
        """
        deadline, next_join = time.monotonic() + join_timeout_s(), 0.0
        join = Join(self.r, self.host, grid(self.config), model_config, str(self.model_path))
        while True:
            if self.stop_signal:
                raise _Signalled(self.stop_signal[0])
            if time.monotonic() > deadline:
                raise RuntimeError(f"node 0 did not answer at {self.node_0} within {join_timeout_s():.0f} s "
                                   "(NANOPAGED_JOIN_TIMEOUT_S): is it started, with the same --master-addr and "
                                   "--master-port?")
            if time.monotonic() >= next_join:
                self._send(join)
                next_join = time.monotonic() + 1.0
            while self.monitor.poll(0):
                if recv_monitor_message(self.monitor)["event"] & HANDSHAKE_FAILED:
                    raise ValueError(f"node 0 at {self.node_0} refused {self.me}: the handshake failed, so the "
                                     "two hold different cluster secrets (--cluster-secret-file or "
                                     f"{SECRET_ENV}), or that port is not a nanopaged node 0")
            if self.control.poll(100):
                try:
                    answer = codec.decode(self.control.recv(), (NodePlan, Refused, Ping))
                except codec.CodecError as e:
                    logger.warning("dropped a malformed message from node 0: %s", e)
                    continue
                if isinstance(answer, Refused):
                    raise ValueError(answer.reason)
                if isinstance(answer, NodePlan):
                    self.ranks = local_ranks(answer.world_size, self.config.parallel_config.nnodes, self.r)
                    self.me = node_name(self.r, self.ranks, self.host)
                    return answer

    def check(self) -> None:
        """Raise _Stop when node 0 stops the engine (or a rank ended as told by it),
        _Signalled on SIGTERM / SIGINT, _NodeZeroLost, or _RankDied."""
        if self.stop_signal:
            raise _Signalled(self.stop_signal[0])
        while self.control.poll(0):
            try:
                ping = codec.decode(self.control.recv(), Ping)
            except codec.CodecError as e:
                logger.warning("dropped a malformed message from node 0: %s", e)
                continue
            self.last_ping = time.monotonic()
            if ping.kind == "stop":
                raise _Stop(ping.reason)
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

    def start_ranks(self, plan: NodePlan) -> None:
        node_ip = self.config.parallel_config.node_ip or own_address(self.config.parallel_config.master_addr, self.config.parallel_config.master_port)
        interface_of(node_ip)               # a ValueError now rather than in each rank
        threads = None if "OMP_NUM_THREADS" in os.environ else max(1, len(os.sched_getaffinity(0)) // len(self.ranks))
        ready = {}
        try:
            for rank in self.ranks:
                settings = dict(plan.settings, rank=rank, input_address=plan.input_addresses[rank],
                                model_path=str(self.model_path), num_threads=threads, store=plan.store,
                                node_ip=node_ip, cluster_secret=self.secret)
                proc, fd = spawn_child("nanopaged.multiproc.worker_proc:WorkerProc", settings)
                self.procs.append(proc)
                ready[fd] = (f"rank {rank} (pid {proc.pid}) on {self.me}", proc)
            wait_ready(ready, _STARTUP_TIMEOUT_S, check=self.check)
        finally:
            for fd in ready:
                os.close(fd)

    def run(self, plan: NodePlan) -> int:
        status, normal = 1, False
        try:
            self.start_ranks(plan)
            self._send(Report("ready"))
            self.ready = True
            next_beat = 0.0
            while True:
                if time.monotonic() >= next_beat:
                    self._send(Report("alive"))
                    next_beat = time.monotonic() + HEARTBEAT_S
                self.check()
                time.sleep(0.1)
        except _Stop as stop:
            normal = stop.reason is None
            status = 0 if normal else 1
            if not normal:
                print(f"nanopaged.multiproc.headless: error: node 0's engine died: {stop.reason}", flush=True)
        except _Signalled as sig:
            status = 0
            self._send(Report("left", None, f"{self.me} was stopped ({sig})"))
        except _NodeZeroLost as e:
            print(f"nanopaged.multiproc.headless: error: {e}", flush=True)
        except RuntimeError as e:         # a rank died or failed to start: node 0 ends the engine
            self._send(Report("died", getattr(e, "rank", None), str(e)))
            print(f"nanopaged.multiproc.headless: error: {e}", flush=True)
        finally:
            self._end(normal)
        return status

    def _end(self, normal: bool) -> None:
        if not normal:                    # the group is broken: no rank can stop gracefully
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
        stop_processes(self.procs)        # after a normal stop they go by themselves
        self.close(linger_ms=1000)

    def close(self, linger_ms: int = 0) -> None:
        self.control.disable_monitor()
        self.monitor.close(linger=0)
        self.control.close(linger=linger_ms)
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
