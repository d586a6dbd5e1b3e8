"""Multi-node (multiproc/multinode.py): two launcher processes on 127.0.0.1 act as two
hosts, `serve --nnodes 2 --node-rank 0` and `serve --nnodes 2 --node-rank 1 --headless`,
with tensor_parallel_size=2 split one rank per node (the served test: pipeline_parallel_size=2,
a stage per node).

- They serve the OpenAI API with the same tokens as one process (float32); then node
  1's launcher killed (SIGKILL) mid-stream: node 0's server ends the stream with an
  error event, logs why (node 1 disconnected), exits 1; no process is left on either.
  node 0 killed: node 1 exits 1 at once, saying so.
- LLM(...) as node 0: one process's tokens; its shutdown ends node 1 with status 0, its
  death with 1; node
  1 stopped (SIGTERM), its rank killed, or node 1 frozen (a lost host) while idle: node
  0's health check and next step name the cause.
- Bad settings are clear errors before anything starts, or on both hosts: ranks that do
  not split over nnodes, node_rank >= nnodes, no master_port, LLM as node 1, --headless
  on node 0, a node that never joins (how many did), node 0 not found, a mismatched
  --nnodes (both hosts say so).

Every process is ended by pid; the timeouts cover the starts (~30 s on a busy 2-core
machine for the four processes of a two-node server).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest
import zmq
from serve_harness import ROOT, TINY_ARGS, TINY_ENGINE, Server, _free_port

from nanopaged import LLM, SamplingParams
from nanopaged.config import EngineConfig
from nanopaged.entrypoints.openai.api_server import serve_headless
from nanopaged.entrypoints.openai.cli_args import parse_args
from nanopaged.utils.proc import EngineDeadError

pytestmark = pytest.mark.timeout(300)
SECRET = "a test cluster secret, the same on both nodes"


@pytest.fixture(autouse=True)
def cluster_secret(monkeypatch):
    """Both nodes hold the same secret (the headless node inherits the environment)."""
    monkeypatch.setenv("NANOPAGED_CLUSTER_SECRET", SECRET)

PROMPTS = ["Hello, my name is", "The capital of France is", "Paged attention splits"]
GRID = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dtype", "float32"]
PP_GRID = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--dtype", "float32"]     # a stage per node


class Headless:
    """`python -m nanopaged.serve --headless` as node `node_rank`, its log in a file."""

    def __init__(self, model, port: int, *args: str, node_rank: int = 1) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanopaged.serve", "--headless", "--model", str(model), "--node-rank",
             str(node_rank), "--master-port", str(port), "--log-level", "warning", *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    output = Server.output          # the same log file and process as the server's
    children = Server.children

    def end(self) -> None:
        """Kill it if it still runs (a failed test), by pid."""
        if self.proc.poll() is None:
            for child in self.children():
                child.kill()
            self.proc.kill()
            self.proc.wait(10)


def _gone(procs: list[psutil.Process], timeout: float = 15.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def _two_nodes(model, *extra: str, grid: list[str] = GRID) -> tuple[Server, Headless]:
    port = _free_port()
    node1 = Headless(model, port, *grid)
    try:
        node0 = Server(model, *TINY_ARGS, *grid, "--node-rank", "0", "--master-port", str(port), *extra)
    except BaseException:
        node1.end()
        raise
    return node0, node1


@pytest.mark.slow          # four processes start: ~40 s on a quiet 2-core machine, 100 s on a busy one
def test_two_nodes_serve_as_one_process_and_node_1_killed_ends_node_0(tiny_model_dir, monkeypatch):
    """pipeline_parallel_size=2, a stage on each node: the API's tokens equal one
    process's (whole and streamed), and the dashboard shows node 1's stage as unknown;
    then node 1's launcher killed (SIGKILL) mid-stream:
    the stream's last event is an error, node 0 logs why (node 1 disconnected) and exits
    1, and no process is left on either node."""
    monkeypatch.setenv("NANOPAGED_COLLECTIVE_TIMEOUT_S", "20")      # a rank stuck in a collective
    node0, node1 = _two_nodes(tiny_model_dir, grid=PP_GRID)
    try:
        procs = node0.children() + node1.children()
        assert len(node0.children()) == 2 and len(node1.children()) == 1     # core + rank 0 | rank 1
        params = dict(model=str(tiny_model_dir), max_tokens=16, temperature=0, ignore_eos=True)
        with httpx.Client(base_url=node0.url, timeout=60) as c:
            texts = [c.post("/v1/completions", json=dict(params, prompt=p)).json()["choices"][0]["text"]
                     for p in PROMPTS]
            with c.stream("POST", "/v1/completions", json=dict(params, prompt=PROMPTS[0], stream=True)) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            assert texts == one_process(tiny_model_dir) and streamed == texts[0] and events[-1] == "[DONE]"
            with c.stream("GET", "/dashboard/events") as r:      # a viewer gets the idle state at once
                snap = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
            # node 0's stage reports on the board; node 1's cannot reach it: unknown, not invented
            assert [(s["stage"], s["ranks"], s["state"], s["batch"] is None) for s in snap["stages"]] == [
                (0, [0], "idle", False), (1, [1], "unknown", True)], snap["stages"]

            long = dict(params, max_tokens=240, stream=True)
            with c.stream("POST", "/v1/completions", json=dict(long, prompt="Hello")) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                node1.proc.kill()                      # its rank dies with it (PR_SET_PDEATHSIG)
                t0 = time.monotonic()
                rest = [line for line in lines if line.startswith("data:")]
        assert node0.proc.wait(timeout=60) == 1
        assert time.monotonic() - t0 < 60
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert last.get("error", {}).get("message") == "the engine core has died", last
        cause = [line for line in node0.output().splitlines() if line.startswith("ERROR") and "exit status 1" in line]
        assert len(cause) == 1 and "node 1 (" in cause[0] and "disconnected" in cause[0], node0.output()
        assert "Traceback" not in node0.output(), node0.output()     # a node that died is no bug
        assert not _gone(procs), "left behind"
    finally:
        node0.stop()
        node1.end()


@pytest.mark.slow          # four processes start: ~30 s on a quiet 2-core machine
def test_node_0_killed_ends_node_1(tiny_model_dir):
    """node 0's server killed (SIGKILL): node 1 notices at once (its connection to node 0
    drops), ends its rank, prints why and exits 1; nothing is left on either node."""
    node0, node1 = _two_nodes(tiny_model_dir)
    try:
        procs = node0.children() + node1.children()
        node0.proc.kill()                              # its core and rank 0 die with it
        assert node1.proc.wait(timeout=30) == 1, node1.output()
        assert "error: node 0 disconnected" in node1.output() and "Traceback" not in node1.output()
        assert not _gone(procs), "left behind"
    finally:
        node0.stop()
        node1.end()


def one_process(model) -> list[str]:
    """PROMPTS' greedy texts from one process (tensor_parallel_size 1)."""
    llm = LLM(str(model), **TINY_ENGINE)                # float32, as TINY_ENGINE names
    try:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.shutdown()


