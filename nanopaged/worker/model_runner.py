"""ModelRunner: carry out one SchedulerOutput: tensors in, tokens (and logprobs) out.

The runner decides nothing and never sees the scheduler's Sequence objects: it learns
every sequence from the messages (messages.py) and keeps its own record in an
InputBatch (input_batch.py). Each step it updates that record (`_update_states`),
moves KV blocks (`_move_blocks`), flattens the scheduled tokens into one batch
(`prepare_inputs`), runs the model, and samples the last row of each sequence whose
tokens are all computed (`_sample`), in chunks of at most max_logits_bytes of fp32
logits (logits_chunks.py).

Later features subclass it in files of their own and override the hooks
(`_token_ids`, `_sampled_rows`, `prepare_inputs`, `_move_blocks`, `_forward`,
`_after_forward`, `_sample_step`, `_sample`, `_compute_logits`, `_after_sample`,
`_profile_forward`); features.py composes the class.

It owns the KV cache, zero-filled once (padded block-table entries are read, then
masked, and 0 * NaN would still be NaN):
    kv_cache: [num_layers, 2 (K, V), num_gpu_blocks, block_size, num_kv_heads, head_size]
with num_kv_heads this rank's share under tensor parallelism (worker.py) and num_layers
the layers whose K/V it caches (model.num_kv_cache_layers: all of them here).

vLLM: `vllm/v1/worker/gpu_model_runner.py`.
"""
from __future__ import annotations

import time

import torch

from ..messages import Logprobs, ModelRunnerOutput, PreemptionCosts, SchedulerOutput
from ..model.llama import LlamaForCausalLM
from ..layers.attention import AttentionMetadata
from ..layers.backends import TorchOps
from ..utils.math_utils import cdiv
from .input_batch import InputBatch, SeqState
from .logits_chunks import chunked_logprobs, compute_logits_rows, max_logits_rows, row_chunks
from .model_input import ModelInput
from .sampler import Sampler


def move_blocks(ops: TorchOps, device_cache: torch.Tensor, cpu_cache: torch.Tensor, so: SchedulerOutput) -> None:
    """The step's swaps and copies on one pair of pools, swap-outs first (their device
    blocks may be reused by the swap-ins and copies)."""
    if so.blocks_to_swap_out:
        ops.swap_blocks(device_cache, cpu_cache, so.blocks_to_swap_out)
    if so.blocks_to_swap_in:
        ops.swap_blocks(cpu_cache, device_cache, so.blocks_to_swap_in)
    if so.blocks_to_copy:
        ops.copy_blocks(device_cache, so.blocks_to_copy)


