"""LLMEngine: the step loop that ties scheduler, model runner and outputs together.

One call to `step()` is one forward pass over one batch (PagedAttention paper §4.5; the
step of vLLM's `LLMEngine`):

    scheduler_output = self.scheduler.schedule()              # who runs, how many tokens
    runner_output = self.model_runner.execute(scheduler_output)   # forward + sample
    return self._update(scheduler_output, runner_output)      # append, stop, free, detokenize

Requests come in with `add_request`, which checks them completely before the engine
does any work for them (a bad request raises and leaves no trace), and leave when they
finish or are aborted, at which point all their blocks go back to the pool. Observers
added with `add_observer` hear what each step does, as events (events.py).
vLLM: `vllm/engine/llm_engine.py` (v0), `vllm/v1/engine/core.py` (v1).
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Iterable

import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .events import Observer, Observers, RequestAdded, RequestFinished
from .kernels import get_attn_backend
from .llama import LlamaConfig, load_model
from .model_runner import ModelRunner, ModelRunnerOutput
from .outputs import CompletionOutput, RequestOutput
from .beam_search import BeamSearchParams, BeamState, beam_search_step
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 1 << 30          # 1 GiB, at most 25% of free memory (see config.py)


class LLMEngine:
    """The engine: add requests, call step() until none are left.

    Args:
        config: an EngineConfig (LLM builds one from its keyword arguments).
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer
        from .model_loader import resolve_model

        self.config = config
        self.model_path = resolve_model(config.model)
        self.model_config = LlamaConfig.from_pretrained(self.model_path)
        config.resolve(self.model_config.max_position_embeddings)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = load_model(self.model_path, config.torch_dtype, config.torch_device,
                           config.max_model_len)
        num_gpu_blocks = config.num_gpu_blocks or self._num_blocks_from_memory(model)
        per_block = ModelRunner.kv_cache_bytes_per_block(self.model_config, config.block_size, config.torch_dtype)
        num_cpu_blocks = (config.num_cpu_blocks if config.num_cpu_blocks is not None
                          else int(config.swap_space * (1 << 30)) // per_block)
        self.attn_backend = get_attn_backend(config.attention_backend, config.torch_device)
        self.model_runner = ModelRunner(model, num_gpu_blocks, config.block_size, config.seed,
                                        num_cpu_blocks, self.attn_backend)
        self.observers = Observers()       # shared with the block manager and the scheduler
        self.block_manager = BlockManager(num_gpu_blocks, config.block_size,
                                          config.enable_prefix_caching, num_cpu_blocks, self.observers)
        costs = self.model_runner.measure_preemption_costs() if config.preemption_mode == "auto" else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.preemption_mode, costs)
        self.eos_token_ids = frozenset(self.model_config.eos_token_id + _generation_eos(self.model_path)
                                       + ([self.tokenizer.eos_token_id]
                                          if self.tokenizer.eos_token_id is not None else []))
        self.requests: dict[str, SequenceGroup] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0     # prefill work actually done (cache hits excluded)

    def _num_blocks_from_memory(self, model) -> int:
        c = self.config
        per_block = ModelRunner.kv_cache_bytes_per_block(self.model_config, c.block_size, c.torch_dtype)
        budget = c.kv_cache_memory_bytes
        if budget is None:
            if c.torch_device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(c.torch_device)
                budget = int(free * 0.9)
            else:
                budget = min(_DEFAULT_CPU_KV_BYTES, _free_host_memory() // 4)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} is smaller than one KV block "
                             f"({per_block} bytes)")
        return num_blocks

    # -- requests in ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None) -> None:
        """Queue a request. All checks happen here, before any work is done for it.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized with the model's tokenizer) or a list of token ids.
            sampling_params: a SamplingParams (default SamplingParams()), or a
                BeamSearchParams for a beam-search request.

        Raises:
            ValueError: duplicate request_id; empty prompt; a token id outside the
                vocabulary; a prompt longer than max_model_len; a prompt needing more KV
                blocks than the whole pool. The engine is unchanged and keeps serving.
            TypeError: prompt or sampling_params of the wrong type.
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        beam = None
        if isinstance(params, BeamSearchParams):     # beams are n greedy-scored sequences
            beam = BeamState(params)
            params = SamplingParams(n=params.beam_width, temperature=0, max_tokens=params.max_tokens,
                                    ignore_eos=params.ignore_eos)
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams or BeamSearchParams, "
                            f"got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)

        seqs = [Sequence(next(self._seq_ids), prompt_ids, self.config.block_size,
                         self._generator(params.seed, i)) for i in range(params.n)]
        group = SequenceGroup(request_id, prompt_text, seqs, params)
        group.beam_state = beam
        for seq in seqs:
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        self.requests[request_id] = group
        self.scheduler.add_seq_group(group)
        if self.observers:
            self.observers.publish(RequestAdded(request_id, tuple(s.seq_id for s in seqs), len(prompt_ids)))

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        """A seeded request's i-th sequence draws from its own stream: the first from
        `seed` itself, the others from seeds derived from (seed, i), so the n samples
        differ and a rerun repeats them."""
        if seed is None:
            return None
        seed = seed if index == 0 else hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF
        return torch.Generator(device=self.config.torch_device).manual_seed(seed)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty (''): there is no token to start from")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            return None, list(prompt)
        raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty (0 token ids): there is no token to start from")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than "
                             f"max_model_len={self.config.max_model_len}")
        bs, pool = self.config.block_size, self.block_manager.num_gpu_blocks
        need = -(-len(ids) // bs)
        if need > pool:
            raise ValueError(f"prompt of {len(ids)} tokens needs {need} KV blocks of {bs} tokens, "
                             f"but the KV cache holds only {pool} blocks ({pool * bs} tokens)")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop request(s) wherever they are and free their blocks. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.scheduler.abort_seq_group(rid) is not None:
                self._forget(self.requests.pop(rid))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + len(self.scheduler.swapped)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward step. Returns a RequestOutput for every request
        that was scheduled or finished in it (text and tokens so far)."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute(scheduler_output)
        self.num_steps += 1
        return self._update(scheduler_output, runner_output)

    def _update(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Advance num_computed_tokens, append sampled tokens, check stop conditions,
        free what finished, and build the outputs."""
        touched: dict[str, SequenceGroup] = {}
        sampled = runner_output.sampled_token_ids
        for s in scheduler_output.scheduled:
            group = s.seq_group
            touched[group.request_id] = group
            start = s.seq.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(start + s.num_new_tokens, len(s.seq.prompt_token_ids)) - start)
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.forks and s.seq.seq_id in sampled:       # prefill done: the n - 1 others fork it
                for fork in s.forks:
                    self.block_manager.fork(s.seq, fork)
            for seq in [s.seq, *s.forks]:
                token = sampled.get(seq.seq_id)
                if token is None or group.beam_state is not None:
                    continue              # beams are extended below, all at once
                seq.append_token(token)
                seq.output_text += self._detokenizers[seq.seq_id].step(token)
                self.num_generated_tokens += 1
                self._check_stop(seq, group.sampling_params)
                if seq.status.is_finished:
                    self.block_manager.free(seq)      # its siblings may run on
        for group in scheduler_output.finished_without_running:
            touched[group.request_id] = group
        for group in touched.values():
            if group.beam_state is not None and not group.is_finished():
                self._beam_step(group, runner_output)

        outputs = []
        for rid, group in touched.items():
            finished = group.is_finished()
            if finished:
                self.scheduler.finish_seq_group(group)
                self._forget(self.requests.pop(rid))
            outputs.append(_make_output(group, finished))
        return outputs

    def _beam_step(self, group: SequenceGroup, runner_output: ModelRunnerOutput) -> None:
        """Extend a beam-search request by one token per beam (beam_search.py)."""
        beams = group.get_seqs(SequenceStatus.RUNNING)
        if not all(b.seq_id in runner_output.beam_candidates for b in beams):
            return                       # not sampled this step (e.g. mid-recompute)
        beam_search_step(group, runner_output.beam_candidates, self.eos_token_ids,
                         self.config.max_model_len, self.block_manager.fork)
        self.num_generated_tokens += len(beams)
        if group.beam_state.done:
            for seq in beams:
                seq.status = SequenceStatus.FINISHED_STOPPED
                self.block_manager.free(seq)
            for hyp in group.beam_state.finished:
                hyp.text = self.tokenizer.decode(hyp.tokens[len(group.prompt_token_ids):],
                                                 skip_special_tokens=True)

    def _check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        """vLLM's order: EOS (unless ignore_eos), stop token ids, max_tokens, max_model_len."""
        token = seq.output_token_ids[-1]
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            # max_model_len rule (vLLM's): stop once prompt + output reach it; a prompt of
            # exactly max_model_len tokens therefore still gets its one token.
            seq.status = SequenceStatus.FINISHED_LENGTH

    def _forget(self, group: SequenceGroup) -> None:
        """A request has left (finished or aborted, its blocks freed)."""
        for seq in group.seqs:
            self._detokenizers.pop(seq.seq_id, None)
        if self.observers:
            self.observers.publish(RequestFinished(group.request_id,
                                                   tuple(s.status.finish_reason for s in group.seqs)))

    def add_observer(self, observer: Observer) -> None:
        """Call observer(event) for every event from now on (events.py lists them). Events
        are published synchronously, in the order things happen, from inside add_request,
        step and abort_request; an observer must not change the engine.
        Raises TypeError if observer is not callable."""
        if not callable(observer):
            raise TypeError(f"observer must be callable (it is called with each event), got {observer!r}")
        self.observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        """Stop calling observer. Raises ValueError if it was not added."""
        self.observers.remove(observer)

    def get_stats(self) -> dict[str, int]:
        """Counters for monitoring and tests: pool occupancy, queue sizes, work done."""
        return {
            "num_total_gpu_blocks": self.block_manager.num_gpu_blocks,
            "num_free_gpu_blocks": self.block_manager.get_num_free_gpu_blocks(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_preemptions_swap": self.scheduler.num_preemptions_swap,
            "num_preemptions_recompute": self.scheduler.num_preemptions_recompute,
            "num_total_cpu_blocks": self.block_manager.num_cpu_blocks,
            "num_free_cpu_blocks": self.block_manager.get_num_free_cpu_blocks(),
            "num_swapped": len(self.scheduler.swapped),
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "prefix_cache_queries": self.block_manager.prefix_cache_queries,
            "prefix_cache_hits": self.block_manager.prefix_cache_hits,
            "num_copy_on_write": self.block_manager.num_copy_on_write,
        }


def _make_output(group: SequenceGroup, finished: bool) -> RequestOutput:
    if group.beam_state is not None and group.beam_state.done:     # best hypotheses first
        n = len(group.prompt_token_ids)
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=[CompletionOutput(index=i, text=h.text, token_ids=h.tokens[n:],
                                      finish_reason=h.finish_reason, cumulative_logprob=h.cum_logprob)
                     for i, h in enumerate(group.beam_state.finished)],
            finished=finished)
    return RequestOutput(
        request_id=group.request_id, prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=[CompletionOutput(index=i, text=seq.output_text,
                                  token_ids=list(seq.output_token_ids),
                                  finish_reason=seq.status.finish_reason)
                 for i, seq in enumerate(group.seqs)],
        finished=finished)


def _generation_eos(folder) -> list[int]:
    """EOS ids from generation_config.json, which may list more than config.json."""
    import json
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _free_host_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (8 GiB if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