def _llm_and_node_1(model) -> tuple[LLM, Headless, list[psutil.Process]]:
    """LLM(...) as node 0 of two (tensor_parallel_size 2), a headless node 1, and the two
    ranks' processes."""
    port = _free_port()
    node1 = Headless(model, port, *GRID)
    try:
        llm = LLM(str(model), tensor_parallel_size=2, nnodes=2, master_port=port, **TINY_ENGINE)
    except BaseException:
        node1.end()
        raise
    procs = [psutil.Process(p.pid) for p in llm.engine.engine_core.executor.procs] + node1.children()
    assert len(procs) == 2
    return llm, node1, procs


@pytest.mark.parametrize("end", ["shutdown", "a rank raises"])
def test_llm_on_node_0_equals_one_process_and_its_end_ends_node_1(tiny_model_dir, end):
    """LLM(...) as node 0 gives one process's texts. Its shutdown ends node 1 with status
    0; an engine that dies (a rank raises) ends it with status 1 and an error line. No
    process is left, no traceback on node 1."""
    llm, node1, procs = _llm_and_node_1(tiny_model_dir)
    try:
        texts = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
        assert texts == one_process(tiny_model_dir)
        if end == "shutdown":
            llm.shutdown()
        else:
            with pytest.raises(EngineDeadError, match="rank 0 (raised|then failed) in execute_model"):
                llm.engine.engine_core.executor.execute_model("not a SchedulerOutput")
        assert node1.proc.wait(timeout=30) == (0 if end == "shutdown" else 1), node1.output()
        assert not _gone(procs), "left behind"
        out = node1.output()
        assert "Traceback" not in out and ("error:" in out) == (end != "shutdown"), out
    finally:
        llm.shutdown()
        node1.end()


