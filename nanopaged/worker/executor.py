"""Executors: how the EngineCore reaches its workers (one per tensor-parallel rank).

The EngineCore calls `executor.execute_model(scheduler_output)` once a step and gets
one ModelRunnerOutput back, whatever the number of ranks (vLLM v1's Executor,
`vllm/v1/executor/`). Creating one starts its workers, which load their weights; the
EngineCore then asks them how much memory is left (`determine_available_memory`) and
gives them their KV pools (`initialize_kv_cache`). Three kinds:

- UniProcExecutor: one Worker in this process (tensor_parallel_size=1, the default).
- MultiprocExecutor: one process per rank. Each step the SchedulerOutput is pickled
  once and pushed to every rank over a pyzmq socket (vLLM pushes it through a
  shared-memory queue; bench.py --sections tp measures ours against a broadcast over
  the process group). The ranks run the same step SPMD-style and meet only in the
  model's collectives over torch.distributed (gloo on the CPU, NCCL on CUDA); rank 0
  answers with the output, the others with their sampled ids (checked equal).
- ExternalLauncherExecutor: for `torchrun` (vLLM's "external_launcher"): torchrun
  starts N copies of the user's script, each a whole engine with one Worker; they join
  torchrun's process group. Every copy schedules the same requests the same way, so
  nothing needs to be sent; this is how a run spans several machines.

Faults: a worker that raises or dies, or a step with no answer within
NANOPAGED_EXECUTE_MODEL_TIMEOUT_S (300 s, vLLM's default), ends every worker and
raises EngineDeadError naming the rank and why. A collective waiting on a dead rank
raises after NANOPAGED_COLLECTIVE_TIMEOUT_S (worker.py). Workers also die with the
engine process (PR_SET_PDEATHSIG, plus a parent check each second while idle).
"""
from __future__ import annotations

import atexit
import os
import pickle
import shutil
import subprocess
import tempfile
import time
import traceback
import weakref

import torch
import zmq

from ..utils.proc import (EngineDeadError, exit_child, exit_reason, read_settings, report_ready, spawn_child,
                          stop_processes, wait_ready)
from ..messages import GrammarOutput, ModelRunnerOutput, PreemptionCosts, SchedulerOutput
from .worker import Worker, init_process_group

EXECUTE_MODEL_TIMEOUT_S = float(os.environ.get("NANOPAGED_EXECUTE_MODEL_TIMEOUT_S", "300"))
_STARTUP_TIMEOUT_S = 600.0      # loading a shard and building the kernels, at most
_SEND_TIMEOUT_MS = 5000
_STEP_METHODS = ("execute_model", "sample_tokens")     # answered with a ModelRunnerOutput (or None)


class Executor:
    """Runs the model on the workers. Subclasses give collective_rpc.

    Attributes:
        attn_backend: the attention backend the engine resolved (an object, or its
            name for workers in other processes), handed to initialize_kv_cache.
    """

    attn_backend: object

    @staticmethod
    def create(config, model_path, model_config, attn_backend) -> "Executor":
        """The executor config.distributed_executor_backend names, its workers started
        with their weights loaded and no KV pool yet (initialize_kv_cache makes it)."""
        kind = {"uni": UniProcExecutor, "mp": MultiprocExecutor,
                "external_launcher": ExternalLauncherExecutor}[config.executor_backend]
        return kind(config, model_path, model_config, attn_backend)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call Worker.<method>(*args) on every rank; their results in rank order."""
        raise NotImplementedError

    def determine_available_memory(self) -> list[int]:
        """Per rank, the bytes it can give its KV pool, measured with its weights loaded
        (Worker.determine_available_memory)."""
        return self.collective_rpc("determine_available_memory")

    def initialize_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Give every rank a KV pool of num_gpu_blocks blocks and a swap pool of
        num_cpu_blocks (Worker.initialize_kv_cache); before this, no step can run."""
        self.collective_rpc("initialize_kv_cache", (num_gpu_blocks, num_cpu_blocks, self.attn_backend))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step on every rank; rank 0's ModelRunnerOutput, or None when the step has
        structured-output rows: then sample_tokens finishes it."""
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """Sample the step execute_model left waiting, with its rows' token masks, on
        every rank; rank 0's ModelRunnerOutput."""
        return self.collective_rpc("sample_tokens", (grammar_output,))[0]

    def measure_preemption_costs(self) -> PreemptionCosts:
        """Rank 0's measurement (every rank runs it: the timed forward is collective)."""
        return self.collective_rpc("measure_preemption_costs")[0]

    def get_comm_stats(self) -> list[dict]:
        """Per rank: seconds in collectives and their count (plus, with processes, the
        seconds spent receiving control messages and executing steps)."""
        return self.collective_rpc("get_comm_stats")

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


class UniProcExecutor(Executor):
    """One Worker in this process: the whole model, no communication.

    Attributes:
        driver_worker: the Worker (its model_runner is the engine's).
    """

    def __init__(self, config, model_path, model_config, attn_backend,
                 rank: int = 0, world_size: int = 1, process_group=None) -> None:
        self.attn_backend = attn_backend
        self.driver_worker = Worker(config, model_path, model_config, rank, world_size, process_group)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(self.driver_worker, method)(*args)]


