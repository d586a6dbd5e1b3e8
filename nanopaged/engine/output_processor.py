"""OutputProcessor: turns the core's token ids into the RequestOutputs a user sees.

The EngineCore speaks only ids: each step it says which tokens each sequence gained
(EngineCoreOutputs, messages.py). Everything that needs the tokenizer or the user's
wishes about the *shape* of the answer happens here, outside the core, one step behind
the forward pass:

    engine_core_outputs = engine_core.step()                 # ids in, ids out
    processed = output_processor.process_outputs(engine_core_outputs)
    # processed.seqs_to_stop: sequences a stop string ended; the core must stop them
    return processed.request_outputs

Per sequence (request_id, index) it keeps the token ids, the text (an incremental
detokenizer), the logprob dicts and why it finished; per request, the prompt logprobs.
Three things need care:

- Stop strings live in text, so they are found here (detokenizer.check_stop_strings)
  and the core is told to stop the sequence (LLMEngine.step calls
  EngineCore.stop_sequences before the next step, so no token is computed in vain;
  a core that runs ahead, as with async scheduling, would compute one more, which
  costs compute and nothing else: the text is cut here).
- Hold-back. While a sequence runs, the text it shows leaves out its last
  len(longest stop string) - 1 characters: they might be the start of a stop string
  that the next token completes, and text once shown cannot be taken back. So every
  delta is final, and the deltas add up exactly to the finished text.
- Output kinds (SamplingParams.output_kind): CUMULATIVE shows everything so far, every
  step; DELTA shows only what is new since that completion's last output; FINAL_ONLY
  shows one output when the request is done.

A feature whose requests come out in another shape (beam search: whole hypotheses at
the end) subclasses it at its hooks (`_request_state`, `_take_output`; features.py
composes the class).

vLLM: `vllm/v1/engine/output_processor.py`, `vllm/v1/engine/detokenizer.py`,
`vllm/v1/engine/logprobs.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .detokenizer import IncrementalDetokenizer, check_stop_strings
from ..messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, Logprobs
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams


@dataclass
class OutputProcessorOutput:
    """What one process_outputs call produced.

    Attributes:
        request_outputs: one RequestOutput per request that has something to show.
        seqs_to_stop: (request_id, index) of sequences a stop string just finished; the
            core still runs them and must be told to stop them and free their blocks.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    seqs_to_stop: list[tuple[str, int]] = field(default_factory=list)


class CompletionState:
    """One sequence: what it has produced, and how much of it has been shown (DELTA)."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None,
                 want_logprobs: bool) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.score: float | None = None
        self.num_shown_tokens = 0         # token ids (and logprob dicts) already in a delta
        self.num_shown_chars = 0          # characters of text already in a delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """One request: its completions (n of them, each with its detokenizer), its prompt
    logprobs, and how to show them."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, n: int, tokenizer) -> None:
        params: SamplingParams = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params
        # the ids check_stop ends a sequence on: its stop_token_ids, and the eos unless ignore_eos
        self.stop_token_ids = params.stop_ids | (frozenset() if params.ignore_eos else request.eos_token_ids)
        self.completions: dict[int, CompletionState] = {
            i: CompletionState(i, IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                params.spaces_between_special_tokens), params.logprobs is not None)
            for i in range(n)}
        self.output_kind = params.output_kind
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.num_shown_prompt_logprobs = 0
        self.num_cached_tokens = 0
        stop = params.stop or []
        self.stop_buffer_length = (max(len(s) for s in stop) - 1
                                   if stop and not params.include_stop_str_in_output else 0)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions.values())


