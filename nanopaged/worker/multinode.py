"""Multi-node: one engine whose ranks live on several hosts (issue 36).

    host A:  python -m nanopaged.serve -tp 2 --nnodes 2 --node-rank 0 --master-addr A --master-port 29500
    host B:  python -m nanopaged.serve -tp 2 --nnodes 2 --node-rank 1 --master-addr A --master-port 29500 --headless

vLLM's multiprocessing executor does the same (`vllm serve --nnodes --node-rank
--master-addr --master-port --headless`: vllm/v1/executor/multiproc_executor.py,
run_headless in vllm/entrypoints/cli/serve.py). Ranks are global; node n holds ranks
[n*k, (n+1)*k), k = world size / nnodes. Node 0 runs the engine and its own ranks as on
one machine (multiproc_executor.py); a headless node starts its ranks and watches them.

The address plan, all from master_addr and master_port:
- master_port: a torch.distributed TCPStore served by node 0's executor (RemoteNodes).
  It is the ranks' rendezvous (init_process_group over it, keys under "pg/") and the
  address book: node 0 puts a NodePlan there, the other nodes read it.
- zmq tcp sockets on free ports of master_addr, named in the plan: a control input per
  remote rank and the answers (as the local ranks' ipc sockets); per node a report
  socket (node -> 0: hello, ready, alive each second, a rank's death); one ping socket
  (0 -> every node: alive each second, stop).

Liveness, both ways: a node whose report socket disconnects (its process is gone) or
that says nothing for NANOPAGED_NODE_TIMEOUT_S (30 s: a lost host) ends the engine with
an error naming it; a headless node that loses node 0 the same way ends its ranks and
exits 1. A node that never joins: an error after NANOPAGED_JOIN_TIMEOUT_S (300 s)
saying how many did.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
from dataclasses import dataclass, fields
from datetime import timedelta

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..utils.proc import exit_reason, spawn_child, stop_processes, wait_ready

HEARTBEAT_S = 1.0
_KEY = "nanopaged/"             # the store's keys outside the process group's "pg/"


def join_timeout_s() -> float:
    """Seconds node 0 waits for the others to join (and they for node 0)."""
    return float(os.environ.get("NANOPAGED_JOIN_TIMEOUT_S", "300"))


def node_timeout_s() -> float:
    """Seconds of silence after which a node (or node 0) counts as lost."""
    return float(os.environ.get("NANOPAGED_NODE_TIMEOUT_S", "30"))


def grid(config) -> dict[str, int]:
    """The settings every node must share: nnodes and every *_parallel_size."""
    sizes = {f.name: getattr(config, f.name) for f in fields(config) if f.name.endswith("_parallel_size")}
    return {"nnodes": config.nnodes, **sizes}


def local_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks node `node_rank` holds (vLLM's layout: consecutive blocks)."""
    k = world_size // nnodes
    return range(node_rank * k, (node_rank + 1) * k)


def node_name(r: int, ranks: range, host: str | None = None) -> str:
    """"node 1 (host pid 7, rank 1)", for messages."""
    held = f"ranks {ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else f"rank {ranks.start}"
    return f"node {r} ({host + ', ' if host else ''}{held})"


def rank_store(master_addr: str, master_port: int, timeout_s: float):
    """A rank's view of node 0's store, for init_process_group(store=...)."""
    import torch.distributed as dist

    if master_addr.startswith("127.") or master_addr == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")      # one machine: the loopback
    store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore("pg/", store)


