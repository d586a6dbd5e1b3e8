"""Multi-node: one engine whose ranks live on several hosts (issue 36).

    host A:  python -m nanopaged.serve -tp 2 --nnodes 2 --node-rank 0 --master-addr A --master-port 29500
    host B:  python -m nanopaged.serve -tp 2 --nnodes 2 --node-rank 1 --master-addr A --master-port 29500 --headless

vLLM's multiprocessing executor does the same (`vllm serve --nnodes --node-rank
--master-addr --master-port --headless`: vllm/v1/executor/multiproc_executor.py,
run_headless in vllm/entrypoints/cli/serve.py). Ranks are global; node n holds ranks
[n*k, (n+1)*k), k = world size / nnodes. Node 0 runs the engine and its own ranks as on
one machine (multiproc_executor.py); a headless node starts its ranks and watches them
(headless.py).

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
import socket
import threading
import time
from dataclasses import dataclass, fields
from datetime import timedelta

import zmq
from zmq.utils.monitor import recv_monitor_message

HEARTBEAT_S = 1.0
KEY = "nanopaged/"             # the store's keys outside the process group's "pg/"


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
        self.dead_rank: int | None = None         # the rank it names, if one
        self._stop_reason: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="RemoteNodes", daemon=True)
        self._thread.start()

    def name(self, r: int) -> str:
        return node_name(r, local_ranks(self.world_size, self.nnodes, r), self.joined.get(r))

    def publish(self, plan: NodePlan) -> None:
        self.store.set(KEY + "plan", pickle.dumps(plan))

    def check(self) -> None:
        """Raise RuntimeError if a node failed, left, or refused to join."""
        if self.dead_reason is None and self.store is not None and self.store.check([KEY + "refused"]):
            self.dead_reason = self.store.get(KEY + "refused").decode()
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

    def _died(self, reason: str, rank: int | None = None) -> None:
        if self.dead_reason is None:
            self.dead_reason, self.dead_rank = reason, rank

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
                    elif kind != "alive":            # "died", "left": (the rank or None, why)
                        self._died(payload[1], payload[0])
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