class ModelRunner:
    """Owns the model, the KV cache and the per-sequence record; executes SchedulerOutputs.

    Args:
        config: the EngineConfig (block_size, seed, max_logits_bytes: the most bytes of
            fp32 logits held at once, None = no bound).
        model: a loaded model (LlamaForCausalLM or a family built on it).
        num_gpu_blocks, num_cpu_blocks: blocks in the device pool and the CPU swap pool.
        ops: the kernels (layers/backends.py); None = the PyTorch reference.
    """

    runner_output_cls = ModelRunnerOutput    # a feature that adds fields to the step's output subclasses it
    model_input_cls = ModelInput             # and to the step's input, this

    def __init__(self, config, model: LlamaForCausalLM, *, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 ops: TorchOps | None = None) -> None:
        c = model.config
        self.config, self.model = config, model
        self.ops = ops or TorchOps()
        model.set_ops(self.ops)
        self.block_size = bs = config.cache_config.block_size
        weight = next(model.parameters())          # where the weights live, in their dtype
        self.device, self.dtype = weight.device, weight.dtype
        shape = (model.num_kv_cache_layers, 2, num_gpu_blocks, bs, model.num_local_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # host memory (pinned on CUDA for fast copies); never read where not written
        self.cpu_kv_cache = torch.empty((*shape[:2], num_cpu_blocks, *shape[3:]), dtype=self.dtype,
                                        pin_memory=self.device.type == "cuda")
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)   # rows without a seed
        self.input_batch = InputBatch(c.vocab_size, self.device)
        self.max_logits_rows = max_logits_rows(config.scheduler_config.max_logits_bytes, c.vocab_size)   # per chunk; None: all

    @staticmethod
    def kv_cache_bytes_per_block(model_config, block_size: int, dtype: torch.dtype,
                                 num_kv_heads: int | None = None, num_layers: int | None = None) -> int:
        """Bytes of one block, K and V, of num_kv_heads heads (default: all) in
        num_layers layers (default: all; the Worker passes model.num_kv_cache_layers)."""
        num_kv_heads = model_config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        num_layers = model_config.num_hidden_layers if num_layers is None else num_layers
        return (2 * num_layers * block_size * num_kv_heads
                * model_config.head_dim * torch.empty((), dtype=dtype).element_size())

    # -- the runner's own record --------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's message to the record: forget so.finished_seq_ids, learn
        so.scheduled_new_reqs in full, apply so.scheduled_cached_reqs' deltas (drop the
        num_blocks_taken_back trailing blocks, then append the new block ids, or take
        them as the whole table when block_ids_replaced; new tokens; num_computed_tokens)."""
        for seq_id in so.finished_seq_ids:
            self.input_batch.remove_sequence(seq_id)
        for new in so.scheduled_new_reqs:
            self.input_batch.add_sequence(new)
        c = so.scheduled_cached_reqs
        appended_seqs, appended_tokens = [], []
        for seq_id, tokens, blocks, replaced, computed in zip(c.seq_ids, c.new_token_ids, c.new_block_ids,
                                                              c.block_ids_replaced, c.num_computed_tokens):
            state = self.input_batch.seqs[seq_id]
            if replaced:
                state.block_ids = list(blocks)
            else:
                taken = so.num_blocks_taken_back.get(seq_id, 0)     # blocks the scheduler freed
                del state.block_ids[len(state.block_ids) - taken:]
                state.block_ids.extend(blocks)
            state.num_computed_tokens = computed
            appended_seqs += [seq_id] * len(tokens)
            appended_tokens += tokens
        if appended_tokens:
            self.input_batch.append_output_tokens(appended_seqs, appended_tokens)

    # -- one step -------------------------------------------------------------------------------

    def prepare_inputs(self, so: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled sequences into one batch, decodes first."""
        scheduled = [(self.input_batch.seqs[i], n) for i, n in so.num_scheduled_tokens.items() if n > 0]
        # A decode computes one *output* token; a prompt's last token (left after a prefix
        # hit) is prefill, the path the same prompt takes without the hit, so both give
        # the same bits (tests/model/test_c36_bf16_prefix_hit.py).
        is_decode = [n == 1 and s.num_computed_tokens >= len(s.prompt_token_ids) for s, n in scheduled]
        order = sorted(range(len(scheduled)), key=lambda i: not is_decode[i])
        scheduled, num_decodes = [scheduled[i] for i in order], sum(is_decode)
        forks_of: dict[int, list[int]] = {}
        for fork, parent in so.sample_from.items():
            forks_of.setdefault(parent, []).append(fork)
        input_ids, positions, seq_lens, query_start_loc = [], [], [], [0]
        logits_indices, sampled_seq_ids, prompt_rows = [], [], {}
        for state, n in scheduled:
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            input_ids += self._token_ids(so, state, start, end)
            positions += range(start, end)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + n)
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                # hidden row of position p predicts the prompt token at p + 1
                prompt_rows[state.seq_id] = (query_start_loc[-2], min(end, num_prompt - 1) - start, start)
            for seq_id, row in self._sampled_rows(so, state, end, query_start_loc[-1],
                                                  forks_of.get(state.seq_id, [])):
                sampled_seq_ids.append(seq_id)
                logits_indices.append(row)
        max_blocks = max(len(s.block_ids) for s, _ in scheduled)
        block_tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s, _ in scheduled]

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        pos, tables = t(positions), t(block_tables)
        # slot of each token = its block's id * block_size + offset (vLLM's slot_mapping)
        seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled), device=self.device),
                                               t([n for _, n in scheduled]))
        slot_mapping = tables[seq_of_token, pos // self.block_size] * self.block_size + pos % self.block_size
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=tables, seq_lens=t(seq_lens),
            query_start_loc=t(query_start_loc), num_decodes=num_decodes,
            seq_lens_list=seq_lens, query_start_loc_list=query_start_loc)
        return self.model_input_cls(input_ids=t(input_ids), positions=pos, attn_metadata=meta,
                                    logits_indices=t(logits_indices), sampled_seq_ids=sampled_seq_ids,
                                    prompt_logprob_rows=prompt_rows, seq_ids=[s.seq_id for s, _ in scheduled])

    def _token_ids(self, so: SchedulerOutput, state: SeqState, start: int, end: int) -> list[int]:
        """The ids of the tokens `state` computes this step, positions [start, end)."""
        return state.token_ids(start, end)

    def _sampled_rows(self, so: SchedulerOutput, state: SeqState, end: int, next_row: int,
                      forks: list[int]) -> list[tuple[int, int]]:
        """(seq_id, hidden row) pairs sampled from `state`'s rows: its last row once its
        tokens are all computed, for itself and its `forks` (so.sample_from). next_row:
        the row after its own."""
        if end != state.num_tokens:
            return []
        return [(seq_id, next_row - 1) for seq_id in [state.seq_id, *forks]]

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Update the record, move blocks, run the forward pass, sample."""
        self._update_states(so)
        self._move_blocks(so)
        if so.is_empty:
            return self.runner_output_cls()
        inp = self.prepare_inputs(so)
        return self._after_forward(so, inp, self._forward(inp))

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        """The model's forward pass: hidden states [num_tokens, hidden_size]."""
        return self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata)

    def _after_forward(self, so: SchedulerOutput, inp: ModelInput, hidden: torch.Tensor) -> ModelRunnerOutput | None:
        """Prompt logprobs, then sample (`_sample_step`): the step's output."""
        out = self.runner_output_cls(prompt_logprobs=self._prompt_logprobs(hidden, inp))
        if not inp.sampled_seq_ids:
            return out
        return self._sample_step(so, inp, hidden, out)

    def _move_blocks(self, so: SchedulerOutput) -> None:
        """Swap out, swap in and copy (copy-on-write) the KV blocks the scheduler asks for."""
        move_blocks(self.ops, self.kv_cache, self.cpu_kv_cache, so)

    def _sample_step(self, so: SchedulerOutput, inp: ModelInput, hidden: torch.Tensor,
                     out: ModelRunnerOutput) -> ModelRunnerOutput | None:
        """Sample the step's rows into `out`, then `_after_sample`; returns `out`."""
        self._sample(inp, hidden, out)
        self._after_sample(inp, out)
        return out

    def _sample(self, inp: ModelInput, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Sample every row of inp (one per sequence and fork)."""
        self._sample_rows(inp, hidden, out, list(range(len(inp.sampled_seq_ids))))

    def _sample_rows(self, inp: ModelInput, hidden: torch.Tensor, out: ModelRunnerOutput, rows: list[int]) -> None:
        """Sample `rows` (indices into inp.sampled_seq_ids), chunk by chunk, into out's
        sampled_token_ids and logprobs."""
        for chunk in row_chunks(rows, self.max_logits_rows):
            seq_ids = [inp.sampled_seq_ids[i] for i in chunk]
            logits = self._compute_logits(hidden, inp, chunk)                   # [rows, vocab] fp32
            sampled = self.sampler(logits, self.input_batch.make_sampling_metadata(seq_ids), self.generator)
            out.sampled_token_ids.update(zip(seq_ids, sampled.sampled_token_ids.tolist()))
            out.logprobs.update((i, lp) for i, lp in zip(seq_ids, sampled.logprobs) if lp is not None)

    def _compute_logits(self, hidden: torch.Tensor, inp: ModelInput, rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(rows), vocab] of the sampled rows `rows`."""
        return compute_logits_rows(self.model, hidden, inp.logits_indices, rows)

    def _after_sample(self, inp: ModelInput, out: ModelRunnerOutput) -> None:
        """Called once the step's tokens are in `out`; nothing to do here."""

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: ModelInput) -> dict[int, Logprobs]:
        """Logprobs (raw, fp32) of the prompt tokens this step's hidden rows predict."""
        result = {}
        for seq_id, (row, count, start) in inp.prompt_logprob_rows.items():
            state = self.input_batch.seqs[seq_id]
            result[seq_id] = chunked_logprobs(self.model, hidden[row:row + count],
                                              state.prompt_token_ids[start + 1:start + 1 + count],
                                              state.sampling_params.prompt_logprobs, self.max_logits_rows)
        return result

    # -- start-up measurement ------------------------------------------------------------------

    def measure_preemption_costs(self) -> PreemptionCosts:
        """Seconds per block of a swap, and per token of a short prefill (once, at start)."""
        num_blocks = self.kv_cache.shape[2]
        n = max(1, min(8, num_blocks, self.cpu_kv_cache.shape[2]))
        pairs = [(i, i) for i in range(n)]
        if self.cpu_kv_cache.shape[2]:
            self.ops.swap_blocks(self.kv_cache, self.cpu_kv_cache, pairs)           # warm-up
            start = time.perf_counter()
            self.ops.swap_blocks(self.kv_cache, self.cpu_kv_cache, pairs)
            self.ops.swap_blocks(self.cpu_kv_cache, self.kv_cache, pairs)
            per_block = (time.perf_counter() - start) / (2 * n)
        else:
            per_block = float("inf")
        tokens = min(64, num_blocks * self.block_size, self.model.rope_cos.shape[0])   # <= max_model_len
        ids = torch.arange(tokens, device=self.device)
        blocks = ids[: cdiv(tokens, self.block_size)]
        meta = AttentionMetadata(slot_mapping=ids, block_tables=blocks[None], seq_lens=ids[-1:] + 1,
                                 query_start_loc=torch.tensor([0, tokens], device=self.device),
                                 num_decodes=int(tokens == 1), seq_lens_list=[tokens],
                                 query_start_loc_list=[0, tokens])
        with torch.inference_mode():
            for timed in (False, True):                                          # warm-up, then time
                start = time.perf_counter()
                self._profile_forward(ids % self.model.config.vocab_size, ids, meta)
            per_token = (time.perf_counter() - start) / tokens
            self.kv_cache[:, :, :max(n, len(blocks))].zero_()   # back to the zero state
        return PreemptionCosts(per_block, per_token)

    def _profile_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """One forward pass of `input_ids` for measure_preemption_costs."""
        self.model(input_ids, positions, self.kv_cache, meta)
