"""MultiprocExecutor: one worker process per rank of the tensor_parallel_size x
pipeline_parallel_size grid (chapter 17; tp inner: rank = pp_rank * tp + tp_rank).

Each step the SchedulerOutput is encoded once and pushed to every rank over a pyzmq
socket (vLLM pushes it through a shared-memory queue; bench.py --sections tp measures
ours against a broadcast over the process group). On one host the sockets are ipc, in
a folder only the user can open (mode 0700), and the messages pickled; across hosts
(nnodes > 1) every message is utils/codec.py's data-only encoding and every tcp socket
CURVE (cluster_auth.py). Each rank is a worker_proc.WorkerProc. The ranks run the same
step and meet only in the model's collectives and the stages' sends over
torch.distributed (gloo on the CPU, NCCL on CUDA). The last stage's first rank, global rank (pp - 1) * tp, answers
with the output, the last stage's other ranks with their sampled ids (checked equal).
`execute_model(..., non_blocking=True)` returns at once with a future of that answer,
so that pp batches can be in flight; answers are kept by call until asked for.

Faults: a worker that raises or dies, or a step with no answer within
NANOPAGED_EXECUTE_MODEL_TIMEOUT_S (300 s, vLLM's default), ends every worker and raises
EngineDeadError naming the rank and why. A collective waiting on a dead rank raises
after NANOPAGED_COLLECTIVE_TIMEOUT_S (worker.py). Workers also die with the engine
process (PR_SET_PDEATHSIG, plus a parent check each second while idle).
With nnodes > 1 some ranks live on other hosts: they are reached over tcp and watched
through their node (multinode.py, RemoteNodes).
With pp > 1 each stage's first rank on this host reports the batch (its call id) it is
on and what it is doing on a shared board (stage_progress.py), read by stage_progress().
vLLM: `vllm/v1/executor/multiproc_executor.py` (`non_blocking`, `output_rank`).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import weakref

import zmq

from ..layers.backends import TorchOps
from ..utils import codec
from ..utils.proc import EngineDeadError, exit_reason, spawn_child, stop_processes, wait_ready
from .cluster_auth import ClusterAuth, cluster_secret
from ..worker.executor import Executor, combine_stage_costs
from .multinode import NodePlan, RemoteNodes, bind_tcp, join_timeout_s
from .multinode import grid as multinode_grid
from .stage_progress import StageBoard
from .worker_proc import STEP_METHODS, output_rank, wire

EXECUTE_MODEL_TIMEOUT_S = float(os.environ.get("NANOPAGED_EXECUTE_MODEL_TIMEOUT_S", "300"))
_STARTUP_TIMEOUT_S = 600.0      # loading a shard and building the kernels, at most
_SEND_TIMEOUT_MS = 5000
logger = logging.getLogger(__name__)


class MultiprocExecutor(Executor):
    """One process per rank (a fresh interpreter each, as the EngineCore process of
    engine_core_client.py: no fork, no re-run of the user's __main__).

    Args:
        config, model_path, model_config: the engine's.
        ops: the kernels the engine chose; each rank loads the same kind by its name.

    Raises:
        RuntimeError: a worker failed to start (its traceback is in the message).
    """

    def __init__(self, config, model_path, model_config, ops: TorchOps) -> None:
        self.world_size = n = config.parallel_config.world_size
        self.tensor_parallel_size = config.parallel_config.tensor_parallel_size
        self.pipeline_parallel_size = config.parallel_config.pipeline_parallel_size
        self.output_rank = output_rank(config)         # answers each step
        self.dead_reason: str | None = None
        # ranks [0, local) are this host's; the rest are other nodes' (multinode.py)
        secret = cluster_secret(config, announce=logger.warning) if config.parallel_config.nnodes > 1 else None
        self.nodes = RemoteNodes(config, n, secret, model_config) if secret else None
        self.num_local_ranks = local = n // config.parallel_config.nnodes
        self._dumps, self._loads = wire(config.parallel_config.nnodes > 1)
        self._dir = tempfile.mkdtemp(prefix="nanopaged-tp-")      # mode 0700: the ipc sockets' folder
        # one word per stage, written by the stage's first rank (pipeline parallelism only)
        self.stage_board = (StageBoard(os.path.join(self._dir, "stages"), config.parallel_config.pipeline_parallel_size, create=True)
                            if config.parallel_config.pipeline_parallel_size > 1 else None)
        self.ctx = zmq.Context()
        self.auth = ClusterAuth(self.ctx, secret) if secret else None
        self.inputs, addresses = [], []
        for rank in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
            if rank < local:
                addresses.append(f"ipc://{self._dir}/rank{rank}")
                sock.bind(addresses[-1])
            else:                 # CURVE: only the rank holding the secret can take its messages
                self.auth.serve(sock, f"rank {rank}'s input")
                addresses.append(bind_tcp(sock, self.nodes.ip))
            self.inputs.append(sock)
        self.output = self.ctx.socket(zmq.PULL)
        if self.auth is not None:
            self.auth.serve(self.output, "the ranks' answers")
        self.output.bind(f"ipc://{self._dir}/output")
        self.procs: list[subprocess.Popen] = []         # this host's ranks
        # Ends the workers on shutdown(), on `del llm` and at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.inputs, self.output,
                                           self.ctx, self._dir, self.nodes, self.auth, self._dumps)
        self.send_seconds = 0.0          # encoding + pushing control messages (the bench)
        self._call_id = 0
        self._answers: dict[int, tuple[str, dict]] = {}   # call_id -> (method, rank -> answer), while awaited
        threads = None if "OMP_NUM_THREADS" in os.environ else max(1, len(os.sched_getaffinity(0)) // local)
        settings = dict(config=config, model_path=str(model_path), world_size=n, ops=ops.name,
                        init_method=f"file://{self._dir}/rendezvous",
                        output_address=f"ipc://{self._dir}/output", num_threads=threads)
        ready = {}
        try:
            if self.nodes is not None:      # the others start their ranks from node 0's plan
                settings.update(init_method=None)
                plan = dict(settings, output_address=bind_tcp(self.output, self.nodes.ip))
                self.nodes.publish(NodePlan(multinode_grid(config), n, plan,
                                            [None] * local + addresses[local:], self.nodes.store_address))
                settings.update(store=self.nodes.store_address, node_ip=self.nodes.ip, cluster_secret=secret)
                logger.info("waiting up to %.0f s for %d more node(s) to join at %s:%s (NANOPAGED_JOIN_TIMEOUT_S)",
                            join_timeout_s(), config.parallel_config.nnodes - 1, config.parallel_config.master_addr, config.parallel_config.master_port)
                self.nodes.wait("joined", join_timeout_s())
            for rank in range(local):
                board = self.stage_board is not None and rank % self.tensor_parallel_size == 0
                proc, fd = spawn_child("nanopaged.multiproc.worker_proc:WorkerProc",
                                       dict(settings, rank=rank, input_address=addresses[rank],
                                            stage_board=(self.stage_board.path, self.pipeline_parallel_size)
                                            if board else None))
                self.procs.append(proc)
                ready[fd] = (f"{self._rank_name(rank)} (pid {proc.pid})", proc)
            wait_ready(ready, _STARTUP_TIMEOUT_S, check=self.nodes and self.nodes.check)
            if self.nodes is not None:
                self.nodes.wait("ready", _STARTUP_TIMEOUT_S)
        except BaseException as e:
            if self.nodes is not None:          # the other nodes end their ranks too
                self.nodes.stop(f"node 0 failed to start: {e}")
            self.shutdown()
            raise
        finally:
            for fd in ready:
                os.close(fd)

    def collective_rpc(self, method: str, args: tuple = (), timeout: float = EXECUTE_MODEL_TIMEOUT_S) -> list:
        """Send (method, args) to every rank, wait for all answers.

        Raises:
            EngineDeadError: a rank raised or died, no answer came within `timeout`
                seconds, or the ranks sampled different tokens; every worker is ended.
        """
        call_id = self._send(method, args)
        try:
            return self._collect(call_id, timeout)
        except BaseException:
            self._answers.pop(call_id, None)    # cut short (Ctrl-C): its late answers are dropped
            raise

    def execute_model(self, scheduler_output, non_blocking: bool = False):
        """The step's ModelRunnerOutput from output_rank (None: sample_tokens finishes it);
        non_blocking: sent now, a StepFuture of it returned at once."""
        return self._step("execute_model", (scheduler_output,), non_blocking)

    def sample_tokens(self, sampling_input, non_blocking: bool = False):
        return self._step("sample_tokens", (sampling_input,), non_blocking)

    def _step(self, method: str, args: tuple, non_blocking: bool):
        if not non_blocking:
            return self.collective_rpc(method, args)[self.output_rank]
        return StepFuture(self, self._send(method, args))

    def stage_progress(self) -> list[tuple[int, str] | None] | None:
        """Per pipeline stage, (batch, state) as its first rank last reported them
        (stage_progress.py; batch: the call id of the batch's execute_model, 0 before the
        first), or None for a stage on another host (it cannot reach the board). None
        at pp=1."""
        if self.stage_board is None:
            return None
        return [report if stage * self.tensor_parallel_size < self.num_local_ranks else None
                for stage, report in enumerate(self.stage_board.read())]

    def measure_preemption_costs(self):
        """Every stage's costs combined (executor.combine_stage_costs): at one stage, rank 0's."""
        return combine_stage_costs(self.collective_rpc("measure_preemption_costs"), self.tensor_parallel_size)

    def _send(self, method: str, args: tuple) -> int:
        """Push (call_id, method, args) to every rank; its call_id."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if reason := self._dead_rank_reason():
            # A rank that died since the last call is the cause. Checked first: a push
            # to it would wait _SEND_TIMEOUT_MS, while the live ranks fail in their
            # collectives and exit, and the lowest of those would then be blamed.
            self._fail(reason)
        start = time.perf_counter()
        self._call_id += 1
        self._answers[self._call_id] = (method, {})
        data = self._dumps((self._call_id, method, args, time.monotonic()))
        for rank, sock in enumerate(self.inputs):
            try:
                sock.send(data, copy=False)
            except zmq.Again:
                self._fail(self._dead_rank_reason() or f"worker rank {rank} took no message for "
                           f"{_SEND_TIMEOUT_MS} ms")
        self.send_seconds += time.perf_counter() - start
        return self._call_id

    def _collect(self, call_id: int, timeout: float = EXECUTE_MODEL_TIMEOUT_S) -> list:
        """Every rank's answer to call_id, in rank order; answers to other calls still
        awaited are kept for them, the rest dropped. Raises EngineDeadError (collective_rpc)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        method, answers = self._answers[call_id]
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            if self.output.poll(100):
                answer = self._answer()
                if answer is None:
                    continue
                other, rank, ok, result = answer
                if other not in self._answers:
                    continue
                if not ok:
                    self._fail_with_errors(self._answers[other][0], {rank: result})
                self._answers[other][1][rank] = result
            elif reason := self._dead_rank_reason():
                self._fail(reason)
            elif time.monotonic() > deadline:
                pending = sorted(set(range(self.world_size)) - set(answers))
                self._fail(f"{self._workers_name()} {pending} gave no answer to {method} within {timeout:.0f} s")
        del self._answers[call_id]
        results = [answers[rank] for rank in range(self.world_size)]
        out = results[self.output_rank]
        if method in STEP_METHODS and out is not None:
            # the last stage's ranks sampled alike (the earlier stages sample nothing)
            for rank in range(self.output_rank + 1, self.world_size):
                if results[rank] != out.sampled_token_ids:
                    self._fail(f"{self._rank_name(rank)} sampled {results[rank]}, rank {self.output_rank} "
                               f"{out.sampled_token_ids}")
        return results

    def _answer(self) -> tuple | None:
        """The next (call_id, rank, ok, result) on the output socket; None for bytes that
        are not one (dropped with a line that does not quote them)."""
        data = self.output.recv()
        try:
            answer = self._loads(data)
        except codec.CodecError as e:
            logger.warning("dropped a malformed answer from a worker: %s", e)
            return None
        if not (isinstance(answer, tuple) and len(answer) == 4 and type(answer[1]) is int
                and 0 <= answer[1] < self.world_size):
            logger.warning("dropped a malformed answer from a worker: not (call, rank, ok, result)")
            return None
        return answer

    def _rank_name(self, rank: int) -> str:
        if self.pipeline_parallel_size == 1:
            return f"tensor-parallel worker rank {rank}"
        stage, tp_rank = divmod(rank, self.tensor_parallel_size)
        return f"worker rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"

    def _workers_name(self) -> str:
        return "tensor-parallel workers" if self.pipeline_parallel_size == 1 else "workers"

    def _fail_with_errors(self, method: str, errors: dict[int, str]) -> None:
        """A rank raised: collect what the others say for a moment, then fail naming the
        root cause (a rank that died makes the others raise in their collectives)."""
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            if self.output.poll(50) and (answer := self._answer()) is not None:
                _, rank, ok, result = answer
                if not ok:
                    errors[rank] = result
        first = min(errors)
        dead = self._dead_rank_reason(exclude=set(errors))     # those exit after reporting
        self._fail(f"{dead}; rank {first} then failed in {method}: {errors[first].strip().splitlines()[-1]}"
                   if dead else f"{self._rank_name(first)} raised in {method}:\n{errors[first]}")

    def _dead_rank_reason(self, exclude=()) -> str | None:
        nodes = self.nodes
        if nodes is not None and nodes.dead_reason and nodes.dead_rank not in exclude:   # another host's
            return nodes.dead_reason
        for rank, proc in enumerate(self.procs):
            if rank not in exclude and proc.poll() is not None:
                return f"{self._rank_name(rank)} (pid {proc.pid}) died: {exit_reason(proc.returncode)}"
        return None

    def check_health(self) -> None:
        """Raise EngineDeadError if another node is gone (checked while the engine idles;
        a step finds a dead local rank itself). Every worker is ended."""
        if self.dead_reason is None and self.nodes is not None and self.nodes.dead_reason:
            self._fail(self.nodes.dead_reason)

    def _fail(self, reason: str) -> None:
        self.dead_reason = reason
        if self.nodes is not None:
            self.nodes.stop(reason)
        for proc in self.procs:          # a broken group cannot stop gracefully (a rank may be stuck)
            if proc.poll() is None:
                proc.kill()
        self.shutdown()
        raise EngineDeadError(reason)

    def shutdown(self) -> None:
        """Ask every worker to stop, wait up to 5 s, then terminate / kill; close the
        sockets. Idempotent; later calls raise EngineDeadError."""
        if self.dead_reason is None:
            self.dead_reason = f"the {self._workers_name()} were shut down"
        self._finalizer()


class StepFuture:
    """A step sent to the workers and not yet answered (execute_model(non_blocking=True))."""

    def __init__(self, executor: MultiprocExecutor, call_id: int) -> None:
        self.executor, self.call_id, self._result = executor, call_id, None
        self._done = False

    def result(self):
        """Wait for the step's answer (output_rank's); raises EngineDeadError as collective_rpc."""
        if not self._done:
            self._result = self.executor._collect(self.call_id)[self.executor.output_rank]
            self._done = True
        return self._result


def _stop_workers(procs, inputs, output, ctx, folder, nodes, auth, dumps) -> None:
    for rank, sock in enumerate(inputs):
        if rank >= len(procs) or procs[rank].poll() is None:     # another host's ranks: always
            try:
                sock.send(dumps((0, "shutdown", (), 0.0)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    stop_processes(procs)
    if nodes is not None:
        nodes.stop()
    for sock in [*inputs, output]:
        sock.close(linger=0)
    if auth is not None:
        auth.stop()
    ctx.term()
    shutil.rmtree(folder, ignore_errors=True)
