"""LLM: the offline entry point, vLLM's `LLM` class.

    from nanopaged import LLM, SamplingParams
    llm = LLM()                                   # the default model (its GGUF file, in float32)
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

`generate` adds every prompt to the engine and calls `engine.step()` until all are
done; continuous batching does the rest. vLLM: `vllm/entrypoints/llm.py`.
"""
from __future__ import annotations

import copy
import itertools
import sys
from typing import Sequence as Seq

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.processor import apply_chat_template
from ..lora_request import LoRARequest
from ..outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from ..sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from ..utils.checks import is_int


class LLM:
    """An engine plus a batch-generation loop.

    Args:
        model: local Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3: model/registry.py), hub id, or None for the default
            model (SmolLM2-135M-Instruct).
        **engine_args: the fields of EngineConfig (dtype, device, block_size,
            num_gpu_blocks, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
            max_model_len, seed, async_scheduling, tensor_parallel_size,
            distributed_executor_backend, ...).

    Raises:
        TypeError: an unknown keyword argument (named in the message).
        ValueError: a bad setting (named with its value).
        FileNotFoundError: a model folder that does not exist or lacks files.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor_parallel_size > 1). Idempotent; the
        LLM cannot generate afterwards. `del llm` and interpreter exit do it too."""
        self.engine.shutdown()

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate completions for a batch of prompts.

        Args:
            prompts: one string, a list of strings, one list of token ids, or a list of
                lists of token ids.
            sampling_params: one SamplingParams for all prompts, or a list with one
                per prompt; None means SamplingParams().
            use_tqdm: show a progress bar (rich) when there is more than one prompt.
            lora_request: the LoRA adapter every prompt runs with (a LoRARequest), or a
                list with one per prompt (None entries: the base model), as vLLM's;
                None: the base model. Needs an engine built with enable_lora=True.

        Returns:
            One finished RequestOutput per prompt, in the order of `prompts`.

        Raises:
            ValueError / TypeError: a bad prompt or parameter, before any generation;
                requests of this call already queued are withdrawn, so the engine is
                left as it was.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompt_list)} prompts")
        else:
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        return self._add_and_run(prompt_list, params, use_tqdm, _per_prompt(lora_request, len(prompt_list)))

    def beam_search(self, prompts: str | list[str] | list[int] | list[list[int]],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's `LLM.beam_search`; see beam_search/scheduler.py).

        Returns one BeamSearchOutput per prompt, in order; its `.sequences` are the best
        hypotheses, best first, each with `.tokens` (prompt + generated), `.text` and
        `.cum_logprob`. Raises ValueError / TypeError for bad input, before any work.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_list = _as_prompt_list(prompts)
        outs = self._add_and_run(prompt_list, [params] * len(prompt_list), use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.cumulative_logprob,
                                                     c.text, score=c.score, finish_reason=c.finish_reason)
                                  for c in o.outputs]) for o in outs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to chats (vLLM's `LLM.chat`): one conversation as a list of
        {"role": ..., "content": ...} dicts, or a list of such conversations. The
        tokenizer's chat template makes the prompt, generation prompt included, exactly
        as `apply_chat_template(tokenize=True, add_generation_prompt=True,
        **chat_template_kwargs)` (one BOS); the ids go to `generate`.

        Args:
            chat_template_kwargs: extra variables for the chat template, the same for
                every conversation, as vLLM's `LLM.chat(chat_template_kwargs=...)`: e.g.
                {"enable_thinking": False} makes Qwen3's template write an empty
                <think></think> block, so the model answers without reasoning. A
                variable the template does not use changes nothing.
            lora_request: as `generate`'s, one per conversation when a list.

        Returns one RequestOutput per conversation; raises as `generate`, and
        TypeError / ValueError for bad chat_template_kwargs (a key the engine sets
        itself, such as add_generation_prompt or tokenize, is refused by name).
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts or of such lists")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        for conv in convs:
            if not isinstance(conv, (list, tuple)) or not conv or not all(isinstance(m, dict) for m in conv):
                raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts or of such "
                                f"lists, got a {type(conv).__name__} {conv!r:.40}")
        tokenizer = self.get_tokenizer()
        prompts = [apply_chat_template(tokenizer, list(conv), chat_template_kwargs) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _add_and_run(self, prompt_list: list, params: list, use_tqdm: bool,
                     lora_requests: list | None = None) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, p, lora in zip(prompt_list, params, lora_requests or [None] * len(prompt_list)):
                if isinstance(p, SamplingParams) and p.output_kind != RequestOutputKind.FINAL_ONLY:
                    p = copy.copy(p)                  # we only want each request's last output
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._request_counter))
                self.engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm and len(ids) > 1)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(request_ids)) if use_tqdm else None
        try:
            while len(finished) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        if progress:
                            progress.advance(0)
        except BaseException:
            self.engine.abort_request(r for r in request_ids if r not in finished)
            raise
        finally:
            if progress:
                progress.stop()
        return [finished[r] for r in request_ids]


def _per_prompt(lora_request, num_prompts: int) -> list:
    """One LoRARequest (or None) per prompt: `lora_request` for all, or its list.

    Raises:
        ValueError: a list whose length is not the number of prompts.
    """
    if not isinstance(lora_request, (list, tuple)):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {len(lora_request)} lora_request entries for {num_prompts} prompts")
    return list(lora_request)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is an empty list")
        if all(is_int(t) for t in prompts):
            return [list(prompts)]              # one prompt given as token ids
        return list(prompts)
    raise TypeError(f"prompts must be a str, a list of str, or token id lists; got {type(prompts).__name__}")


def _progress(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.console import Console

    p = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 console=Console(file=sys.stderr), transient=True)
    p.add_task("generate", total=total)
    p.start()
    return p
