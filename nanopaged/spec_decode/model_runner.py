"""SpecDecodeModelRunner: the runner's side of speculative decoding (chapter 19).

Each step a sequence may verify the drafts the scheduler sent
(so.scheduled_spec_decode_tokens, a SpecDecodeSchedulerOutput: messages.py here): its
input is its last token and the drafts, and it samples k + 1 rows (`_token_ids`,
`_sampled_rows`). The rejection sampler keeps the drafts the target agrees with
(`_verify`), then the proposer drafts the next ones (`_propose`, after sampling); both
go back in a SpecDecodeModelRunnerOutput (`runner_output_cls`). The scheduler's side
is spec_decode/scheduler.py.
vLLM: `vllm/v1/worker/gpu_model_runner.py` (`_calc_spec_decode_metadata`, `propose_draft_token_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..messages import SchedulerOutput
from ..worker.input_batch import SeqState
from ..worker.logits_chunks import row_chunks
from ..worker.model_input import ModelInput
from ..worker.model_runner import ModelRunner
from ..worker.sampler import compute_logprobs
from .draft_model import DraftModelProposer
from .messages import SpecDecodeModelRunnerOutput, SpecDecodeSchedulerOutput
from .ngram_proposer import NgramProposer
from .proposer import Proposer
from .rejection_sampler import RejectionSampler


@dataclass
class SpecDecodeModelInput(ModelInput):
    """ModelInput plus the drafts.

    Attributes:
        spec_token_ids: seq_id -> the drafts it verifies, in row order.
        proposal_seq_ids: the sequences the proposer drafts for (those that computed all
            their tokens this step; not the forks).
    """

    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    proposal_seq_ids: list[int] = field(default_factory=list)


class SpecDecodeModelRunner(ModelRunner):
    """ModelRunner that verifies drafts and proposes the next ones.

    Args:
        draft_model: the loaded draft, for speculative_config.method "draft_model".
        (the others as ModelRunner's)

    Raises:
        ValueError: method "draft_model" without a draft_model, or n-gram lookup with a
            vocabulary over 0x110000 ids (token ids become characters: ngram_proposer.py).
    """

    runner_output_cls = SpecDecodeModelRunnerOutput
    model_input_cls = SpecDecodeModelInput

    def __init__(self, config, model, *, num_gpu_blocks: int, num_cpu_blocks: int = 0, ops=None,
                 draft_model=None) -> None:
        super().__init__(config, model, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, ops=ops)
        sc = self.speculative_config = config.speculative_config
        self.rejection_sampler = RejectionSampler()
        self.proposer: Proposer
        if sc.method == "ngram":
            if model.config.vocab_size > 0x110000:
                raise ValueError(f"n-gram speculation needs vocab_size <= {0x110000}, got {model.config.vocab_size}")
            self.proposer = NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)
        else:
            if draft_model is None:
                raise ValueError("speculative_config.method is 'draft_model' but no draft model was loaded")
            draft_model.set_ops(self.ops)
            self.proposer = DraftModelProposer(draft_model, sc.num_speculative_tokens, num_gpu_blocks,
                                               self.block_size, num_cpu_blocks,
                                               config.max_model_len or model.rope_cos.shape[0], self.max_logits_rows)

    def _update_states(self, so: SchedulerOutput) -> None:
        super()._update_states(so)
        for seq_id in [*so.finished_seq_ids, *(new.seq_id for new in so.scheduled_new_reqs)]:
            self.proposer.remove_sequence(seq_id)

    def _move_blocks(self, so: SchedulerOutput) -> None:
        super()._move_blocks(so)
        self.proposer.move_blocks(self.ops, so)

    # -- the input: the drafts after the last token -------------------------------------------

    def _token_ids(self, so: SpecDecodeSchedulerOutput, state: SeqState, start: int, end: int) -> list[int]:
        drafts = so.scheduled_spec_decode_tokens.get(state.seq_id, [])
        return state.token_ids(start, end - len(drafts)) + drafts

    def _sampled_rows(self, so: SpecDecodeSchedulerOutput, state: SeqState, end: int, next_row: int,
                      forks: list[int]) -> list[tuple[int, int]]:
        drafts = so.scheduled_spec_decode_tokens.get(state.seq_id)
        if not drafts:
            return super()._sampled_rows(so, state, end, next_row, forks)
        # verify: a row for its last token and one per draft
        return [(state.seq_id, row) for row in range(next_row - 1 - len(drafts), next_row)]

    def prepare_inputs(self, so: SpecDecodeSchedulerOutput) -> SpecDecodeModelInput:
        """ModelRunner.prepare_inputs, plus each sequence's drafts (spec_token_ids) and
        the sequences that computed all their tokens (proposal_seq_ids: not the forks)."""
        inp = super().prepare_inputs(so)
        for seq_id in inp.seq_ids:
            state, drafts = self.input_batch.seqs[seq_id], so.scheduled_spec_decode_tokens.get(seq_id, [])
            if drafts:
                inp.spec_token_ids[seq_id] = drafts
            if state.num_computed_tokens + so.num_scheduled_tokens[seq_id] - len(drafts) == state.num_tokens:
                inp.proposal_seq_ids.append(seq_id)
        return inp

    # -- verify, then propose -----------------------------------------------------------------

    def _sample(self, inp: SpecDecodeModelInput, hidden: torch.Tensor, out: SpecDecodeModelRunnerOutput) -> None:
        """Sample the rows without drafts, then verify the others (_verify)."""
        spec = inp.spec_token_ids
        self._sample_rows(inp, hidden, out, [i for i, seq_id in enumerate(inp.sampled_seq_ids) if seq_id not in spec])
        if spec:
            self._verify(inp, hidden, out)

    def _after_sample(self, inp: SpecDecodeModelInput, out: SpecDecodeModelRunnerOutput) -> None:
        out.draft_token_ids = self._propose(inp, out)
        super()._after_sample(inp, out)

    def _verify(self, inp: SpecDecodeModelInput, hidden: torch.Tensor, out: SpecDecodeModelRunnerOutput) -> None:
        """Check each verifying sequence's drafts against its k + 1 rows of logits
        (rejection_sampler.py), whole sequences per chunk of rows. Row j is processed as
        if drafts[:j] were already output (penalties, min_tokens, bad words), so greedy
        verification accepts what plain decoding would pick. Fills sampled_token_ids
        (the token after the accepted drafts), num_accepted_tokens and the logprobs of
        the new tokens (raw, one row each)."""
        spec, rows_of = inp.spec_token_ids, {}
        for i, seq_id in enumerate(inp.sampled_seq_ids):
            rows_of.setdefault(seq_id, []).append(i)
        for seq_ids in row_chunks(list(spec), self.max_logits_rows, [len(d) + 1 for d in spec.values()]):
            rows = [r for seq_id in seq_ids for r in rows_of[seq_id]]
            drafts = [spec[seq_id] for seq_id in seq_ids]
            meta = self.input_batch.make_sampling_metadata([inp.sampled_seq_ids[r] for r in rows],
                                                           [d[:j] for d in drafts for j in range(len(d) + 1)])
            raw = self._compute_logits(hidden, inp, rows)                        # [sum(k_i + 1), vocab]
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

    def _propose(self, inp: SpecDecodeModelInput, out: SpecDecodeModelRunnerOutput) -> dict[int, list[int]]:
        """The drafts of each sequence that computed tokens and sampled this step, to
        follow the tokens it got (forks that only sample wait a step: no blocks yet).
        None in a step of more sequences than speculative_config.disable_by_batch_size."""
        limit = self.speculative_config.disable_by_batch_size
        if limit is not None and inp.attn_metadata.num_seqs > limit:
            return {}
        seqs = []
        for seq_id in inp.proposal_seq_ids:
            if seq_id in out.sampled_token_ids:
                accepted = inp.spec_token_ids.get(seq_id, [])[:out.num_accepted_tokens.get(seq_id, 0)]
                seqs.append((self.input_batch.seqs[seq_id], accepted + [out.sampled_token_ids[seq_id]]))
        return self.proposer.propose(inp, seqs)
