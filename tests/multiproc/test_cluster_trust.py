"""A stranger against a two-node cluster (multiproc/multinode.py; docs/trust.md): field case
C85, where a pickle sent by a process outside the cluster ran in node 0 and node 1 and a
bare connect-and-close ended the engine.

One module-scoped cluster on 127.0.0.1 serves every attempt (a start takes 40-100 s on
2 cores): `serve --nnodes 2 --node-rank 0` and a headless node 1, pipeline_parallel_size
2 (a stage per node), the tiny model in float32. A stranger is this test process, which
holds no cluster secret:

- before node 1 joins, at every port node 0 listens on: a bare TCP connect-and-close, a
  zmq handshake with no message, each zmq socket type sending a pickle that would create
  a file when unpickled (the receiving types also try to take messages), raw pickle
  bytes, and a TCPStore client planting that pickle as the plan;
- once the cluster serves, the same at every port either node listens on: the API, the
  control port, the store, the ranks' zmq sockets, and gloo's listeners (which drop a
  connection that is not one of their pairs; what a stranger can still do on a gloo
  port is in docs/trust.md).
No file is ever created, node 1 still joins, the cluster serves the same greedy
completion (token ids and float32 logprobs, bit for bit) before and after as one
process does with pp=1, each attempt is logged at most once and never with its bytes,
and every listening socket of either node is bound to the master address.
A node with a wrong secret is refused by name on both nodes while the cluster serves on.
"""
from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from datetime import timedelta

import httpx
import psutil
import pytest
import zmq
from test_multinode import PP_GRID, SECRET, Headless
from serve_harness import TINY_ARGS, TINY_ENGINE, Server, _free_port

from nanopaged import LLM, SamplingParams

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]     # one cluster start: 40-100 s on 2 cores

PROMPT = "Hello, my name is"
WHERE = "/tmp/nanopaged-stranger-was-here"         # what the pickle would create


class Bomb:
    def __reduce__(self):
        return (open, (WHERE, "w"))


BOMB = pickle.dumps(Bomb())


