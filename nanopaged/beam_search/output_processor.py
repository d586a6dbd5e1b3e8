"""Beam search, the output side: a search's hypotheses arrive all at once when it is done,
each whole (BeamSearchHypothesis: all its tokens, its cumulative logprob and score), and
are decoded whole; there may be fewer than beam_width of them. The request shows one
output, its last (FINAL_ONLY)."""
from __future__ import annotations

from ..engine.output_processor import CompletionState, OutputProcessor, RequestState
from ..messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from ..sampling_params import RequestOutputKind
from .messages import BeamSearchHypothesis, BeamSearchRequest


class BeamSearchRequestState(RequestState):
    """A beam search's state: no completion until its hypotheses come (done)."""

    def __init__(self, request: BeamSearchRequest, prompt: str | None, tokenizer) -> None:
        super().__init__(request, prompt, 0, tokenizer)
        self.output_kind = RequestOutputKind.FINAL_ONLY
        self.prompt_logprobs = None
        self.done = False

    @property
    def finished(self) -> bool:
        return self.done


class BeamSearchOutputProcessor(OutputProcessor):
    """OutputProcessor that gives a BeamSearchRequest its hypotheses as completions."""

    def _request_state(self, request: EngineCoreRequest, prompt: str | None, n: int) -> RequestState:
        if isinstance(request, BeamSearchRequest):
            return BeamSearchRequestState(request, prompt, self.tokenizer)
        return super()._request_state(request, prompt, n)

    def _take_output(self, state: RequestState, out: EngineCoreOutput, seqs_to_stop: list[tuple[str, int]]) -> bool:
        if not isinstance(state, BeamSearchRequestState):
            return super()._take_output(state, out, seqs_to_stop)
        self._add_hypothesis(state, out)
        return True

    def _add_hypothesis(self, state: BeamSearchRequestState, out: EngineCoreOutput) -> None:
        """A finished beam search sends all its hypotheses in one step, whole (a
        BeamSearchHypothesis each; a plain output for a request the pool could never
        hold, which ends "length" with no token)."""
        comp = CompletionState(out.index, None, want_logprobs=False)
        comp.token_ids = list(out.new_token_ids)
        comp.text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        if isinstance(out, BeamSearchHypothesis):
            comp.cumulative_logprob, comp.score = out.cumulative_logprob, out.score
        comp.finish_reason = str(out.finish_reason or FinishReason.STOP)
        comp.stop_reason = out.stop_reason
        state.completions[out.index] = comp
        state.done = True
