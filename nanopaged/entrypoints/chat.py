"""Chat REPL: `python -m nanopaged.chat`, a multi-turn conversation with the model.

    python -m nanopaged.chat [--max-tokens N] [--temperature T] [--top-p P] [--system TEXT]
        [--chat-template-kwargs JSON] [--lora [NAME=]PATH]
        [the engine's flags: --model PATH --dtype D --seed S ...]

Each turn renders the whole conversation with the chat template (the oldest turns
dropped until --max-tokens fits in max_model_len), sends it as one request, and prints
the text deltas as the engine makes them. /reset forgets the conversation, /exit (or end
of input) quits, Ctrl-C stops an answer (its request aborted). Works with stdin piped:
`printf 'What is the capital of France?\\n' | python -m nanopaged.chat`. With --lora
every turn runs with that LoRA adapter (a PEFT folder; it turns --enable-lora on).
(vLLM's `vllm chat` is a client of its server; this one runs the engine in this process.)
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import signal
import sys

from ..engine.arg_utils import add_cli_args, engine_kwargs
from ..engine.processor import apply_chat_template, check_chat_template_kwargs
from ..lora_request import LoRARequest
from ..sampling_params import RequestOutputKind, SamplingParams
from ..utils.cli import quiet_broken_pipe


def build_prompt(tokenizer, messages: list[dict], max_prompt_tokens: int,
                 chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the conversation (chat template + generation prompt, as LLM.chat's),
    the oldest turns dropped (never the system message) until they fit max_prompt_tokens.

    Raises:
        ValueError: the last message alone does not fit.
    """
    msgs = list(messages)
    while True:
        ids = apply_chat_template(tokenizer, msgs, chat_template_kwargs)   # the template's ids: one BOS
        if len(ids) <= max_prompt_tokens:
            return ids
        first = 1 if msgs and msgs[0]["role"] == "system" else 0
        if len(msgs) - first <= 1:
            raise ValueError(f"message is {len(ids)} tokens; the model takes at most {max_prompt_tokens}")
        del msgs[first]


def prompt_budget(engine, max_tokens: int) -> int:
    """The longest prompt of a turn, in tokens: max_tokens must fit after it in
    max_model_len (vLLM's rule, the Processor's), one more token in the KV pool.

    Raises:
        ValueError: max_tokens leaves no room.
    """
    max_model_len, bm = engine.config.max_model_len, engine.block_manager
    if max_tokens >= max_model_len:
        raise ValueError(f"--max-tokens {max_tokens} leaves no room for a prompt: this model's maximum "
                         f"context length is {max_model_len} tokens (prompt + answer)")
    return min(max_model_len - max_tokens, bm.num_gpu_blocks * bm.block_size - 1)


def stream_answer(engine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  out=sys.stdout, lora_request: LoRARequest | None = None) -> str:
    """Run one request to completion (with `lora_request`'s adapter, if given), writing
    its text to `out` as it grows; returns the text, partial if Ctrl-C stopped it.
    Raises ValueError as add_request.
    """
    params = copy.copy(params)
    params.output_kind = RequestOutputKind.DELTA            # each output: the new text only
    engine.add_request(request_id, prompt_ids, params, lora_request=lora_request)   # may raise: nothing to undo
    stop = []       # Ctrl-C is only noted: the abort comes between two steps, never inside one
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    text = ""
    try:
        while engine.has_unfinished_requests():
            if stop:
                engine.abort_request(request_id)
                out.write(" [stopped]")
                break
            for output in engine.step():
                if output.request_id == request_id and output.outputs:
                    delta = output.outputs[0].text
                    out.write(delta)
                    out.flush()
                    text += delta
    finally:
        signal.signal(signal.SIGINT, previous)
    out.write("\n")
    out.flush()
    return text


def lora_flag(text: str | None) -> LoRARequest | None:
    """--lora's adapter: NAME=PATH, or PATH (named after its folder); None if not given.
    A path that is a folder is taken whole, "=" and all."""
    if text is None:
        return None
    name, sep, path = text.partition("=")
    if not sep or os.path.isdir(text):
        name, path = os.path.basename(os.path.normpath(text)), text
    return LoRARequest(name, 1, path)                  # ValueError naming the field if empty


