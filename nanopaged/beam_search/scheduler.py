"""Beam search: keep the beam_width most likely continuations, sharing their KV blocks.

A beam-search request is a SequenceGroup of beam_width sequences (the beams). It asks
the model runner for nothing special: its SamplingParams are greedy with `logprobs` set
to the number of candidates to keep, so each step the runner returns, for every beam,
its most likely next tokens with their log-probabilities (the generic logprobs output,
messages.Logprobs), and the scheduler calls `beam_search_step` to decide the next
generation:

1. candidates = (beam, token) pairs scored by the beam's cumulative logprob + logprob; keep
   the best `num_candidates(beam_width, eos ids)` of them, best first: 2 * beam_width,
   or (1 + number of eos ids) * beam_width when there are several eos ids, so that
   enough candidates survive to fill beam_width live beams even when many of the top
   ones end (transformers' `beams_to_keep`; tests/engine/test_engine_v1_real.py::
   test_c25_beam_search_with_several_eos_ids checks it): `top_candidates`;
2. a candidate that ends (EOS, or reaching max_tokens) and ranks among the first
   beam_width becomes a finished hypothesis, scored cum_logprob / length ** length_penalty
   (length = generated tokens); the best beam_width hypotheses are kept;
3. the best beam_width candidates that do not end become the next beams (2 and 3:
   `split_candidates`).

A beam that is chosen twice *forks*: the second child gets a Sequence of its own whose
block table shares all the parent's blocks (BlockManager.fork, ref_count + 1); when both
append their next tokens the shared, partly filled last block is copied (copy-on-write).
A beam that is not chosen frees its blocks. This is the paper's §4.4 use case, and
where sharing saves the most memory (its Fig. 15).

BeamSearchScheduler joins the scheduler at its hooks (features.py) and keeps each
request's BeamState in its table (`beam_states`, by request_id, with each beam's
cumulative logprob by seq_id) from the request's arrival until it leaves. The request
comes as a BeamSearchRequest and the answer goes out as BeamSearchHypothesis outputs
(messages.py here). The rules follow
transformers' `generate(num_beams=k, early_stopping=True)`
(`GenerationMixin._beam_search`), so the two agree token for token: the search ends when
beam_width hypotheses have finished, when no candidate can continue, or at max_tokens.
vLLM's `LLM.beam_search` returns the same shapes (`vllm/beam_search.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..messages import EngineCoreOutputs, EngineCoreRequest, FinishReason, Logprobs, ModelRunnerOutput, SchedulerOutput
from ..outputs import BeamSearchSequence
from ..sampling_params import BeamSearchParams
from ..core.scheduler import Scheduler
from ..core.scheduler_output import ScheduledSequence
from ..core.sequence import Sequence, SequenceGroup, SequenceStatus
from .messages import BeamSearchHypothesis, BeamSearchRequest


@dataclass
class BeamState:
    """One beam-search request's bookkeeping (BeamSearchScheduler.beam_states).

    Attributes:
        params: its BeamSearchParams.
        finished: the hypotheses kept so far, best first.
        done: the search is over.
        cumulative_logprob: seq_id -> the sum of the logprobs of that beam's output
            tokens (0.0 for each beam at first).
    """

    params: BeamSearchParams
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False
    cumulative_logprob: dict[int, float] = field(default_factory=dict)


def num_candidates(beam_width: int, eos_token_ids: frozenset[int]) -> int:
    """Candidates kept per step, and top logprobs asked per beam (transformers' rule)."""
    return max(2, 1 + len(eos_token_ids)) * beam_width


def top_candidates(beams: list[Sequence], cumulative_logprob: dict[int, float], candidates: dict[int, Logprobs],
                   keep: int) -> list[tuple[float, Sequence, int]]:
    """Rule 1: score every (beam, token) candidate by the beam's cumulative logprob + the
    token's logprob, and keep the best `keep` of them, best first.

    Args:
        beams: the beams to extend (on the first step only the first: all are the prompt).
        cumulative_logprob: seq_id -> that beam's cumulative logprob (BeamState's).
        candidates: seq_id -> that beam's Logprobs row from the runner. Its token_ids[0]
            and logprobs[0] list the greedy (sampled) token first, then the top tokens
            with their logprobs: the candidates are the entries after the first.
        keep: how many to return (num_candidates).

    Returns:
        (score, beam, token) triples, best score first; a tie goes to the earlier beam
        of `beams`, then to the token listed earlier in its row.
    """
    scored = sorted(((cumulative_logprob[b.seq_id] + lp, -bi, ti, b, tok)
                     for bi, b in enumerate(beams)
                     for ti, (lp, tok) in enumerate(zip(candidates[b.seq_id].logprobs[0][1:],
                                                        candidates[b.seq_id].token_ids[0][1:]))),
                    key=lambda c: (c[0], c[1], -c[2]), reverse=True)[:keep]
    return [(score, beam, tok) for score, _, _, beam, tok in scored]


def split_candidates(state: BeamState, ranked: list[tuple[float, Sequence, int]], eos_token_ids: frozenset[int],
                     gen_len: int, ends_by_length: bool) -> list[tuple[float, Sequence, int]]:
    """Rules 2 and 3: which of the step's ranked candidates finish, which go on.

    A candidate ends when ends_by_length, or when its token is one of eos_token_ids
    (unless params.ignore_eos). An ending candidate ranked among the first beam_width
    becomes a finished hypothesis, BeamSearchSequence(parent.token_ids + [token],
    cum_logprob=score, score=score / gen_len ** length_penalty, finish_reason "stop"
    for an eos, else "length"), unless beam_width hypotheses had finished before this
    step (early stopping); state.finished keeps the best beam_width of them all, by
    score, best first. The first beam_width candidates that do not end are the next
    beams. The search is done (state.done = True) once beam_width hypotheses have
    finished, or when fewer than beam_width candidates go on.

    Args:
        state: the request's BeamState (params, finished hypotheses, done); updated.
        ranked: (score, parent beam, token), best first (top_candidates).
        eos_token_ids: tokens that end a hypothesis.
        gen_len: tokens generated per beam after this step (eos included).
        ends_by_length: this step reaches max_tokens or max_model_len: everything ends.

    Returns:
        the next beams, (score, parent beam, token), best first; at most beam_width.
    """
    p, k = state.params, state.params.beam_width
    next_beams, new_finished = [], []
    for rank, (score, parent, tok) in enumerate(ranked):
        is_eos = not p.ignore_eos and tok in eos_token_ids
        if not (ends_by_length or is_eos):
            if len(next_beams) < k:
                next_beams.append((score, parent, tok))
        elif rank < k and len(state.finished) < k:       # full -> no new hypotheses (early_stopping)
            new_finished.append(BeamSearchSequence(parent.token_ids + [tok], score,
                                                   score=score / gen_len ** p.length_penalty,
                                                   finish_reason="stop" if is_eos else "length"))
    state.finished = sorted(state.finished + new_finished, key=lambda h: h.score, reverse=True)[:k]
    # transformers stops once beam_width hypotheses are done, or nothing can continue
    state.done = len(state.finished) >= k or len(next_beams) < k
    return next_beams


def beam_search_step(group: SequenceGroup, state: BeamState, candidates: dict[int, Logprobs],
                     eos_token_ids: frozenset[int], max_model_len: int, fork) -> list[int]:
    """Advance one beam-search request by one token (see the module docstring): rank
    the candidates (top_candidates), split them into finished hypotheses and next
    beams (split_candidates), and give the next beams Sequences, forking where a beam
    has several children.

    Args:
        group: the request.
        state: its BeamState (updated: hypotheses, done, the beams' cumulative logprobs).
        candidates: seq_id -> that beam's Logprobs row from the runner: the greedy
            token first, then its top num_candidates tokens (only those are used).
        eos_token_ids: tokens that end a hypothesis (unless ignore_eos).
        max_model_len: a hypothesis also ends when it reaches this many tokens.
        fork: fork(parent, child), the BlockManager's; shares parent's blocks with child.

    Returns:
        seq_ids of the beams whose tokens and blocks were replaced by a fork.
    """
    p = state.params
    beams = group.get_seqs(SequenceStatus.RUNNING)
    if all(not b.output_token_ids for b in beams):
        beams = beams[:1]            # the first step: all beams are the prompt; expand one
    ranked = top_candidates(beams, state.cumulative_logprob, candidates, num_candidates(p.beam_width, eos_token_ids))
    gen_len = len(beams[0].output_token_ids) + 1          # generated length after this step
    ends_by_length = gen_len >= p.max_tokens or len(beams[0].prompt_token_ids) + gen_len >= max_model_len
    next_beams = split_candidates(state, ranked, eos_token_ids, gen_len, ends_by_length)
    if state.done:
        return []

    # Assign the next beams to Sequence objects. A parent's first child continues in the
    # parent itself; further children take over the Sequence of a beam that died.
    children_of: dict[int, list[tuple[float, int]]] = {}
    for score, parent, tok in next_beams:
        children_of.setdefault(parent.seq_id, []).append((score, tok))
    all_beams = group.get_seqs(SequenceStatus.RUNNING)
    spare = [b for b in all_beams if b.seq_id not in children_of]
    forked = []
    for parent in all_beams:
        extra = children_of.get(parent.seq_id, [])[1:]
        for score, tok in extra:
            child = spare.pop()
            fork(parent, child)                          # shares blocks (ref_count + 1)
            child.output_token_ids = list(parent.output_token_ids)
            state.cumulative_logprob[child.seq_id] = score
            child.output_token_ids.append(tok)
            forked.append(child.seq_id)
    for parent in all_beams:
        kids = children_of.get(parent.seq_id)
        if kids:
            score, tok = kids[0]
            state.cumulative_logprob[parent.seq_id] = score
            parent.output_token_ids.append(tok)
    return forked


def finished_outputs(group: SequenceGroup, state: BeamState) -> list[BeamSearchHypothesis]:
    """A finished search's answer: a BeamSearchHypothesis per kept hypothesis (its index
    in state.finished, best first) with its generated tokens, finish reason, cumulative
    logprob and length-penalized score."""
    n = len(group.prompt_token_ids)
    return [BeamSearchHypothesis(group.request_id, i, h.tokens[n:], finish_reason=FinishReason(h.finish_reason),
                                 cumulative_logprob=h.cum_logprob, score=h.score)
            for i, h in enumerate(state.finished)]


class BeamSearchScheduler(Scheduler):
    """The scheduler for beam-search requests: their beams advance together, after the
    step's tokens are in (_beam_step); other requests are the base's.

    Attributes:
        beam_states: request_id -> its BeamState, for each beam-search request from its
            arrival until it leaves (kept across preemption).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.beam_states: dict[str, BeamState] = {}
        self._beam_groups: dict[str, SequenceGroup] = {}      # sampled this step

    def _make_group(self, request: EngineCoreRequest) -> SequenceGroup:
        """A BeamSearchRequest's sequences are its beams, with a BeamState.

        Raises:
            ValueError: a beam search with speculative decoding (beams advance one token
                a step together) or with structured outputs.
        """
        if not isinstance(request, BeamSearchRequest):
            return super()._make_group(request)
        sc = self.config.speculative_config
        if sc is not None:
            raise ValueError(f"beam search does not work with speculative_config (method {sc.method!r}): "
                             "use one or the other")
        if request.sampling_params.structured_outputs is not None:
            raise ValueError("structured_outputs work with sampling only, not with beam search")
        group = super()._make_group(request)
        self.beam_states[group.request_id] = BeamState(request.beam_search,
                                                       cumulative_logprob={s.seq_id: 0.0 for s in group.seqs})
        return group

    def _request_removed(self, group: SequenceGroup) -> None:
        super()._request_removed(group)
        self.beam_states.pop(group.request_id, None)

    def _needs_output_first(self, s: ScheduledSequence) -> bool:
        # which tokens the beams keep, and which blocks they share, is decided on the output
        return s.seq_group.request_id in self.beam_states or super()._needs_output_first(s)

    def _append_tokens(self, seq: Sequence, group: SequenceGroup, tokens: list[int], scheduler_output: SchedulerOutput,
                       runner_output: ModelRunnerOutput, result: EngineCoreOutputs) -> None:
        if group.request_id not in self.beam_states or seq.status.is_finished:
            super()._append_tokens(seq, group, tokens, scheduler_output, runner_output, result)
        else:
            self._beam_groups[group.request_id] = group     # beams advance together, below

    def _after_update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                      starts: dict[int, int], result: EngineCoreOutputs) -> None:
        super()._after_update(scheduler_output, runner_output, starts, result)
        groups, self._beam_groups = self._beam_groups, {}
        for group in groups.values():
            self._beam_step(group, runner_output, result)

    def _beam_step(self, group: SequenceGroup, runner_output: ModelRunnerOutput, result: EngineCoreOutputs) -> None:
        """Extend a beam-search request by one token per beam (beam_search_step), from the
        top logprobs the runner returned for each beam."""
        beams = group.get_seqs(SequenceStatus.RUNNING)
        if not all(b.seq_id in runner_output.logprobs for b in beams):
            return                       # not sampled this step (e.g. mid-recompute)
        candidates = {b.seq_id: runner_output.logprobs[b.seq_id] for b in beams}
        state = self.beam_states[group.request_id]
        forked = beam_search_step(group, state, candidates, group.request.eos_token_ids, self.max_model_len,
                                  self._fork)
        for seq_id in forked:
            self.runner_view.forget(seq_id)
        if self.runner_view.runner_appends_samples:     # it appended the token it sampled,
            for seq in beams:                          # which a beam may not have kept
                self.runner_view.forget(seq.seq_id)
        self.num_generated_tokens += len(beams)
        if state.done:
            for seq in beams:
                self.queues.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
            result.outputs += finished_outputs(group, state)