class ExternalLauncherExecutor(UniProcExecutor):
    """One Worker per process, the processes started by torchrun (vLLM's
    "external_launcher"): rank and size from torchrun's RANK and WORLD_SIZE.

    Every process runs the whole engine with the same inputs; anything measured (the
    memory left for the KV pool, the preemption costs) is agreed on first, so that all
    copies schedule the same way.

    Raises:
        ValueError: not under torchrun, or WORLD_SIZE != tensor_parallel_size.
    """

    def __init__(self, config, model_path, model_config, attn_backend) -> None:
        import torch.distributed as dist

        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("distributed_executor_backend='external_launcher' runs under torchrun "
                             "(RANK and WORLD_SIZE are not set)")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != config.tensor_parallel_size:
            raise ValueError(f"torchrun started WORLD_SIZE={world} processes but "
                             f"tensor_parallel_size={config.tensor_parallel_size}")
        device = config.torch_device
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        owns_group = not dist.is_initialized()
        group = init_process_group(rank, world, "env://", device) if owns_group else dist.group.WORLD
        # Leave the group before the interpreter ends (shutdown, `del llm` or exit): a
        # gloo group still alive at exit can abort the process (SIGABRT) after its work.
        # atexit runs its handlers last registered first, so registering here, after the
        # group exists, leaves it before the handlers torch registered earlier tear down
        # what it uses (a finalizer alone runs from weakref's one atexit hook, which
        # may have been registered before them).
        self._finalizer = weakref.finalize(self, dist.destroy_process_group) if owns_group else None
        if owns_group:
            atexit.register(self._finalizer)
        self.group, self.device = group, device
        super().__init__(config, model_path, model_config, attn_backend, rank, world, group)

    def determine_available_memory(self) -> list[int]:
        """The least memory any process has left (one all-reduce), so that every copy
        of the engine sizes the same KV pool."""
        import torch.distributed as dist

        # on the rank's device: an NCCL group takes CUDA tensors only
        agreed = torch.tensor(super().determine_available_memory(), dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return [int(agreed[0])]

    def shutdown(self) -> None:
        """Leave torchrun's process group, if this executor joined it (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()

    def measure_preemption_costs(self) -> PreemptionCosts:
        import torch.distributed as dist

        costs = [self.driver_worker.measure_preemption_costs()]
        dist.broadcast_object_list(costs, src=0, group=self.group)      # rank 0's, everywhere
        return costs[0]


class MultiprocExecutor(Executor):
    """One process per rank (a fresh interpreter each, as the EngineCore process of
    engine_core_client.py: no fork, no re-run of the user's __main__).

    Args:
        config, model_path, model_config: the engine's.
        attn_backend: the backend the engine resolved; each rank builds the same by name.

    Raises:
        RuntimeError: a worker failed to start (its traceback is in the message).
    """

    def __init__(self, config, model_path, model_config, attn_backend) -> None:
        self.world_size = n = config.tensor_parallel_size
        self.attn_backend = getattr(attn_backend, "name", "torch")    # the ranks build it by name
        self.dead_reason: str | None = None
        self._dir = tempfile.mkdtemp(prefix="nanopaged-tp-")
        self.ctx = zmq.Context()
        self.inputs = []
        for rank in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
            sock.bind(f"ipc://{self._dir}/rank{rank}")
            self.inputs.append(sock)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(f"ipc://{self._dir}/output")
        self.procs: list[subprocess.Popen] = []
        # Ends the workers on shutdown(), on `del llm` and at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.inputs, self.output,
                                           self.ctx, self._dir)
        self.send_seconds = 0.0          # pickling + pushing control messages (the bench)
        self._call_id = 0
        threads = None if "OMP_NUM_THREADS" in os.environ else max(1, len(os.sched_getaffinity(0)) // n)
        settings = dict(config=config, model_path=str(model_path), world_size=n,
                        init_method=f"file://{self._dir}/rendezvous",
                        output_address=f"ipc://{self._dir}/output", num_threads=threads)
        ready = {}
        try:
            for rank in range(n):
                proc, fd = spawn_child("nanopaged.worker.executor:WorkerProc",
                                       dict(settings, rank=rank, input_address=f"ipc://{self._dir}/rank{rank}"))
                self.procs.append(proc)
                ready[fd] = (f"tensor-parallel worker rank {rank} (pid {proc.pid})", proc)
            wait_ready(ready, _STARTUP_TIMEOUT_S)
        except BaseException:
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
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if reason := self._dead_rank_reason():
            # A rank that died since the last call is the cause. Checked first: a push
            # to it would wait _SEND_TIMEOUT_MS, while the live ranks fail in their
            # collectives and exit, and the lowest of those would then be blamed.
            self._fail(reason)
        start = time.perf_counter()
        self._call_id += 1          # answers to an earlier call (cut short by Ctrl-C) are dropped
        data = pickle.dumps((self._call_id, method, args, time.monotonic()), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, sock in enumerate(self.inputs):
            try:
                sock.send(data, copy=False)
            except zmq.Again:
                self._fail(self._dead_rank_reason() or f"worker rank {rank} took no message for "
                           f"{_SEND_TIMEOUT_MS} ms")
        self.send_seconds += time.perf_counter() - start
        results, pending = [None] * self.world_size, set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            if self.output.poll(100):
                call_id, rank, ok, result = pickle.loads(self.output.recv())
                if call_id != self._call_id:
                    continue
                if not ok:
                    self._fail_with_errors(method, {rank: result})
                results[rank] = result
                pending.discard(rank)
            elif reason := self._dead_rank_reason():
                self._fail(reason)
            elif time.monotonic() > deadline:
                self._fail(f"tensor-parallel workers {sorted(pending)} gave no answer to {method} "
                           f"within {timeout:.0f} s")
        if method in _STEP_METHODS and results[0] is not None:
            sampled = results[0].sampled_token_ids
            for rank in range(1, self.world_size):
                if results[rank] != sampled:
                    self._fail(f"tensor-parallel rank {rank} sampled {results[rank]}, rank 0 {sampled}")
        return results

    def _fail_with_errors(self, method: str, errors: dict[int, str]) -> None:
        """A rank raised: collect what the others say for a moment, then fail naming the
        root cause (a rank that died makes the others raise in their collectives)."""
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            if self.output.poll(50):
                _, rank, ok, result = pickle.loads(self.output.recv())
                if not ok:
                    errors[rank] = result
        first = min(errors)
        dead = self._dead_rank_reason(exclude=set(errors))     # those exit after reporting
        self._fail(f"{dead}; rank {first} then failed in {method}: {errors[first].strip().splitlines()[-1]}"
                   if dead else f"tensor-parallel worker rank {first} raised in {method}:\n{errors[first]}")

    def _dead_rank_reason(self, exclude=()) -> str | None:
        for rank, proc in enumerate(self.procs):
            if rank not in exclude and proc.poll() is not None:
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) died: {exit_reason(proc.returncode)}"
        return None

    def _fail(self, reason: str) -> None:
        self.dead_reason = reason
        for proc in self.procs:          # a broken group cannot stop gracefully (a rank may be stuck)
            if proc.poll() is None:
                proc.kill()
        self.shutdown()
        raise EngineDeadError(reason)

    def shutdown(self) -> None:
        """Ask every worker to stop, wait up to 5 s, then terminate / kill; close the
        sockets. Idempotent; later calls raise EngineDeadError."""
        if self.dead_reason is None:
            self.dead_reason = "the tensor-parallel workers were shut down"
        self._finalizer()


def _stop_workers(procs, inputs, output, ctx, folder) -> None:
    for proc, sock in zip(procs, inputs):
        if proc.poll() is None:
            try:
                sock.send(pickle.dumps((0, "shutdown", (), 0.0)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    stop_processes(procs)
    for sock in [*inputs, output]:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(folder, ignore_errors=True)


class WorkerProc:
    """A worker process's loop: take (method, args) messages, call the Worker, answer."""

    def __init__(self, worker: Worker, rank: int, input_address: str, output_address: str,
                 parent_pid: int) -> None:
        self.worker, self.rank, self.parent_pid = worker, rank, parent_pid
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_address)
        self.recv_seconds = 0.0        # from the engine's send to the unpickled message
        self.execute_seconds = 0.0     # in execute_model

    def run(self) -> None:
        """Serve until told to shut down or the engine process is gone."""
        while True:
            if not self.input.poll(1000):
                if os.getppid() != self.parent_pid:
                    return
                continue
            call_id, method, args, sent_at = pickle.loads(self.input.recv())
            if method == "shutdown":
                return
            start = time.monotonic()
            self.recv_seconds += start - sent_at
            try:
                if method == "get_comm_stats":
                    result = dict(self.worker.get_comm_stats(), recv_seconds=self.recv_seconds,
                                  execute_seconds=self.execute_seconds)
                else:
                    result = getattr(self.worker, method)(*args)
                if method in _STEP_METHODS and self.rank != 0 and result is not None:
                    result = result.sampled_token_ids     # for the check that ranks agree
                ok = True
            except BaseException:
                result, ok = traceback.format_exc(), False
            if method in _STEP_METHODS:
                self.execute_seconds += time.monotonic() - start
            self.output.send(pickle.dumps((call_id, self.rank, ok, result), protocol=pickle.HIGHEST_PROTOCOL))
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
            group = init_process_group(s["rank"], s["world_size"], s["init_method"], config.torch_device)
            worker = Worker(config, s["model_path"], ModelConfig.from_pretrained(s["model_path"]),
                            s["rank"], s["world_size"], group)
            return WorkerProc(worker, s["rank"], s["input_address"], s["output_address"], parent_pid), None

        proc = report_ready(ready_fd, start)
        try:
            proc.run()
        except BaseException:
            exit_code = 1
        proc.input.close(linger=0)
        proc.output.close(linger=1000)
        proc.ctx.term()
        exit_child(exit_code)
