"""ModelRunner: carry out one SchedulerOutput: tensors in, a token per sequence out.

The runner makes no decisions. Given the scheduler's batch it:

1. copies KV blocks if asked (copy-on-write, later swap),
2. builds the flat model input (`prepare_inputs`): for every scheduled sequence, the
   ids and positions of the tokens it computes this step, the KV slot each one writes
   (`slot_mapping`), its block table and its context length (`seq_lens`),
3. runs the model over all those tokens at once,
4. takes the hidden state of each sequence's last token, computes logits only there, and
   samples.

It also owns the KV cache itself: one tensor
    kv_cache: [num_layers, 2 (K, V), num_gpu_blocks, block_size, num_kv_heads, head_dim]
zero-filled once at start (zeros, not garbage: padded block-table entries are read and
then masked, and 0 * NaN would still be NaN).

vLLM: `vllm/worker/model_runner.py` (v0), `vllm/v1/worker/gpu_model_runner.py` (v1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import AttentionMetadata
from .kernels import TorchBackend
from .llama import LlamaForCausalLM
from .sampler import Sampler, SamplingMetadata
from .scheduler import PreemptionCosts, SchedulerOutput


@dataclass
class ModelInput:
    """The tensors of one forward pass.

    Attributes:
        input_ids: [num_tokens] int64, the new tokens of all sequences, end to end.
        positions: [num_tokens] int64, each token's position in its sequence.
        attn_metadata: slot_mapping, block_tables, seq_lens, query_start_loc.
        logits_indices: [num_sampled] int64, rows of the hidden states to sample from
            (the last new token of each sequence whose prompt is now fully computed).
        sampled_seq_ids: seq_id of each of those rows.
        sampling_metadata: per-row sampling settings.
        beam_rows, beam_ks: rows of beam-search sequences and how many top tokens each wants.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_seq_ids: list[int]
    sampling_metadata: SamplingMetadata
    beam_rows: list[int] = field(default_factory=list)
    beam_ks: list[int] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """sampled_token_ids[seq_id] = the token sampled for that sequence this step;
    beam_candidates[seq_id] = (logprobs, token ids) of its 2 * beam_width best next
    tokens, for the sequences of beam-search requests."""

    sampled_token_ids: dict[int, int]
    beam_candidates: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model and the KV cache; executes SchedulerOutputs.

    Args:
        model: a loaded LlamaForCausalLM.
        num_gpu_blocks, block_size: the KV pool's shape (as the BlockManager's).
        seed: seed of the generator for requests without their own seed.
        num_cpu_blocks: blocks in the CPU swap pool.
        attn_backend: the attention backend (kernels.py); None = the PyTorch reference.
    """

    def __init__(self, model: LlamaForCausalLM, num_gpu_blocks: int, block_size: int,
                 seed: int = 0, num_cpu_blocks: int = 0, attn_backend: TorchBackend | None = None) -> None:
        c = model.config
        self.model = model
        self.attn_backend = attn_backend or TorchBackend()
        model.set_attention_backend(self.attn_backend)
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.kv_cache = torch.zeros(c.num_hidden_layers, 2, num_gpu_blocks, block_size,
                                    c.num_key_value_heads, c.head_dim, dtype=self.dtype,
                                    device=self.device)
        # The swap pool: host memory (pinned on CUDA for fast copies). Never read where
        # it was not written, so it needs no zeroing.
        self.cpu_kv_cache = torch.empty((c.num_hidden_layers, 2, num_cpu_blocks, block_size,
                                         c.num_key_value_heads, c.head_dim), dtype=self.dtype,
                                        pin_memory=self.device.type == "cuda")
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def kv_cache_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        return (2 * model_config.num_hidden_layers * block_size * model_config.num_key_value_heads
                * model_config.head_dim * torch.empty((), dtype=dtype).element_size())

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled sequences into one batch (decode sequences first)."""
        # Decode rows first so attention can batch them in one call (see attention.py).
        batch = sorted(scheduler_output.scheduled, key=lambda s: s.num_new_tokens > 1)
        input_ids, positions, slot_mapping, seq_lens, query_start_loc = [], [], [], [], [0]
        logits_indices, sampled_seq_ids, params, generators = [], [], [], []
        beam_rows, beam_ks = [], []
        for s in batch:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            if s.num_new_tokens == 1:
                input_ids.append(seq.token_id_at(start))
            else:
                input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(seq.block_table.slots(start, end))
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            if end == seq.num_tokens:        # prompt fully computed: sample the next token
                for sampling_seq in [seq, *s.forks]:       # forks sample from the same row
                    if s.seq_group.beam_state is not None:
                        beam_rows.append(len(logits_indices))
                        beam_ks.append(2 * s.seq_group.beam_state.params.beam_width)
                    logits_indices.append(query_start_loc[-1] - 1)
                    sampled_seq_ids.append(sampling_seq.seq_id)
                    params.append(s.seq_group.sampling_params)
                    generators.append(sampling_seq.generator)
        max_blocks = max(len(s.seq.block_table) for s in batch)
        block_tables = [s.seq.block_table.block_ids + [0] * (max_blocks - len(s.seq.block_table))
                        for s in batch]

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=t(slot_mapping), block_tables=t(block_tables), seq_lens=t(seq_lens),
            query_start_loc=t(query_start_loc),
            num_decodes=sum(1 for s in batch if s.num_new_tokens == 1),
            seq_lens_list=seq_lens, query_start_loc_list=query_start_loc)
        return ModelInput(
            input_ids=t(input_ids), positions=t(positions), attn_metadata=meta,
            logits_indices=t(logits_indices), sampled_seq_ids=sampled_seq_ids,
            sampling_metadata=SamplingMetadata.build(params, generators,
                                                     self.model.config.vocab_size, self.device),
            beam_rows=beam_rows, beam_ks=beam_ks)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Copy blocks, run the forward pass, sample. Returns the sampled tokens."""
        if scheduler_output.blocks_to_swap_out:       # first: their device blocks may be reused now
            self.swap_blocks(self.kv_cache, self.cpu_kv_cache, scheduler_output.blocks_to_swap_out)
        if scheduler_output.blocks_to_swap_in:
            self.swap_blocks(self.cpu_kv_cache, self.kv_cache, scheduler_output.blocks_to_swap_in)
        if scheduler_output.blocks_to_copy:
            self.copy_blocks(scheduler_output.blocks_to_copy)
        if scheduler_output.is_empty:
            return ModelRunnerOutput({})
        inp = self.prepare_inputs(scheduler_output)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata)
        if not inp.sampled_seq_ids:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[inp.logits_indices])      # [num_sampled, vocab]
        tokens = self.sampler(logits, inp.sampling_metadata, self.generator).tolist()
        out = ModelRunnerOutput(dict(zip(inp.sampled_seq_ids, tokens)))
        if inp.beam_rows:                          # beam search wants the top 2k instead
            rows = torch.tensor(inp.beam_rows, device=self.device)
            k = max(inp.beam_ks)
            top = torch.log_softmax(logits[rows], dim=-1).topk(k, dim=-1)
            for i, (lp, ids) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                kk = inp.beam_ks[i]
                out.beam_candidates[inp.sampled_seq_ids[inp.beam_rows[i]]] = (lp[:kk], ids[:kk])
        return out

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                    pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src_cache[src] -> dst_cache[dst] (device <-> CPU pool)."""
        self.attn_backend.swap_blocks(src_cache, dst_cache, pairs)

    def measure_preemption_costs(self) -> PreemptionCosts:
        """Time a swap of a few blocks and a short prefill (once, at engine start)."""
        import time

        num_blocks = self.kv_cache.shape[2]
        n = max(1, min(8, num_blocks, self.cpu_kv_cache.shape[2]))
        pairs = [(i, i) for i in range(n)]
        if self.cpu_kv_cache.shape[2]:
            self.swap_blocks(self.kv_cache, self.cpu_kv_cache, pairs)           # warm-up
            start = time.perf_counter()
            self.swap_blocks(self.kv_cache, self.cpu_kv_cache, pairs)
            self.swap_blocks(self.cpu_kv_cache, self.kv_cache, pairs)
            per_block = (time.perf_counter() - start) / (2 * n)
        else:
            per_block = float("inf")
        tokens = min(64, num_blocks * self.block_size, self.model.rope_cos.shape[0])   # <= max_model_len
        ids = torch.arange(tokens, device=self.device)
        blocks = ids[: -(-tokens // self.block_size)]
        meta = AttentionMetadata(slot_mapping=ids, block_tables=blocks[None], seq_lens=ids[-1:] + 1,
                                 query_start_loc=torch.tensor([0, tokens], device=self.device),
                                 num_decodes=int(tokens == 1), seq_lens_list=[tokens],
                                 query_start_loc_list=[0, tokens])
        with torch.inference_mode():
            for timed in (False, True):                                          # warm-up, then time
                start = time.perf_counter()
                self.model(ids % self.model.config.vocab_size, ids, self.kv_cache, meta)
            per_token = (time.perf_counter() - start) / tokens
            self.kv_cache[:, :, :max(n, len(blocks))].zero_()   # back to the zero state
        return PreemptionCosts(per_block, per_token)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer, K and V (copy-on-write)."""
        self.attn_backend.copy_blocks(self.kv_cache, pairs)