def _listening(procs: list[psutil.Process]) -> list[tuple[str, int, int]]:
    """(ip, port, pid) of every listening TCP socket of procs."""
    found = []
    for p in procs:
        try:
            found += [(c.laddr.ip, c.laddr.port, p.pid) for c in p.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return found


def _tree(proc) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def _stranger(port: int, store: bool) -> int:
    """Every attempt on one port; returns how many connections it made."""
    attempts = 0
    with socket.create_connection(("127.0.0.1", port), timeout=2):       # connect, close
        attempts += 1
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:  # raw pickle bytes
        s.sendall(BOMB)
        attempts += 1
        time.sleep(0.1)
    ctx = zmq.Context()
    try:
        for kind in (zmq.PUSH, zmq.DEALER, zmq.REQ, zmq.PUB, zmq.PAIR, zmq.ROUTER, zmq.PULL, zmq.SUB, None):
            sock = ctx.socket(kind or zmq.DEALER)
            sock.connect(f"tcp://127.0.0.1:{port}")
            attempts += 1
            if kind in (zmq.PULL, zmq.SUB):             # try to take what is not ours
                if kind == zmq.SUB:
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                assert not sock.poll(300), f"the stranger received a message on port {port}"
            elif kind is not None:                      # None: a handshake and no message
                try:
                    sock.send_multipart([b"", BOMB] if kind == zmq.ROUTER else [BOMB], flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
            time.sleep(0.2)
            sock.close(linger=0)
    finally:
        ctx.term()
    if store:                                           # a store would take a planted plan
        import torch.distributed as dist
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            client.set("nanopaged/plan", BOMB)
            client.set("pg/0", BOMB)
        except Exception:                               # not a store
            pass
        attempts += 1
    return attempts


def _complete(url: str) -> tuple[str, list[float]]:
    """The greedy completion's text and its tokens' float32 logprobs (exact through JSON)."""
    r = httpx.post(url + "/v1/completions", timeout=120, json=dict(
        prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOPAGED_CLUSTER_SECRET", SECRET)
        if os.path.exists(WHERE):
            os.remove(WHERE)
        port, started = _free_port(), {}
        thread = threading.Thread(target=lambda: started.update(node0=_try(lambda: Server(
            tiny_model_dir, *TINY_ARGS, *PP_GRID, "--node-rank", "0", "--master-port", str(port)))))
        thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:               # node 0's control port
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(1.0)                                  # its store and rank sockets too
        node0_pid = next(p.pid for p in psutil.process_iter(["cmdline"])
                         if str(port) in " ".join(p.info["cmdline"] or []) and "--node-rank" in p.info["cmdline"])
        ports = sorted({pt for ip, pt, pid in _listening(_tree(psutil.Process(node0_pid)))})
        attempts = sum(_stranger(p, store=True) for p in ports)
        node1 = Headless(tiny_model_dir, port, *PP_GRID)
        thread.join(300)
        node0 = started.get("node0")
        if not isinstance(node0, Server):
            node1.end()
            raise RuntimeError(f"node 0 did not start: {node0}\nnode 1: {node1.output()}")
        try:
            yield dict(node0=node0, node1=node1, port=port, attempts=attempts, before_join_ports=ports)
        finally:
            node0.stop()
            node1.end()


def _try(fn):
    try:
        return fn()
    except BaseException as e:         # the fixture reports it
        return e


@pytest.fixture(scope="module")
def one_process_answer(tiny_model_dir):
    """The greedy completion of one process at pp=1, float32 (TINY_ENGINE)."""
    llm = LLM(str(tiny_model_dir), **TINY_ENGINE)
    try:
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                           use_tqdm=False)[0].outputs[0]
        return out.text, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
    finally:
        llm.shutdown()


def test_a_stranger_runs_no_code_and_stops_nothing(cluster, one_process_answer):
    node0, node1 = cluster["node0"], cluster["node1"]
    before = _complete(node0.url)
    assert before == one_process_answer          # pp=2 over two nodes == pp=1, bit for bit
    before = _complete(node0.url)                # its prompt from the prefix cache now, as after
    procs = _tree(node0.proc) + _tree(node1.proc)
    listening = _listening(procs)
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, listening       # bound where asked, gloo's too
    folders = [os.path.join(node0.tmpdir, f) for f in os.listdir(node0.tmpdir) if f.startswith("nanopaged-")]
    assert len(folders) == 2 and all(os.stat(f).st_mode & 0o777 == 0o700 for f in folders), folders   # core, ranks
    ports = sorted({pt for _, pt, _ in listening})
    attempts = cluster["attempts"] + sum(_stranger(p, store=False) for p in ports)
    time.sleep(1.0)
    assert _complete(node0.url) == before
    assert not os.path.exists(WHERE)
    assert all(p.is_running() for p in procs)
    for out in (node0.output(), node1.output()):
        assert "Traceback" not in out and WHERE not in out, out
    refusals = [line for line in node0.output().splitlines() if "refused" in line]
    assert len(refusals) <= attempts, refusals


def test_a_node_with_another_secret_is_refused_on_both_nodes(cluster, tiny_model_dir, monkeypatch):
    node0 = cluster["node0"]
    before = _complete(node0.url)
    monkeypatch.setenv("NANOPAGED_CLUSTER_SECRET", "not the cluster's secret, though long enough")
    intruder = Headless(tiny_model_dir, cluster["port"], *PP_GRID)
    try:
        assert intruder.proc.wait(timeout=60) == 1, intruder.output()
        out = intruder.output()
        assert (f"error: node 0 at 127.0.0.1:{cluster['port']} refused node 1 (" in out
                and "hold different cluster secrets" in out and "Traceback" not in out), out
        deadline = time.monotonic() + 10
        while "handshake failed (a node with another cluster secret" not in node0.output():
            assert time.monotonic() < deadline, node0.output()
            time.sleep(0.2)
        assert _complete(node0.url) == before
    finally:
        intruder.end()