def check_adapter(engine, lora_request: LoRARequest) -> None:
    """Raises ValueError (naming the file and the field) when the engine cannot serve the
    adapter. add_request checks a request whole before any work is done for it, so a
    request added and aborted at once checks the folder now, not at the first turn."""
    engine.add_request("chat-adapter-check", [0], SamplingParams(max_tokens=1), lora_request=lora_request)
    engine.abort_request("chat-adapter-check")


def _json_flag(flag: str, text: str | None):
    """The value of a JSON flag (None if not given); ValueError naming the flag if not JSON."""
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not JSON: {e}") from None


def make_arg_parser() -> argparse.ArgumentParser:
    """The chat's own flags, then the engine's (engine/arg_utils.py)."""
    ap = argparse.ArgumentParser(
        prog="python -m nanopaged.chat", description=__doc__.split("\n")[0],
        epilog="In the chat: /reset forgets the conversation, /exit (or end of input, Ctrl-D) quits, "
               "Ctrl-C stops an answer. Piped: printf 'What is the capital of France?\\n' | "
               "python -m nanopaged.chat")
    ap.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    ap.add_argument("--temperature", type=float, default=0.2, help="0 = greedy (default 0.2, SmolLM2's advice)")
    ap.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    ap.add_argument("--system", default=None, help="system message (default: the template's own)")
    ap.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help="extra chat template variables, as vLLM's chat_template_kwargs: "
                         "'{\"enable_thinking\": false}' (Qwen3: answer without thinking)")
    ap.add_argument("--lora", default=None, metavar="[NAME=]PATH",
                    help="run every turn with this LoRA adapter, a PEFT folder (adapter_config.json and "
                         "adapter_model.safetensors); turns --enable-lora on")
    add_cli_args(ap, "the engine (EngineConfig's fields); turn k samples with seed --seed + k, "
                     "so answers are reproducible")
    return ap


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    """Returns 0, 1 for an error while loading (printed), 130 for Ctrl-C while loading."""
    args = make_arg_parser().parse_args(argv)

    from rich.console import Console
    from rich.markup import escape
    err = Console(stderr=True)
    try:
        # fail on bad sampling flags before loading anything
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                       seed=getattr(args, "seed", None))
        template_kwargs = _json_flag("--chat-template-kwargs", args.chat_template_kwargs)
        check_chat_template_kwargs(template_kwargs)
        lora = lora_flag(args.lora)
        kwargs = engine_kwargs(args)
        if lora is not None:
            if kwargs.get("enable_lora") is False:
                raise ValueError("--lora needs LoRA in the engine: leave --no-enable-lora out")
            kwargs["enable_lora"] = True
        with err.status("loading the model ..."):
            from .llm import LLM
            engine = LLM(**kwargs).engine
        if lora is not None:
            check_adapter(engine, lora)
        prompt_limit = prompt_budget(engine, args.max_tokens)
        seed = engine.config.seed
    except (ValueError, TypeError, OSError, RuntimeError) as e:   # OSError: a missing model path, a file for a folder
        err.print("[red]error:[/red]", escape(str(e)), soft_wrap=True)   # as written: a path stays whole
        return 1
    except KeyboardInterrupt:            # Ctrl-C while loading: just leave
        return 130

    tokenizer = engine.tokenizer
    interactive = sys.stdin.isatty()
    if interactive:
        adapter = "" if lora is None else f" with LoRA adapter {escape(lora.lora_name)}"
        err.print(f"[dim]nanopaged chat - {engine.model_path.name}{adapter}. /reset clears the "
                  "conversation, /exit quits, Ctrl-C stops an answer.[/dim]")
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    for turn in itertools.count():
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except KeyboardInterrupt:
            print()
            continue
        except EOFError:
            if interactive:
                print()                  # leave the shell prompt on a line of its own
            line = ""
        if not line:                      # end of input
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(system)
            err.print("[dim](conversation cleared)[/dim]")
            continue
        messages.append({"role": "user", "content": line})
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=seed + turn)
        try:
            prompt_ids = build_prompt(tokenizer, messages, prompt_limit, template_kwargs)
            answer = stream_answer(engine, f"chat-{turn}", prompt_ids, params, lora_request=lora)
        except ValueError as e:            # too long for the model or for the KV pool: the engine's message
            err.print("[red]error:[/red]", escape(str(e)), soft_wrap=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})
    return 0


if __name__ == "__main__":
    sys.exit(main())
