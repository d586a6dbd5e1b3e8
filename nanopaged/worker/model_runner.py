"""ModelRunner: carry out one SchedulerOutput: tensors in, tokens (and logprobs) out.

The runner makes no decisions, and it never sees the scheduler's Sequence objects: all
it knows arrived in SchedulerOutput messages (messages.py), so it could live in another
process (vLLM v1's worker). It keeps its own record of every sequence it serves in one
InputBatch (input_batch.py: tokens, block table, sampling settings, random generator,
penalty counts; vLLM v1's InputBatch), learns new ones in full and known ones as deltas.

Each step it:

1. updates that record (`_update_states`),
2. copies KV blocks if asked (swap out, swap in, copy-on-write),
3. builds the flat model input (`prepare_inputs`): for every scheduled sequence, the
   ids and positions of the tokens it computes this step, the KV slot each one writes
   (`slot_mapping`), its block table and its context length (`seq_lens`),
4. runs the model over all those tokens at once,
5. takes the hidden state of each sequence's last token, computes logits only there (in
   fp32), and samples; plus prompt logprobs where a request asked for them. Logits
   are computed and sampled in chunks of rows, so a step never holds more than
   max_logits_bytes of them (logits_chunks.py). A step
   with structured outputs samples in a second call, `sample_tokens`, once the core
   has sent the token masks (a GrammarOutput) of its constrained rows.
6. with async scheduling, appends what it sampled to its own record: the next step was
   scheduled before these tokens were known, so it feeds them itself (vLLM v1's runner
   does the same). Without it the scheduler sends each sampled token back next step.

It also owns the KV cache itself: one tensor
    kv_cache: [num_layers, 2 (K, V), num_gpu_blocks, block_size, num_kv_heads, head_size]
(with tensor parallelism, num_kv_heads is this rank's share: worker.py)
zero-filled once at start (zeros, not garbage: padded block-table entries are read and
then masked, and 0 * NaN would still be NaN).

vLLM: `vllm/v1/worker/gpu_model_runner.py`, `gpu_input_batch.py`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import SpeculativeConfig
from ..messages import GrammarOutput, Logprobs, ModelRunnerOutput, PreemptionCosts, SchedulerOutput
from ..model.llama import LlamaForCausalLM
from ..layers.attention import AttentionMetadata
from ..layers.backends import TorchBackend
from ..utils.math_utils import cdiv
from .input_batch import InputBatch
from .logits_chunks import chunked_logprobs, compute_logits_rows, max_logits_rows, row_chunks
from .sampler import Sampler, compute_logprobs
from .spec_decode.draft_model import DraftModelProposer
from .spec_decode.ngram_proposer import NgramProposer
from .spec_decode.rejection_sampler import RejectionSampler


@dataclass
class ModelInput:
    """The tensors of one forward pass.

    Attributes:
        input_ids: [num_tokens] int64, the new tokens of all sequences, end to end.
        positions: [num_tokens] int64, each token's position in its sequence.
        attn_metadata: slot_mapping, block_tables, seq_lens, query_start_loc.
        logits_indices: [num_sampled] int64, rows of the hidden states to sample from
            (the last new token of each sequence whose prompt is now fully computed;
            a fork's row repeats its parent's).
        sampled_seq_ids: seq_id of each of those rows.
        prompt_logprob_rows: seq_id -> (first hidden row, number of rows, first
            position) for sequences that want prompt logprobs of this step's tokens.
        spec_token_ids: seq_id -> the drafts it verifies (speculative decoding), in the
            order of its rows; such a sequence has k + 1 consecutive rows in
            logits_indices, its last token's and one per draft.
        proposal_seq_ids: the sequences that computed tokens and sample this step (not
            the forks): the ones the proposer drafts for.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_seq_ids: list[int]
    prompt_logprob_rows: dict[int, tuple[int, int, int]]
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    proposal_seq_ids: list[int] = field(default_factory=list)


