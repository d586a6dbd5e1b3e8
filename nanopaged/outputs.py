"""RequestOutput and CompletionOutput: what the engine hands back, in vLLM's shapes.

`LLMEngine.step()` returns a RequestOutput for every request that made progress that
step (text and token ids so far, cumulative); `LLM.generate` returns the final one of
each request, in input order. vLLM: `vllm/outputs.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: which of the request's n completions this is (0..n-1).
        text: the generated text so far (special tokens skipped).
        token_ids: the generated token ids so far (a stop token, if any, included).
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens,
            max_model_len or the KV pool's size), "abort", or None while running.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the id it was added with.
        prompt: the prompt text (None when it was given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: its CompletionOutputs (one per sequence).
        finished: True once every completion has finished.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
