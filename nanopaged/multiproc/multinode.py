"""Multi-node: one engine whose ranks live on several hosts.

    host A:  python -m nanopaged.serve -tp 2 --nnodes 2 --node-rank 0 --master-addr A --master-port 29500
    host B:  python -m nanopaged.serve -tp 2 --nnodes 2 --node-rank 1 --master-addr A --master-port 29500 \\
                 --headless --cluster-secret-file SECRET

vLLM's multiprocessing executor does the same (`vllm serve --nnodes --node-rank
--master-addr --master-port --headless`: vllm/v1/executor/multiproc_executor.py,
run_headless in vllm/entrypoints/cli/serve.py). Ranks are global; node n holds ranks
[n*k, (n+1)*k), k = world size / nnodes. Node 0 runs the engine and its own ranks as on
one machine (multiproc_executor.py); a headless node starts its ranks and watches them
(headless.py).

What node 0 listens on, all on master_addr's interface (docs/trust.md says why):
- master_port: the control socket (a zmq ROUTER). A node joins there (Join), gets the
  plan (NodePlan) or a Refused, then reports on it (Report: ready, alive each second,
  a rank's death) and hears node 0's Pings (alive each second, stop).
- free ports named in the plan: an input per remote rank and the ranks' answers
  (multiproc_executor.py), and a torch.distributed TCPStore, the ranks' rendezvous for
  gloo, its keys under a prefix drawn at random for this run and sent in the plan.

Trust (cluster_auth.py): every zmq socket between hosts is CURVE (libzmq's CurveZMQ:
authenticated and encrypted), with keys derived from the cluster secret, and a ZAP
handler that lets in only clients holding them; every message is utils/codec.py's
data-only encoding, never pickle. A peer without the secret fails the handshake before any of
its bytes reach the engine, and a node's departure is told apart from a stranger's
connect-and-close by the socket its messages came from.

Liveness, both ways: a node whose control connection drops (its process is gone) or
that says nothing for NANOPAGED_NODE_TIMEOUT_S (30 s: a lost host) ends the engine with
an error naming it; a headless node that loses node 0 the same way ends its ranks and
exits 1. A node that never joins: an error after NANOPAGED_JOIN_TIMEOUT_S (300 s)
saying how many did.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, fields
from datetime import timedelta

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..config import CacheConfig, EngineConfig, ParallelConfig, QuantizationConfig, SchedulerConfig, SpeculativeConfig
from ..model.config import ModelConfig
from ..utils import codec
from .cluster_auth import HANDSHAKE_FAILED, ClusterAuth, interface_of

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


def join_timeout_s() -> float:
    """Seconds node 0 waits for the others to join (and they for node 0)."""
    return float(os.environ.get("NANOPAGED_JOIN_TIMEOUT_S", "300"))


def node_timeout_s() -> float:
    """Seconds of silence after which a node (or node 0) counts as lost."""
    return float(os.environ.get("NANOPAGED_NODE_TIMEOUT_S", "30"))


def grid(config) -> dict[str, int]:
    """The settings every node must share: nnodes and every *_parallel_size."""
    parallel = config.parallel_config
    sizes = {f.name: getattr(parallel, f.name) for f in fields(parallel) if f.name.endswith("_parallel_size")}
    return {"nnodes": config.parallel_config.nnodes, **sizes}


def local_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks node `node_rank` holds (vLLM's layout: consecutive blocks)."""
    k = world_size // nnodes
    return range(node_rank * k, (node_rank + 1) * k)


def node_name(r: int, ranks: range, host: str | None = None) -> str:
    """"node 1 (host pid 7, rank 1)", for messages."""
    held = f"ranks {ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else f"rank {ranks.start}"
    return f"node {r} ({host + ', ' if host else ''}{held})"


# -- addresses -------------------------------------------------------------------------------

def bind_tcp(sock, ip: str) -> str:
    """Bind sock to a free port of ip; its address for the other hosts."""
    sock.bind(f"tcp://{ip}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def serve_store(ip: str, timeout_s: float):
    """A TCPStore served on a free port of ip only (torch binds every interface unless
    given a socket: master_listen_fd). Returns (store, port)."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((ip, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(ip, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.fileno(),
                          timeout=timedelta(seconds=timeout_s))
    listener.detach()               # the store's server owns the socket now, and closes it
    return store, port


def rank_store(ip: str, address: tuple[str, int, str], timeout_s: float):
    """A rank's view of node 0's store, for init_process_group(store=...): gloo binds
    this node's address ip, and the keys sit under this run's prefix."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = interface_of(ip)
    host, port, prefix = address
    return dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s)))