class ModelRunner:
    """Owns the model, the KV cache and the per-sequence record (an InputBatch);
    executes SchedulerOutputs.

    Args:
        model: a loaded model (LlamaForCausalLM or a family built on it: model/registry.py).
        num_gpu_blocks, block_size: the KV pool's shape (as the BlockManager's).
        seed: seed of the generator for requests without their own seed.
        num_cpu_blocks: blocks in the CPU swap pool.
        attn_backend: the attention backend (layers/backends.py); None = the PyTorch reference.
        async_scheduling: append each sampled token to the sequence's record at once
            (step 6 of the module doc); the scheduler then does not send it back.
        speculative_config: speculative decoding (config.SpeculativeConfig), or None.
            The runner then verifies each step's drafts (_verify) and proposes the next
            ones (_propose), with an n-gram proposer or `draft_model`.
        draft_model: the loaded draft (a model of any registered family), for method "draft_model".
        max_model_len: no draft is proposed at or past it.
        max_logits_bytes: most bytes of fp32 logits held at once (logits_chunks.py);
            None = no bound.
    """

    def __init__(self, model: LlamaForCausalLM, num_gpu_blocks: int, block_size: int,
                 seed: int = 0, num_cpu_blocks: int = 0, attn_backend: TorchBackend | None = None,
                 async_scheduling: bool = False, speculative_config: SpeculativeConfig | None = None,
                 draft_model: LlamaForCausalLM | None = None, max_model_len: int | None = None,
                 max_logits_bytes: int | None = None) -> None:
        c = model.config
        self.model = model
        self.async_scheduling = async_scheduling
        self.attn_backend = attn_backend or TorchBackend()
        model.set_attention_backend(self.attn_backend)
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        num_kv_heads = model.num_local_kv_heads          # this rank's (all of them at tp=1)
        head_size = c.head_dim                           # config.json's name for it
        self.kv_cache = torch.zeros(c.num_hidden_layers, 2, num_gpu_blocks, block_size,
                                    num_kv_heads, head_size, dtype=self.dtype, device=self.device)
        # The swap pool: host memory (pinned on CUDA for fast copies). Never read where
        # it was not written, so it needs no zeroing.
        self.cpu_kv_cache = torch.empty((c.num_hidden_layers, 2, num_cpu_blocks, block_size,
                                         num_kv_heads, head_size), dtype=self.dtype,
                                        pin_memory=self.device.type == "cuda")
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)   # rows without a seed
        self.input_batch = InputBatch(c.vocab_size, self.device)
        self.max_logits_rows = max_logits_rows(max_logits_bytes, c.vocab_size)   # per chunk; None: all
        self._pending = None       # (ModelInput, hidden, output) of a step awaiting sample_tokens
        self.speculative_config = sc = speculative_config
        self.rejection_sampler = RejectionSampler()
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if sc is not None and sc.method == "ngram":
            if c.vocab_size > 0x110000:          # token ids become characters (ngram_proposer.py)
                raise ValueError(f"n-gram speculation needs vocab_size <= {0x110000}, got {c.vocab_size}")
            self.proposer = NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)
        elif sc is not None:
            if draft_model is None:
                raise ValueError("speculative_config.method is 'draft_model' but no draft model was loaded")
            draft_model.set_attention_backend(self.attn_backend)
            self.proposer = DraftModelProposer(draft_model, sc.num_speculative_tokens, num_gpu_blocks, block_size,
                                               num_cpu_blocks, max_model_len or self.model.rope_cos.shape[0],
                                               self.max_logits_rows)

    @staticmethod
    def kv_cache_bytes_per_block(model_config, block_size: int, dtype: torch.dtype,
                                 num_kv_heads: int | None = None) -> int:
        """Bytes one block takes across all layers, K and V, holding num_kv_heads heads
        (default: all of the model's; a tensor-parallel rank holds its own share)."""
        num_kv_heads = model_config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        return (2 * model_config.num_hidden_layers * block_size * num_kv_heads
                * model_config.head_dim * torch.empty((), dtype=dtype).element_size())

    # -- the runner's own state ---------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        """Bring the runner's record (self.input_batch) up to date with the step's
        message, in this order:

        1. so.finished_seq_ids: forget each one: its record, its seeded generator and
           its penalty counts (self.input_batch.remove_sequence).
        2. so.scheduled_new_reqs: sequences sent in full (first scheduled, resumed
           after a preemption, or forked). Each becomes a fresh record
           (self.input_batch.add_sequence: copies of the message's lists, the penalty
           counts of its tokens; a seeded sequence keeps its generator if it has one:
           a resumed one draws on where it was).
        3. so.scheduled_cached_reqs: the deltas of the sequences it knows (parallel
           lists): append the new block ids (after dropping the blocks the scheduler
           took back past num_computed_tokens), or take them as the whole table when
           block_ids_replaced; set num_computed_tokens; append the new tokens, every
           sequence's in one call for the step (self.input_batch.append_output_tokens,
           which also counts them).
        """
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
                # speculative decoding: the scheduler took back the blocks past the
                # accepted tokens (rejected drafts, lookahead); before a step a table
                # holds ceil(num_computed_tokens / block_size) blocks, so they go here
                del state.block_ids[cdiv(computed, self.block_size):]
                state.block_ids.extend(blocks)
            state.num_computed_tokens = computed
            appended_seqs += [seq_id] * len(tokens)
            appended_tokens += tokens
        if appended_tokens:
            self.input_batch.append_output_tokens(appended_seqs, appended_tokens)

    # -- one step -------------------------------------------------------------------------------

    def prepare_inputs(self, so: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled sequences into one batch (decode sequences first)."""
        scheduled = [(self.input_batch.seqs[i], n) for i, n in so.num_scheduled_tokens.items() if n > 0]
        # Decodes first: attention batches them. A decode computes one *output* token; the
        # last token of a prompt (one left after a prefix-cache hit) is prefill, so it
        # takes the prefill path the same prompt takes without the hit (field case C36).
        is_decode = [n == 1 and s.num_computed_tokens >= len(s.prompt_token_ids) for s, n in scheduled]
        order = sorted(range(len(scheduled)), key=lambda i: not is_decode[i])
        scheduled, num_decodes = [scheduled[i] for i in order], sum(is_decode)
        forks_of: dict[int, list[int]] = {}
        for fork, parent in so.sample_from.items():
            forks_of.setdefault(parent, []).append(fork)
        input_ids, positions, seq_lens, query_start_loc = [], [], [], [0]
        logits_indices, sampled_seq_ids, prompt_rows, spec, proposal_seq_ids = [], [], {}, {}, []
        for state, n in scheduled:
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            drafts = so.scheduled_spec_decode_tokens.get(state.seq_id, [])
            input_ids += state.token_ids(start, end - len(drafts)) + drafts
            positions += range(start, end)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + n)
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                # hidden row of position p predicts the prompt token at p + 1
                prompt_rows[state.seq_id] = (query_start_loc[-2], min(end, num_prompt - 1) - start, start)
            if end - len(drafts) == state.num_tokens:
                proposal_seq_ids.append(state.seq_id)
            if drafts:                       # verify: a row for its last token and each draft
                spec[state.seq_id] = drafts
                logits_indices += range(query_start_loc[-1] - 1 - len(drafts), query_start_loc[-1])
                sampled_seq_ids += [state.seq_id] * (len(drafts) + 1)
            elif end == state.num_tokens:    # prompt fully computed: sample the next token
                for seq_id in [state.seq_id, *forks_of.get(state.seq_id, [])]:
                    logits_indices.append(query_start_loc[-1] - 1)
                    sampled_seq_ids.append(seq_id)
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
        return ModelInput(input_ids=t(input_ids), positions=pos, attn_metadata=meta,
                          logits_indices=t(logits_indices), sampled_seq_ids=sampled_seq_ids,
                          prompt_logprob_rows=prompt_rows, spec_token_ids=spec,
                          proposal_seq_ids=proposal_seq_ids)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Update state, copy blocks, run the forward pass, sample. When the step has
        rows with structured outputs (so.structured_output_seq_ids), stop after the
        logits and return None: sample_tokens(GrammarOutput) samples once their masks
        are made, which the core does while this forward runs (vLLM v1's split)."""
        self._pending = None
        self._update_states(so)
        caches = [(self.kv_cache, self.cpu_kv_cache)]
        if isinstance(self.proposer, DraftModelProposer):      # the draft's K/V move with the target's
            caches.append((self.proposer.kv_cache, self.proposer.cpu_kv_cache))
        for device_cache, cpu_cache in caches:
            if so.blocks_to_swap_out:       # first: their device blocks may be reused now
                self.attn_backend.swap_blocks(device_cache, cpu_cache, so.blocks_to_swap_out)
            if so.blocks_to_swap_in:
                self.attn_backend.swap_blocks(cpu_cache, device_cache, so.blocks_to_swap_in)
            if so.blocks_to_copy:
                self.attn_backend.copy_blocks(device_cache, so.blocks_to_copy)
        if so.is_empty:
            return ModelRunnerOutput()
        inp = self.prepare_inputs(so)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata)
        out = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(hidden, inp))
        if not inp.sampled_seq_ids:
            return out
        if so.structured_output_seq_ids:
            self._pending = (inp, hidden, out)
            return None
        return self._sample(inp, hidden, out)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput) -> ModelRunnerOutput:
        """Finish the step execute_model left at its hidden states: sample all rows, each
        constrained row masked by its grammar (sampler.apply_grammar_bitmask).

        Raises:
            RuntimeError: no step is waiting for its masks.
        """
        if self._pending is None:
            raise RuntimeError("sample_tokens: execute_model left no step waiting for its grammar bitmask")
        (inp, hidden, out), self._pending = self._pending, None
        rows_of: dict[int, list[int]] = {}       # a verifying sequence has k + 1 rows, in order
        for i, seq_id in enumerate(inp.sampled_seq_ids):
            rows_of.setdefault(seq_id, []).append(i)
        rows = [rows_of[i].pop(0) for i in grammar_output.structured_output_seq_ids]
        return self._sample(inp, hidden, out, (rows, grammar_output.grammar_bitmask.to(self.device)))

    def _sample(self, inp: ModelInput, hidden: torch.Tensor, out: ModelRunnerOutput,
                masks: tuple[list[int], torch.Tensor] | None = None) -> ModelRunnerOutput:
        """Sample the plain rows (one per sequence), chunk by chunk (logits_chunks.py),
        verify the drafts of the others (_verify), then propose the next step's drafts
        (speculative decoding). masks: (sampled row, grammar bitmask) per constrained row."""
        spec = inp.spec_token_ids
        plain = [i for i, seq_id in enumerate(inp.sampled_seq_ids) if seq_id not in spec]
        for rows in row_chunks(plain, self.max_logits_rows):
            seq_ids = [inp.sampled_seq_ids[i] for i in rows]
            logits = compute_logits_rows(self.model, hidden, inp.logits_indices, rows, masks)   # [rows, vocab]
            sampled = self.sampler(logits, self.input_batch.make_sampling_metadata(seq_ids), self.generator)
            out.sampled_token_ids.update(zip(seq_ids, sampled.sampled_token_ids.tolist()))
            out.logprobs.update((i, lp) for i, lp in zip(seq_ids, sampled.logprobs) if lp is not None)
        if spec:
            self._verify(inp, hidden, out, masks)
        if self.proposer is not None:
            out.draft_token_ids = self._propose(inp, out)
        if self.async_scheduling:
            self.input_batch.append_output_tokens(list(out.sampled_token_ids), list(out.sampled_token_ids.values()))
        return out

    def _verify(self, inp: ModelInput, hidden: torch.Tensor, out: ModelRunnerOutput, masks) -> None:
        """Speculative decoding: check each verifying sequence's drafts against its
        k + 1 rows of logits (worker/spec_decode/rejection_sampler.py), whole sequences
        per chunk of rows. Row j is
        processed as if drafts[:j] were already output (penalties, min_tokens, bad
        words), so greedy verification accepts exactly what plain decoding would pick.
        Fills sampled_token_ids (the token after the accepted drafts),
        num_accepted_tokens and the logprobs of the new tokens (raw, one row each)."""
        spec, rows_of = inp.spec_token_ids, {}
        for i, seq_id in enumerate(inp.sampled_seq_ids):
            rows_of.setdefault(seq_id, []).append(i)
        for seq_ids in row_chunks(list(spec), self.max_logits_rows, [len(d) + 1 for d in spec.values()]):
            rows = [r for seq_id in seq_ids for r in rows_of[seq_id]]
            drafts = [spec[seq_id] for seq_id in seq_ids]
            meta = self.input_batch.make_sampling_metadata([inp.sampled_seq_ids[r] for r in rows],
                                                           [d[:j] for d in drafts for j in range(len(d) + 1)])
            raw = compute_logits_rows(self.model, hidden, inp.logits_indices, rows, masks)   # [sum(k_i + 1), vocab]
            tokens = self.rejection_sampler(self.sampler.apply_logits_processors(raw, meta), drafts, meta,
                                            self.generator)
            first = 0
            for seq_id, d, new in zip(seq_ids, drafts, tokens):
                out.sampled_token_ids[seq_id] = new[-1]
                out.num_accepted_tokens[seq_id] = len(new) - 1
                k = self.input_batch.seqs[seq_id].sampling_params.logprobs
                if k is not None:
                    targets = torch.tensor(new, dtype=torch.int64, device=self.device)
                    out.logprobs[seq_id] = compute_logprobs(raw[first:first + len(new)], targets, k)
                first += len(d) + 1

    def _propose(self, inp: ModelInput, out: ModelRunnerOutput) -> dict[int, list[int]]:
        """The drafts of each sequence that computed tokens and sampled this step (forks
        that only sample from a parent's row wait a step: they have no blocks yet), to
        follow the tokens this step gave it. None in a step of more sequences than
        speculative_config.disable_by_batch_size."""
        limit = self.speculative_config.disable_by_batch_size
        if limit is not None and inp.attn_metadata.num_seqs > limit:
            return {}
        seqs = []
        for seq_id in inp.proposal_seq_ids:
            if seq_id in out.sampled_token_ids:
                accepted = inp.spec_token_ids.get(seq_id, [])[:out.num_accepted_tokens.get(seq_id, 0)]
                seqs.append((self.input_batch.seqs[seq_id], accepted + [out.sampled_token_ids[seq_id]]))
        if isinstance(self.proposer, DraftModelProposer):
            return self.proposer.propose(inp, seqs)
        drafts = {}
        for s, new in seqs:        # the n-gram search runs on a str kept with the record
            s.lookup_text += "".join(map(chr, s.token_ids(len(s.lookup_text), s.num_tokens)))
            drafts[s.seq_id] = self.proposer.propose_text(s.lookup_text + "".join(map(chr, new)))
        return drafts

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: ModelInput) -> dict[int, Logprobs]:
        """Logprobs of the prompt tokens this step's hidden rows predict (raw, fp32), in
        chunks of at most max_logits_rows rows."""
        result = {}
        for seq_id, (row, count, start) in inp.prompt_logprob_rows.items():
            state = self.input_batch.seqs[seq_id]
            result[seq_id] = chunked_logprobs(self.model, hidden[row:row + count],
                                              state.prompt_token_ids[start + 1:start + 1 + count],
                                              state.sampling_params.prompt_logprobs, self.max_logits_rows)
        return result

    # -- block copies and start-up measurements ------------------------------------------------

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                    pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src_cache[src] -> dst_cache[dst] (device <-> CPU pool)."""
        self.attn_backend.swap_blocks(src_cache, dst_cache, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer, K and V (copy-on-write)."""
        self.attn_backend.copy_blocks(self.kv_cache, pairs)

    def measure_preemption_costs(self) -> PreemptionCosts:
        """Time a swap of a few blocks and a short prefill (once, at engine start)."""
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
        blocks = ids[: cdiv(tokens, self.block_size)]
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