class OutputProcessor:
    """Detokenizes, checks stop strings, gathers logprobs and builds RequestOutputs.

    Args:
        tokenizer: a transformers fast tokenizer (the one the Processor encodes with).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None, n: int) -> None:
        """Start following a request the core has been given.

        Args:
            request: the EngineCoreRequest (its sampling_params say what to show).
            prompt: the user's prompt text, or None when it came as token ids.
            n: its number of completions (sampling_params.n; beam_width for beam search).

        Raises:
            ValueError: request_id is already being followed.
        """
        if request.request_id in self.request_states:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.request_states[request.request_id] = self._request_state(request, prompt, n)

    def _request_state(self, request: EngineCoreRequest, prompt: str | None, n: int) -> RequestState:
        """Hook: the state that follows a new request (add_request's arguments)."""
        return RequestState(request, prompt, n, self.tokenizer)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Forget requests (the core frees their blocks). Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.request_states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    # -- one step ----------------------------------------------------------------------------

    def process_outputs(self, outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        """Fold one step of the core into the requests' states and build their outputs.

        Outputs for requests it does not follow (aborted, or finished by a stop string
        while the core ran them one more step) are ignored. A request whose completions
        have all finished gets its last RequestOutput (finished=True) and is forgotten.
        """
        result = OutputProcessorOutput()
        touched: dict[str, set[int]] = {}      # request_id -> indices that changed
        for out in outputs.outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            changed = touched.setdefault(out.request_id, set())
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if self._take_output(state, out, result.seqs_to_stop):
                changed.add(out.index)

        for rid, changed in touched.items():
            state = self.request_states[rid]
            request_output = self._make_request_output(state, changed)
            if request_output is not None:
                result.request_outputs.append(request_output)
            if state.finished:
                del self.request_states[rid]
        return result

    def _take_output(self, state: RequestState, out: EngineCoreOutput, seqs_to_stop: list[tuple[str, int]]) -> bool:
        """Hook: fold one output into its request's state; True when its completion
        changed (new tokens, or it finished)."""
        comp = state.completions[out.index]
        if comp.finished:
            return False                      # stopped here already; the core had not heard
        if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
        return self._update_completion(state, comp, out, seqs_to_stop)

    def _update_completion(self, state: RequestState, comp: CompletionState,
                           out: EngineCoreOutput, seqs_to_stop: list[tuple[str, int]]) -> bool:
        """Append a step's tokens, text and logprobs; check stop strings. Returns True
        when the completion changed (new tokens, or it finished)."""
        params = state.params
        ids = out.new_token_ids
        # vLLM v1: the eos / stop token id that ended a sequence is kept in token_ids but
        # not decoded into the text, unless include_stop_str_in_output. An eos ends with
        # stop_reason None (vLLM's), so the token says it: a structured output whose
        # grammar completed stops on a token of its text, which is no stop id.
        stop_terminated = out.finish_reason is FinishReason.STOP and ids and ids[-1] in state.stop_token_ids
        to_decode = ids[:-1] if stop_terminated and not params.include_stop_str_in_output else ids
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        # A step may bring several tokens (speculative decoding: accepted drafts and one
        # more). Stop strings are checked after each, as if they had come one a step: the
        # tokens after the one that completes a stop string are dropped.
        kept = len(ids)
        for i, token_id in enumerate(to_decode):
            check_from = len(comp.text)
            comp.text += comp.detokenizer.step(token_id)
            if not params.stop or len(comp.token_ids) + i + 1 <= params.min_tokens:
                continue                      # no stop string may end in the first min_tokens
            match = check_stop_strings(comp.text, len(comp.text) - check_from, params.stop,
                                       params.include_stop_str_in_output)
            if match is not None:
                stop_reason, cut = match
                comp.text = comp.text[:cut]
                if finish_reason is None or i + 1 < len(ids):   # the core runs it still: tell it
                    seqs_to_stop.append((state.request_id, comp.index))
                finish_reason, kept = FinishReason.STOP, i + 1
                break
        comp.token_ids.extend(ids[:kept])
        if out.new_logprobs is not None and comp.logprobs is not None:
            dicts = self._logprob_dicts(out.new_logprobs)[:kept]
            comp.logprobs.extend(dicts)
            comp.cumulative_logprob += sum(row[0] for row in out.new_logprobs.logprobs[:kept])
        if finish_reason is not None:
            comp.finish_reason, comp.stop_reason = str(finish_reason), stop_reason
        return bool(ids) or comp.finished

    def _logprob_dicts(self, logprobs: Logprobs) -> list[dict[int, Logprob]]:
        """One dict per row: the row's first token (sampled, or the prompt token) with its
        own rank, then the top-k with ranks 1..k. Each token is decoded on its own, as
        vLLM does. If the first token is also in the top-k it keeps its own entry."""
        flat = [t for row in logprobs.token_ids for t in row]
        words = iter(self.tokenizer.backend_tokenizer.decode_batch([[t] for t in flat],
                                                                   skip_special_tokens=False))
        dicts = []
        for ids, lps, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks):
            d: dict[int, Logprob] = {}
            for token_id, lp, r in zip(ids, lps, [rank, *range(1, len(ids))]):
                d.setdefault(token_id, Logprob(lp, r, next(words)))
            dicts.append(d)
        return dicts

    # -- building outputs --------------------------------------------------------------------

    def _make_request_output(self, state: RequestState, changed: set[int]) -> RequestOutput | None:
        """The RequestOutput this step shows for a request, or None if it shows nothing."""
        finished = state.finished
        kind = state.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        indices = sorted(changed if delta else state.completions)
        if not indices:
            return None
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[state.num_shown_prompt_logprobs:]
            state.num_shown_prompt_logprobs = len(state.prompt_logprobs)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[_completion_output(state.completions[i], state.stop_buffer_length, delta)
                     for i in indices],
            finished=finished,
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            num_cached_tokens=state.num_cached_tokens)


def _completion_output(comp: CompletionState, stop_buffer_length: int,
                       delta: bool) -> CompletionOutput:
    """A completion as shown now: all of it, or (delta) what is new since it was last
    shown. A running completion holds back its last stop_buffer_length characters."""
    hold_back = 0 if comp.finished else stop_buffer_length
    end = max(0, len(comp.text) - hold_back)
    start = comp.num_shown_chars if delta else 0
    first_token = comp.num_shown_tokens if delta else 0
    if delta:
        comp.num_shown_chars = max(comp.num_shown_chars, end)
        comp.num_shown_tokens = len(comp.token_ids)
    return CompletionOutput(
        index=comp.index, text=comp.text[start:end], token_ids=comp.token_ids[first_token:],
        finish_reason=comp.finish_reason, cumulative_logprob=comp.cumulative_logprob,
        logprobs=None if comp.logprobs is None else comp.logprobs[first_token:],
        stop_reason=comp.stop_reason, score=comp.score)