def bind_tcp(sock, ip: str) -> str:
    """Bind sock to a free port of ip; its address for the other hosts."""
    sock.bind(f"tcp://{ip}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


@dataclass
class NodePlan:
    """What node 0 publishes for the others (pickled under "nanopaged/plan").

    grid: node 0's grid(config), which every node must share.
    model_config: node 0's ModelConfig; a node's --model must load the same.
    settings: the ranks' start settings (WorkerProc.main) but rank, input_address,
        model_path and num_threads, which each node fills in.
    input_addresses: per global rank, its control input (tcp for remote ranks).
    report_addresses: node rank -> its report socket; ping_address: node 0's pings.
    """
    grid: dict
    world_size: int
    model_config: object
    settings: dict
    input_addresses: list
    report_addresses: dict
    ping_address: str


class RemoteNodes:
    """Node 0's side: serves the store, publishes the plan, waits for the other nodes to
    join and start their ranks, and watches them from a thread until stop().

    Raises:
        RuntimeError: master_port cannot be served on this host (e.g. it is in use).
    """

    def __init__(self, config, world_size: int) -> None:
        import torch.distributed as dist

        self.config, self.world_size, self.nnodes = config, world_size, config.nnodes
        self.ip = socket.gethostbyname(config.master_addr)
        try:
            self.store = dist.TCPStore(config.master_addr, config.master_port, is_master=True,
                                       wait_for_workers=False, timeout=timedelta(seconds=join_timeout_s()))
        except Exception as e:        # torch's DistNetworkError and kin
            raise RuntimeError(f"cannot serve the rendezvous on master_port={config.master_port}: {e}") from None
        self.ctx = zmq.Context()
        self.reports = {r: self.ctx.socket(zmq.PULL) for r in range(1, self.nnodes)}
        self.report_addresses = {r: bind_tcp(s, self.ip) for r, s in self.reports.items()}
        self.monitors = {r: s.get_monitor_socket(zmq.EVENT_DISCONNECTED) for r, s in self.reports.items()}
        self.pings = self.ctx.socket(zmq.PUB)
        self.ping_address = bind_tcp(self.pings, self.ip)
        self.joined: dict[int, str] = {}          # node -> "host pid N"
        self.ready: set[int] = set()
        self.last_heard: dict[int, float] = {}
        self.dead_reason: str | None = None       # set by the thread, read by the executor
        self._stop_reason: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="RemoteNodes", daemon=True)
        self._thread.start()

    def name(self, r: int) -> str:
        return node_name(r, local_ranks(self.world_size, self.nnodes, r), self.joined.get(r))

    def publish(self, plan: NodePlan) -> None:
        self.store.set(_KEY + "plan", pickle.dumps(plan))

    def check(self) -> None:
        """Raise RuntimeError if a node failed, left, or refused to join."""
        if self.dead_reason is None and self.store.check([_KEY + "refused"]):
            self.dead_reason = self.store.get(_KEY + "refused").decode()
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)

    def wait(self, what: str, timeout_s: float) -> None:
        """Wait until every other node has joined (what="joined") or has its ranks
        started (what="ready").

        Raises:
            RuntimeError: a node failed or refused, or timeout_s passed (naming how many
                nodes and ranks joined, and how to start the missing ones).
        """
        deadline = time.monotonic() + timeout_s
        while len(getattr(self, what)) < self.nnodes - 1:
            self.check()
            if time.monotonic() > deadline:
                done = getattr(self, what)
                missing = ", ".join(self.name(r) for r in range(1, self.nnodes) if r not in done)
                if what == "ready":
                    raise RuntimeError(f"{missing} did not start its ranks within {timeout_s:.0f} s")
                c, k = self.config, self.world_size // self.nnodes
                raise RuntimeError(
                    f"{1 + len(done)} of {self.nnodes} nodes ({k * (1 + len(done))} of {self.world_size} ranks) "
                    f"joined within {timeout_s:.0f} s (NANOPAGED_JOIN_TIMEOUT_S); missing {missing}: start it "
                    f"with python -m nanopaged.serve --headless --nnodes {self.nnodes} --node-rank R "
                    f"--master-addr {c.master_addr} --master-port {c.master_port} and this node's --model and sizes")
            time.sleep(0.05)

    def stop(self, reason: str | None = None) -> None:
        """Tell the nodes to stop (reason None: a normal shutdown, else why the engine
        died), end the thread, close the store. Idempotent."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stopping.set()
        self._thread.join(timeout=5)
        self.store = None          # its server stops with it

    # -- the watching thread (it alone uses the zmq sockets) --------------------------------

    def _died(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason

    def _watch(self) -> None:
        poller = zmq.Poller()
        for sock in [*self.reports.values(), *self.monitors.values()]:
            poller.register(sock, zmq.POLLIN)
        next_ping = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= next_ping:
                self.pings.send(pickle.dumps(("alive", None)))
                next_ping = time.monotonic() + HEARTBEAT_S
            events = dict(poller.poll(200))
            for r, sock in self.reports.items():
                while sock.poll(0):
                    kind, payload = pickle.loads(sock.recv())
                    self.last_heard[r] = time.monotonic()
                    if kind == "hello":
                        self.joined[r] = payload
                    elif kind == "ready":
                        self.ready.add(r)
                    elif kind != "alive":            # "failed", "died", "left": a sentence
                        self._died(payload)
                if self.monitors[r] in events:
                    event = recv_monitor_message(self.monitors[r])
                    if event["event"] == zmq.EVENT_DISCONNECTED and r in self.joined:
                        self._died(f"{self.name(r)} disconnected: its process is gone")
                silent = time.monotonic() - self.last_heard.get(r, time.monotonic())
                if r in self.ready and silent > node_timeout_s():
                    self._died(f"{self.name(r)} said nothing for {silent:.0f} s (NANOPAGED_NODE_TIMEOUT_S)")
        self.pings.send(pickle.dumps(("stop", self._stop_reason)))
        for sock in [*self.reports.values(), *self.monitors.values()]:
            sock.close(linger=0)
        self.pings.close(linger=1000)          # up to 1 s to deliver the stop
        self.ctx.term()


# -- a headless node (`python -m nanopaged.serve --headless`) ------------------------------------

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
        plan: NodePlan = pickle.loads(store.get(_KEY + "plan"))
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
    elif store.add(_KEY + f"node{r}", 1) > 1:
        problem = f"another node already joined as node_rank={r}"
    if problem:
        me = node_name(r, local_ranks(plan.world_size, config.nnodes, r), host)
        store.set(_KEY + "refused", f"{me} refused to join: {problem}")
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
        _Signalled on SIGTERM / SIGINT, _NodeZeroLost, or RuntimeError for a dead rank."""
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
                raise RuntimeError(f"rank {rank} (pid {proc.pid}) on {self.me} died: "
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
            wait_ready(ready, 600.0, check=self.check)
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
                print(f"nanopaged.worker.multinode: error: node 0's engine died: {stop.reason}", flush=True)
        except _Signalled as sig:
            status = 0
            self._send("left", f"{self.me} was stopped ({sig})")
        except _NodeZeroLost as e:
            print(f"nanopaged.worker.multinode: error: {e}", flush=True)
        except RuntimeError as e:         # a rank died or failed to start: node 0 ends the engine
            self._send("died", str(e))
            print(f"nanopaged.worker.multinode: error: {e}", flush=True)
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


class _NodeZeroLost(Exception):
    """Node 0 is gone (disconnected or silent)."""


class _Stop(Exception):
    """Node 0 said stop; reason None: a normal shutdown."""

    def __init__(self, reason: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
