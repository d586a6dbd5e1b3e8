"""EngineCore: the engine's inner loop, tokens in and tokens out.

It owns the scheduler (with the block manager) and the executor (the workers, each
with its model runner: one in this process, or one process per tensor-parallel rank),
and nothing else: no tokenizer, no strings (one exception: structured outputs, whose
StructuredOutputManager needs each token's bytes to build its masks, so it loads the
tokenizer on the first constrained request, as vLLM's does; chapter 18). One `step()`
is one forward pass over one batch (the PagedAttention paper §4.5; vLLM v1's
`EngineCore.step`):

    scheduler_output = self.scheduler.schedule()                    # who runs, which blocks
    runner_output = self.executor.execute_model(scheduler_output)   # copy, forward, sample
    return self.scheduler.update_from_output(scheduler_output, runner_output)   # append, stop, free

(a step with structured outputs samples in a second call, sample_tokens, with the token
masks the scheduler made meanwhile).

With `async_scheduling` (vLLM v1's `EngineCore.step_with_batch_queue`) the forward runs
in a worker thread, and `step()` schedules the next step while it does (torch releases
the GIL in its ops, so the two really run at once):

    ahead = self.scheduler.schedule()               # step t+1, while t's forward runs
    runner_output = <wait for step t's forward>
    <start step t+1's forward>
    return self.scheduler.update_from_output(<step t>, runner_output)   # t+1 runs meanwhile

so step() returns the outputs of the step before (nothing on the first call). When step
t decides something step t+1's schedule depends on (Scheduler.can_schedule_ahead), t+1
is scheduled after t's output instead. chapters/16-async-scheduling.md tells the story.

Everything that enters or leaves is a message of messages.py (EngineCoreRequest in,
EngineCoreOutputs out), so the core can run in a process of its own behind a client,
as vLLM's EngineCoreProc does (engine_core_client.py).
vLLM: `vllm/v1/engine/core.py`.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..core.structured_output import StructuredOutputManager
from ..model.config import ModelConfig
from ..worker.executor import Executor
from ..layers.backends import get_ops
from ..worker.model_runner import ModelRunner
from ..config import EngineConfig
from ..events import Observers
from ..messages import EngineCoreOutputs, EngineCoreRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A step whose forward was handed to the worker thread (async scheduling)."""

    scheduler_output: SchedulerOutput
    future: Future                   # of execute_model: a ModelRunnerOutput, or None
    sampling: Future | None = None   # of sample_tokens, for a step with structured outputs

    def result(self):
        """Wait for the step's ModelRunnerOutput; raises what its forward raised."""
        output = self.future.result()
        return output if output is not None else self.sampling.result()