@pytest.mark.parametrize("how, status, error", [
    ("SIGTERM to node 1", 0, r"node 1 \(.*rank 1\) was stopped \(SIGTERM\)"),
    ("SIGKILL to its rank", 1, r"rank 1 \(pid \d+\) on node 1 \(.*\) died: killed by SIGKILL"),
    ("SIGSTOP to node 1", None, r"node 1 \(.*rank 1\) said nothing for \d+ s \(NANOPAGED_NODE_TIMEOUT_S\)"),
], ids=["stopped", "rank-killed", "frozen"])
def test_node_1_ending_while_idle_ends_node_0_naming_it(tiny_model_dir, monkeypatch, how, status, error):
    """While the engine idles, node 1 is stopped (it ends its rank, exits 0), loses its
    rank (it tells node 0, exits 1), or freezes (a lost host: silent past
    NANOPAGED_NODE_TIMEOUT_S, 3 s here): node 0's health check (the core process runs it
    while idle) and its next step raise EngineDeadError saying which; no process is left."""
    monkeypatch.setenv("NANOPAGED_NODE_TIMEOUT_S", "3")
    llm, node1, procs = _llm_and_node_1(tiny_model_dir)
    try:
        llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
        if how == "SIGTERM to node 1":
            node1.proc.send_signal(signal.SIGTERM)
        elif how == "SIGKILL to its rank":
            procs[1].kill()
        else:
            node1.proc.send_signal(signal.SIGSTOP)
        if status is not None:
            assert node1.proc.wait(timeout=30) == status, node1.output()
        executor = llm.engine.engine_core.executor
        deadline = time.monotonic() + 30
        with pytest.raises(EngineDeadError, match=error):
            while time.monotonic() < deadline:
                executor.check_health()
                time.sleep(0.1)
        with pytest.raises(EngineDeadError, match=error):
            llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        node1.end()                                    # the frozen one (SIGKILL reaches it)
        assert not _gone(procs), "left behind"
        assert "Traceback" not in node1.output(), node1.output()
    finally:
        llm.shutdown()
        node1.end()


# -- bad settings ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes=2, tensor_parallel_size=3, master_port=29500), r"the 3 ranks \(tensor_parallel_size=3.*nnodes=2"),
    (dict(nnodes=2, node_rank=2, tensor_parallel_size=2, master_port=29500), "node_rank=2 must be less than nnodes=2"),
    (dict(nnodes=2, tensor_parallel_size=2), "nnodes=2 needs master_port"),
    (dict(nnodes=2, tensor_parallel_size=2, master_port=29500, distributed_executor_backend="external_launcher"),
     "runs on the 'mp' executor"),
    (dict(master_port=70000), "master_port must be a port number"),
    (dict(nnodes=0), "nnodes must be a positive integer, got 0"),
])
def test_bad_node_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_node_1_is_headless_and_node_0_is_not(tiny_model_dir):
    with pytest.raises(ValueError, match="node_rank=1: the engine runs on node 0.*--headless"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29500)
    with pytest.raises(ValueError, match="--headless runs a node other than node 0"):
        serve_headless(parse_args(["--headless", "--model", str(tiny_model_dir), "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", "29500"]))
    with pytest.raises(ValueError, match="--headless is for a node of a multi-node engine"):
        serve_headless(parse_args(["--headless", "--model", str(tiny_model_dir)]))