# -- the messages on the control socket ------------------------------------------------------

@dataclass
class Join:
    """A node asks to join (node r -> 0): who it is and what it would run."""
    node_rank: int
    host: str
    grid: dict[str, int]
    model_config: ModelConfig
    model_path: str


@dataclass
class Refused:
    """Node 0 refuses a Join (0 -> node r): why."""
    reason: str


@dataclass
class NodePlan:
    """What node 0 sends a node that joined.

    grid: node 0's grid(config), which every node must share.
    world_size: the ranks of all nodes.
    settings: the ranks' start settings (WorkerProc.main) but rank, input_address,
        model_path, num_threads and the secret, which each node fills in.
    input_addresses: per global rank, its control input (None for node 0's own).
    store: (host, port, key prefix) of the ranks' rendezvous.
    """
    grid: dict[str, int]
    world_size: int
    settings: dict
    input_addresses: list[str | None]
    store: tuple[str, int, str]


@dataclass
class Report:
    """A node's word to node 0: "ready" (its ranks started), "alive", "died" (rank, text:
    a rank of it died or failed to start) or "left" (text: it was stopped)."""
    kind: str
    rank: int | None = None
    text: str | None = None


@dataclass
class Ping:
    """Node 0's word to every node: "alive", or "stop" (reason: None for a normal
    shutdown, else why the engine died)."""
    kind: str
    reason: str | None = None


codec.register(ModelConfig, SpeculativeConfig, CacheConfig, SchedulerConfig, ParallelConfig, QuantizationConfig,
               EngineConfig, Join, Refused, NodePlan, Report, Ping)