class EngineCore:
    """Scheduler + block manager + model runner.

    Args:
        config: a resolved EngineConfig (arg_utils.create_engine_config: the model
            checked to split over tensor_parallel_size, every None filled in).
        model_path: the local Hugging Face folder of the model.
        model_config: its ModelConfig.
        observers: where the scheduler and block manager publish events (events.py).
    """

    def __init__(self, config: EngineConfig, model_path, model_config: ModelConfig,
                 observers: Observers | None = None) -> None:
        self.config = config
        self.attn_backend = get_ops(config.attention_backend, config.torch_device)
        # the workers load their weights first; only then is the KV pool sized
        self.executor = Executor.create(config, model_path, model_config, self.attn_backend)
        try:
            num_gpu_blocks, num_cpu_blocks = self._initialize_kv_caches()
        except BaseException:
            self.executor.shutdown()
            raise
        self.observers = Observers() if observers is None else observers
        self.block_manager = BlockManager(num_gpu_blocks, config.block_size, config.enable_prefix_caching,
                                          num_cpu_blocks, self.observers)
        costs = self.executor.measure_preemption_costs() if config.preemption_mode == "auto" else None
        self.structured_output_manager = StructuredOutputManager(model_path, model_config.vocab_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.enable_chunked_prefill,
                                   config.preemption_mode, costs, config.async_scheduling,
                                   self.structured_output_manager, config.speculative_config)
        sc = config.speculative_config
        if sc is not None:
            how = (f"n-gram lookup of {sc.prompt_lookup_min}..{sc.prompt_lookup_max} tokens" if sc.method == "ngram"
                   else f"draft model {sc.model}")
            logger.info("speculative decoding: %d draft tokens a step, %s", sc.num_speculative_tokens, how)
        self.num_steps = 0
        self.start_time = time.monotonic()        # the dashboard's clock starts here
        # async scheduling: one worker thread runs the forwards, in the order given
        self._forward_thread = (ThreadPoolExecutor(1, thread_name_prefix="nanopaged-forward")
                          if config.async_scheduling else None)
        self._in_flight: _InFlight | None = None

    @property
    def model_runner(self) -> ModelRunner:
        """The ModelRunner, when it lives in this process (tensor_parallel_size 1 or
        torchrun). Raises AttributeError when the runners are in worker processes."""
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise AttributeError("the model runners live in the worker processes "
                                 f"(tensor_parallel_size={self.config.tensor_parallel_size}, 'mp')")
        return worker.model_runner

    def shutdown(self) -> None:
        """Stop the executor's workers (idempotent); the core cannot step afterwards."""
        self.executor.shutdown()

    def _initialize_kv_caches(self) -> tuple[int, int]:
        """Size the KV pools and have every worker allocate them; returns
        (num_gpu_blocks, num_cpu_blocks) per rank (vLLM v1's
        EngineCore._initialize_kv_caches). The workers have their weights loaded by now,
        so the memory they report is what is really left: config.num_gpu_blocks when
        set, else the smallest number of blocks any rank's memory holds (a rank's block
        holds its own KV heads only: Worker.kv_cache_bytes_per_block). The swap pool:
        config.num_cpu_blocks, else swap_space GiB of blocks.

        Raises:
            ValueError: a rank's memory holds not even one block.
        """
        c = self.config
        per_block = self.executor.collective_rpc("kv_cache_bytes_per_block")     # per rank
        num_gpu_blocks = c.num_gpu_blocks
        if num_gpu_blocks is None:
            available = self.executor.determine_available_memory()
            num_gpu_blocks = min(budget // size for budget, size in zip(available, per_block))
            if num_gpu_blocks < 1:
                raise ValueError(f"the memory for the KV cache ({min(available)} bytes: kv_cache_memory_bytes, "
                                 f"or what the weights left) is smaller than one KV block ({max(per_block)} bytes)")
        num_cpu_blocks = (c.num_cpu_blocks if c.num_cpu_blocks is not None
                          else min(int(c.swap_space * (1 << 30)) // size for size in per_block))
        self.executor.initialize_kv_cache(num_gpu_blocks, num_cpu_blocks)
        kernel = {"torch": "the PyTorch reference", "cpu": "the C++ CPU kernel", "cuda": "the CUDA kernel"}
        size = num_gpu_blocks * per_block[0]
        unit = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if size >= s or u == "KiB")
        logger.info("KV cache: %d blocks of %d tokens (%.1f %s%s), swap pool %d blocks; dtype %s, attention: %s",
                    num_gpu_blocks, c.block_size, size / unit[1], unit[0], " per rank" if len(per_block) > 1 else "",
                    num_cpu_blocks, c.dtype, kernel.get(self.attn_backend.name, self.attn_backend.name))
        return num_gpu_blocks, num_cpu_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (request_id in use, or a prompt that needs
        more KV blocks than the whole pool); the core is then unchanged."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        """Stop requests wherever they are and free their blocks. Unknown ids are ignored."""
        self.scheduler.abort_requests(list(request_ids))

    def stop_sequences(self, seqs: list[tuple[str, int]]) -> None:
        """Finish (request_id, index) sequences whose stop string matched."""
        self.scheduler.stop_sequences(seqs)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or (async scheduling) a forward is in flight."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, take in its output (see the module doc). With
        async_scheduling, the outputs are those of the forward before (empty on the
        first call). An exception in the forward propagates from here, and the engine
        stays usable (with async scheduling: Scheduler.reset_after_failure)."""
        if self._forward_thread is not None:
            return self._step_async()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        if runner_output is None:            # structured outputs: sample with their masks
            runner_output = self.executor.sample_tokens(self.scheduler.get_grammar_bitmask(scheduler_output))
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_async(self) -> EngineCoreOutputs:
        prev, self._in_flight = self._in_flight, None
        ahead = None
        try:
            if (prev is None or self.scheduler.can_schedule_ahead()) and self.scheduler.has_unfinished_requests():
                ahead = self.scheduler.schedule()      # overlaps prev's forward
            if prev is None:
                self._in_flight = self._submit(ahead)
                self._submit_sampling(self._in_flight)
                return EngineCoreOutputs()
            runner_output = prev.result()
        except BaseException:                          # the forward raised, or Ctrl-C here
            if prev is not None:
                self._recover(prev, ahead)
            raise
        if ahead is not None and ahead.is_empty and not (ahead.blocks_to_copy or ahead.blocks_to_swap_out
                                                         or ahead.blocks_to_swap_in):
            # nothing to compute (say every sequence is getting its last token now):
            # the worker is idle, so the runner forgets what finished here, and no
            # empty forward is left in flight
            self.executor.execute_model(ahead)
            ahead = None
        # Start ahead's forward before taking in prev's output, so that the update and
        # the caller's detokenizing overlap it. It comes only now, after prev succeeded:
        # the runner feeds ahead's decodes with the tokens prev sampled.
        self._in_flight = self._submit(ahead)
        try:
            outputs = self.scheduler.update_from_output(prev.scheduler_output, runner_output)
        finally:
            # ahead's constrained rows: their masks need prev's tokens, which the
            # matchers have just read; filled while ahead's forward runs, then its
            # sampling is queued behind the forward (vLLM v1 does the same)
            self._submit_sampling(self._in_flight)
        self.num_steps += 1
        if ahead is None and self.scheduler.has_unfinished_requests():
            # prev decided what this step depends on: scheduled after its output (the
            # fallback of Scheduler.can_schedule_ahead); its forward still overlaps
            # the caller's work on these outputs
            self._in_flight = self._submit(self.scheduler.schedule())
            self._submit_sampling(self._in_flight)
        return outputs

    def _submit(self, scheduler_output: SchedulerOutput | None) -> _InFlight | None:
        if scheduler_output is None:
            return None
        return _InFlight(scheduler_output, self._forward_thread.submit(self.executor.execute_model, scheduler_output))

    def _submit_sampling(self, step: _InFlight | None) -> None:
        """Queue the second half of a step with structured-output rows (sample_tokens),
        with masks from the matchers as they are now. The one forward thread runs it
        after the step's forward."""
        if step is None or not step.scheduler_output.structured_output_seq_ids or step.sampling is not None:
            return
        try:
            grammar = self.scheduler.get_grammar_bitmask(step.scheduler_output)
        except BaseException as e:         # the step then fails as a forward would
            step.sampling = Future()
            step.sampling.set_exception(e)
            return
        step.sampling = self._forward_thread.submit(self.executor.sample_tokens, grammar)

    def _recover(self, failed: _InFlight, ahead: SchedulerOutput | None) -> None:
        """The forward of `failed` raised (or the wait for it was interrupted): wait
        until the worker is idle, carry out what `ahead` (never run) asked besides its
        forward (block copies and swaps, forgetting finished sequences), then send the
        requests of both steps back to the waiting queue (Scheduler.reset_after_failure)."""
        wait([f for f in (failed.future, failed.sampling) if f is not None])
        if ahead is not None and getattr(self.executor, "dead_reason", None) is None:
            self.executor.execute_model(SchedulerOutput(
                blocks_to_copy=ahead.blocks_to_copy, blocks_to_swap_out=ahead.blocks_to_swap_out,
                blocks_to_swap_in=ahead.blocks_to_swap_in, finished_seq_ids=ahead.finished_seq_ids))
        self.scheduler.reset_after_failure([failed.scheduler_output] + ([ahead] if ahead else []))

    def get_stats(self) -> dict[str, int | float]:
        """Counters for monitoring and tests: pool occupancy, queue sizes, work done,
        and speculative decoding's drafts (acceptance rate: accepted / drafted, 0..1)."""
        bm, s = self.block_manager, self.scheduler
        return {
            "num_total_gpu_blocks": bm.num_gpu_blocks,
            "num_free_gpu_blocks": bm.get_num_free_gpu_blocks(),
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_preemptions": s.num_preemptions,
            "num_preemptions_swap": s.num_preemptions_swap,
            "num_preemptions_recompute": s.num_preemptions_recompute,
            "num_total_cpu_blocks": bm.num_cpu_blocks,
            "num_free_cpu_blocks": bm.get_num_free_cpu_blocks(),
            "num_swapped": len(s.swapped),
            "num_steps": self.num_steps,
            "num_generated_tokens": s.num_generated_tokens,
            "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_copy_on_write": bm.num_copy_on_write,
            # speculative decoding (vLLM's spec_decode_* metrics); 0 when it is off
            "spec_decode_num_drafts": s.spec_decoding_stats.num_drafts,
            "spec_decode_num_draft_tokens": s.spec_decoding_stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.spec_decoding_stats.num_accepted_tokens,
            "spec_decode_acceptance_rate": s.spec_decoding_stats.acceptance_rate,
        }