def test_a_node_that_never_joins_is_a_clear_error(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("NANOPAGED_JOIN_TIMEOUT_S", "2")
    before = set(psutil.Process().children(recursive=True))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"1 of 2 nodes \(1 of 2 ranks\) joined within 2 s.*missing node 1 "
                                           r"\(rank 1\).*--headless --nnodes 2 --node-rank R"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2, nnodes=2, master_port=_free_port(), **TINY_ENGINE)
    assert time.monotonic() - start < 30
    assert not _gone(list(set(psutil.Process().children(recursive=True)) - before))
    # and a headless node that finds no node 0 (its signal handlers are put back after)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="node 0 did not answer at 127.0.0.1:.* within 2 s"):
        serve_headless(parse_args(["--headless", "--model", str(tiny_model_dir), "--tensor-parallel-size", "2",
                                   "--nnodes", "2", "--node-rank", "1", "--master-port", str(_free_port())]))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


def test_a_mismatched_nnodes_is_an_error_on_both_hosts(tiny_model_dir):
    port = _free_port()
    node1 = Headless(tiny_model_dir, port, "--tensor-parallel-size", "4", "--nnodes", "4")
    try:
        with pytest.raises(RuntimeError, match="node 1 .* refused to join: node 1 has nnodes=4, "
                                               "tensor_parallel_size=4, pipeline_parallel_size=1 but node 0 has nnodes=2"):
            LLM(str(tiny_model_dir), tensor_parallel_size=4, nnodes=2, master_port=port, **TINY_ENGINE)
        assert node1.proc.wait(timeout=60) == 1
        out = node1.output()
        assert ("error: node 1 has nnodes=4, tensor_parallel_size=4, pipeline_parallel_size=1 but node 0 has "
                "nnodes=2") in out, out
        assert "Traceback" not in out, out
    finally:
        node1.end()


@pytest.mark.slow          # six rank processes start on 2 cores: ~60 s
def test_pp2_tp2_over_two_nodes_equals_pp1_tp2_on_one(tiny_model_dir):
    """tensor_parallel_size=2 x pipeline_parallel_size=2, a stage (two ranks) per node,
    gives the token ids and float32 logprobs of tensor_parallel_size=2 on one host, bit
    for bit: the stages do the same operations in the same order (DESIGN.md)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(llm) -> list:
        try:
            # one prompt at a time: the same batches on both sides (pp=2 keeps two in flight)
            outs = [llm.generate(p, params, use_tqdm=False)[0] for p in PROMPTS]
            return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                    for o in outs]
        finally:
            llm.shutdown()
    one_host = run(LLM(str(tiny_model_dir), tensor_parallel_size=2, **TINY_ENGINE))
    grid = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "2", "--dtype", "float32"]
    port = _free_port()
    node1 = Headless(tiny_model_dir, port, *grid)
    try:
        llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, master_port=port,
                  **TINY_ENGINE)
        assert run(llm) == one_host
        assert node1.proc.wait(timeout=30) == 0, node1.output()
    finally:
        node1.end()


def test_single_host_worker_sockets_are_ipc_in_a_private_folder(tiny_model_dir):
    """One host, two ranks: every executor socket is ipc, in a folder only the user can
    open (mode 0700: pickle stays there), and the ranks listen on nothing but gloo's
    loopback pairs."""
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, **TINY_ENGINE)
    try:
        executor = llm.engine.engine_core.executor
        assert os.stat(executor._dir).st_mode & 0o777 == 0o700
        endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in [*executor.inputs, executor.output]]
        assert all(e.startswith(f"ipc://{executor._dir}/") for e in endpoints), endpoints
        ranks = [psutil.Process(p.pid) for p in executor.procs]
        listening = {c.laddr.ip for p in ranks for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        assert listening <= {"127.0.0.1"}, listening
    finally:
        llm.shutdown()