class RemoteNodes:
    """Node 0's side: serves the control socket and the ranks' store, answers joins with
    the plan, and watches the nodes from a thread until stop().

    Raises:
        RuntimeError: master_port cannot be served on this host (e.g. it is in use).
    """

    def __init__(self, config, world_size: int, secret: bytes, model_config: ModelConfig) -> None:
        self.config, self.world_size, self.nnodes = config, world_size, config.parallel_config.nnodes
        self.model_config = model_config
        self.ip = socket.gethostbyname(config.parallel_config.master_addr)
        self.ctx = zmq.Context()
        self.auth = ClusterAuth(self.ctx, secret)
        self.control = self.ctx.socket(zmq.ROUTER)
        self.auth.serve(self.control, "the control port")
        self.control_address = f"tcp://{self.ip}:{config.parallel_config.master_port}"
        try:
            self.control.bind(self.control_address)
        except zmq.ZMQError as e:
            self._close()
            raise RuntimeError(f"cannot serve the control port master_port={config.parallel_config.master_port} on "
                               f"{config.parallel_config.master_addr}: {e}") from None
        self.monitor = self.control.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.store, store_port = serve_store(self.ip, join_timeout_s())
        self.store_address = (self.ip, store_port, f"pg/{secrets.token_hex(16)}/")
        self.plan: NodePlan | None = None
        self.peers: dict[bytes, int] = {}          # routing id -> node, once joined
        self.fds: dict[int, int] = {}              # node -> the fd its connection came on
        self.joined: dict[int, str] = {}           # node -> "host pid N"
        self.ready: set[int] = set()
        self.last_heard: dict[int, float] = {}
        self.dead_reason: str | None = None        # set by the thread, read by the executor
        self.dead_rank: int | None = None          # the rank it names, if one
        self._stop_reason: str | None = None
        self._logged: dict[str, float] = {}        # kind of refusal -> when last logged
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="RemoteNodes", daemon=True)
        self._thread.start()

    def name(self, r: int) -> str:
        return node_name(r, local_ranks(self.world_size, self.nnodes, r), self.joined.get(r))

    def publish(self, plan: NodePlan) -> None:
        """The plan joining nodes get (the thread answers their Joins from now on)."""
        self.plan = plan

    def check(self) -> None:
        """Raise RuntimeError if a node failed, left, or refused to join."""
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
                    f"--master-addr {c.parallel_config.master_addr} --master-port {c.parallel_config.master_port} --cluster-secret-file FILE "
                    f"and this node's --model and sizes")
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

    def _died(self, reason: str, rank: int | None = None) -> None:
        if self.dead_reason is None:
            self.dead_reason, self.dead_rank = reason, rank

    def _log_once(self, kind: str, message: str) -> None:
        """One line per kind of refusal every 10 s at most: a stranger cannot fill the log."""
        now = time.monotonic()
        if now - self._logged.get(kind, -1e9) >= 10.0:
            self._logged[kind] = now
            logger.warning(message)

    def _send(self, rid: bytes, message) -> None:
        try:
            self.control.send_multipart([rid, codec.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:            # the peer is gone: its departure is seen by the monitor
            pass

    def _on_message(self, frames: list) -> None:
        rid, body = frames[0].bytes, frames[-1]
        try:
            message = codec.decode(body.buffer, (Join, Report))
        except codec.CodecError as e:
            self._log_once("malformed", f"dropped a malformed message on the control port: {e}")
            return
        r = self.peers.get(rid)
        if isinstance(message, Join):
            if r is None:
                self._join(rid, body.get(zmq.SRCFD), message)
            return
        if r is None:
            return
        self.last_heard[r] = time.monotonic()
        if message.kind == "ready":
            self.ready.add(r)
        elif message.kind in ("died", "left"):
            self._died(message.text or f"{self.name(r)} ended", message.rank)

    def _join(self, rid: bytes, fd: int, join: Join) -> None:
        r = join.node_rank
        me = node_name(r, local_ranks(self.world_size, self.nnodes, r), join.host) if 0 < r < self.nnodes else None
        problem = None
        if me is None:
            problem = f"node_rank={r} is not a node of this cluster (1 to {self.nnodes - 1})"
        elif grid(self.config) != join.grid:
            ours = ", ".join(f"{k}={v}" for k, v in join.grid.items())
            theirs = ", ".join(f"{k}={v}" for k, v in grid(self.config).items())
            problem = f"node {r} has {ours} but node 0 has {theirs}"
        elif join.model_config != self.model_config:
            problem = f"node {r}'s model ({join.model_path}) differs from node 0's (its config.json)"
        elif r in self.joined:
            problem = f"another node already joined as node_rank={r}"
        elif self.plan is None:
            return                      # not yet: the node asks again
        if problem is not None:
            logger.warning("refused %s: %s", me or f"a node claiming node_rank={r}", problem)
            self._send(rid, Refused(problem))
            if me is not None and r not in self.joined:
                self._died(f"{me} refused to join: {problem}")
            return
        self.peers[rid], self.fds[r], self.joined[r] = r, fd, join.host
        self.last_heard[r] = time.monotonic()
        logger.info("%s joined (%d of %d nodes)", self.name(r), 1 + len(self.joined), self.nnodes)
        self._send(rid, self.plan)

    def _on_event(self) -> None:
        event = recv_monitor_message(self.monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            for r, fd in self.fds.items():
                if fd == event["value"] and self.dead_reason is None and not self._stopping.is_set():
                    self._died(f"{self.name(r)} disconnected: its process is gone")
        elif event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:      # a bare connect: not worth a line
            self._log_once(str(event["event"]), f"refused a connection on the control port ({self.control_address}): "
                           "its handshake failed (a node with another cluster secret, or not a node)")

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_ping = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= next_ping:
                for rid in self.peers:
                    self._send(rid, Ping("alive"))
                next_ping = time.monotonic() + HEARTBEAT_S
            poller.poll(200)
            while self.control.poll(0):
                self._on_message(self.control.recv_multipart(copy=False))
            while self.monitor.poll(0):
                self._on_event()
            for r in self.ready:
                silent = time.monotonic() - self.last_heard.get(r, time.monotonic())
                if silent > node_timeout_s():
                    self._died(f"{self.name(r)} said nothing for {silent:.0f} s (NANOPAGED_NODE_TIMEOUT_S)")
        for rid in self.peers:
            self._send(rid, Ping("stop", self._stop_reason))
        self._close(linger_ms=1000)             # up to 1 s to deliver the stop

    def _close(self, linger_ms: int = 0) -> None:
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            self.control.disable_monitor()
            monitor.close(linger=0)
        self.control.close(linger=linger_ms)
        self.auth.stop()
        self.ctx.term()
