"""A worker process: one rank of the MultiprocExecutor's grid, on this host or another.

It takes (call_id, method, args, sent_at) messages on its input socket, calls its
Worker, and answers (call_id, rank, ok, result) on the output socket, until told to shut
down or its parent is gone. On one host the messages are pickled over ipc sockets in a
0700 folder; when any rank lives on another host (nnodes > 1) they are utils/codec.py's
data-only encoding, and the tcp sockets CURVE (cluster_auth.py).
vLLM: `WorkerProc` in vllm/v1/executor/multiproc_executor.py.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
import traceback

import torch
import zmq

from ..layers.backends import get_ops
from ..utils import codec
from ..utils.proc import exit_child, read_settings, report_ready
from .cluster_auth import ClusterAuth
from .multinode import join_timeout_s, rank_store
from .stage_progress import StageBoard, StageReporter
from ..features import Composition
from ..worker.worker import Worker, init_process_group

STEP_METHODS = ("execute_model", "sample_tokens")     # answered with a ModelRunnerOutput (or None)
logger = logging.getLogger(__name__)


def _pickle(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def wire(across_hosts: bool):
    """(dumps, loads) of the executor's messages: pickle between the processes of one
    host (ipc sockets in a 0700 folder), codec's data-only encoding when any rank is on
    another host. loads raises codec.CodecError for bytes that are not a message."""
    return (codec.encode, codec.decode) if across_hosts else (_pickle, pickle.loads)


def output_rank(config) -> int:
    """The global rank that answers each step: the last stage's first tensor-parallel rank."""
    return (config.parallel_config.pipeline_parallel_size - 1) * config.parallel_config.tensor_parallel_size


class WorkerProc:
    """A worker process's loop: take (method, args) messages, call the Worker, answer."""

    def __init__(self, worker: Worker, rank: int, input_address: str, output_address: str,
                 parent_pid: int, output_rank: int = 0, progress: StageReporter | None = None,
                 cluster_secret: bytes | None = None) -> None:
        self.worker, self.rank, self.parent_pid = worker, rank, parent_pid
        self.output_rank = output_rank          # the rank that answers steps whole
        self.progress = progress                # a stage's first rank on node 0: its word on the board
        self._dumps, self._loads = wire(cluster_secret is not None)
        self.ctx = zmq.Context()
        auth = ClusterAuth(self.ctx, cluster_secret) if cluster_secret else None
        self.input = self.ctx.socket(zmq.PULL)
        if input_address.startswith("tcp://"):      # another host's engine: CURVE
            auth.connect_to(self.input)
        self.input.connect(input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        if auth is not None:                        # node 0's answer socket is CURVE for every rank
            auth.connect_to(self.output)
        self.output.connect(output_address)
        self.recv_seconds = 0.0        # from the engine's send to the decoded message
        self.execute_seconds = 0.0     # in execute_model

    def run(self) -> None:
        """Serve until told to shut down or the engine process is gone."""
        while True:
            if not self.input.poll(1000):
                if os.getppid() != self.parent_pid:
                    return
                continue
            try:
                call_id, method, args, sent_at = self._loads(self.input.recv())
                if not (isinstance(method, str) and isinstance(args, (list, tuple))) or method.startswith("_"):
                    raise codec.CodecError("not (call, method, args, time)")
            except (codec.CodecError, TypeError, ValueError) as e:
                logger.warning("rank %d dropped a malformed message: %s", self.rank, e)
                continue
            if method == "shutdown":
                return
            start = time.monotonic()
            self.recv_seconds += start - sent_at
            try:
                if method == "get_comm_stats":
                    result = dict(self.worker.get_comm_stats(), recv_seconds=self.recv_seconds,
                                  execute_seconds=self.execute_seconds)
                elif self.progress is not None:
                    result = self.progress.call(self.worker, call_id, method, args)
                else:
                    result = getattr(self.worker, method)(*args)
                if method in STEP_METHODS and self.rank != self.output_rank and result is not None:
                    # the last stage's ranks: for the check that they agree; earlier stages: nothing
                    result = result.sampled_token_ids if self.rank > self.output_rank else None
                ok = True
            except BaseException:
                result, ok = traceback.format_exc(), False
            if method in STEP_METHODS:
                self.execute_seconds += time.monotonic() - start
            self.output.send(self._dumps((call_id, self.rank, ok, result)))
            if not ok:      # the group's collectives are out of step now: the engine ends us all
                raise SystemExit(1)

    @staticmethod
    def main() -> None:
        """Entry point of `python -c "...WorkerProc.main()"`: read the settings from
        stdin, join the process group, load this rank's shard, say ready, serve (the
        KV pool comes by message: initialize_kv_cache)."""
        s, ready_fd = read_settings()
        if s["num_threads"]:
            torch.set_num_threads(s["num_threads"])
        parent_pid, exit_code = os.getppid(), 0

        def start():
            from ..model.config import ModelConfig

            config = s["config"]
            store = s.get("store") and rank_store(s["node_ip"], s["store"], join_timeout_s())    # nnodes > 1
            group = init_process_group(s["rank"], s["world_size"], s["init_method"], config.torch_device, store)
            ops = get_ops(s["ops"], config.torch_device)     # the kind the engine chose, loaded here
            worker = Composition.of(config).build(Worker, "worker")(config, s["model_path"], ModelConfig.from_pretrained(s["model_path"]), ops=ops,
                            rank=s["rank"], world_size=s["world_size"], process_group=group)
            board = s.get("stage_board")          # (path, stages): a stage's first rank on node 0
            progress = board and StageReporter(StageBoard(*board), s["rank"] // config.parallel_config.tensor_parallel_size)
            return WorkerProc(worker, s["rank"], s["input_address"], s["output_address"], parent_pid,
                              output_rank(config), progress or None, s.get("cluster_secret")), None

        proc = report_ready(ready_fd, start)
        try:
            proc.run()
        except BaseException:
            exit_code = 1
        proc.input.close(linger=0)
        proc.output.close(linger=1000)
        proc.ctx.term()
        exit_child(exit_code)
