"""Tracer: `python -m nanopaged.trace`, watch the engine think, one step at a time.

    python -m nanopaged.trace [--model PATH] [--scenario NAME | --prompt TEXT ...]
        [--max-tokens N] [--block-size 4] [--num-gpu-blocks N] [--steps N] [--no-pause]
        [--export FILE.svg|FILE.html] [--width N]
        [--speculative-method ngram|draft_model [--num-speculative-tokens K]
         [--prompt-lookup-min N] [--prompt-lookup-max N] [--draft-model PATH]]

It runs the real engine on the real model (a small pool and block size 4 by default, so
paging is visible) and after every step draws what happened (the events of events.py)
and where everything now lives (read from the block manager):

- the scheduler's decision: who ran, prefill or decode, how many tokens, who was
  preempted and how, who came back from swap, who finished;
- what happened to blocks: allocated, released, shared, copied on write, cached, evicted;
- each sequence's block table: logical -> physical block, fill count, the tokens in it;
- the physical pool as a grid coloured by owner, with ref counts, free and cached blocks;
- the prefix cache, and the CPU swap pool when it holds anything;
- with speculative decoding (--speculative-method, or the `speculative` scenario):
  each sequence's drafts, which were accepted, the model's own token at the first
  rejection, and the blocks taken back (chapter 19).

These are the three columns of the PagedAttention paper's Figures 6 and 7 (logical
blocks, block table, physical blocks), drawn from a live engine rather than by hand; vLLM
itself has no tracer, only the KV-cache events of `vllm/distributed/kv_events.py`.
The scenarios (scenarios.py) replay the paper's figures as real runs. In a terminal,
Enter shows the next step and q quits; with --no-pause, or when stdout is not a
terminal, every step is printed. --export FILE.svg writes the whole trace as SVG (rich
records the console); --export FILE.html writes a replay page instead: the server's
dashboard with a snapshot of every step embedded, stepped with ← and → (replay.py).
Chapter 13 explains it; its figures are exports of this tool.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Callable

from rich.console import Console
from rich.text import Text

from .. import events as ev
from ..utils.cli import quiet_broken_pipe
from .replay import ReplayRecorder, replay_page
from .scenarios import SCENARIOS, History, Scenario, prompt_scenario
from .view import TraceView

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine


def run_trace(engine: LLMEngine, scenario: Scenario, console: Console, *, steps: int | None = None,
              pause: bool = False, on_step: Callable[[int, list[ev.Event]], None] | None = None) -> History:
    """Run a scenario on `engine`, drawing every step on `console` (view.py).

    Each request is added before step `arrival + 1` (at once if the engine is idle);
    then the engine steps until it has nothing left to do, or for `steps` steps. With
    pause=True it waits for a key after each step, and q stops it. on_step(number,
    events) is called after each step is drawn (the replay export's snapshots).

    Returns the events of each step (index 0 is step 1; a request added before a step
    counts in that step). Raises what add_request raises for a request that cannot run
    (ValueError: e.g. a prompt bigger than the whole pool).
    """
    view = TraceView(engine, console)
    view.header(scenario)
    log: list[ev.Event] = []
    listen = log.append
    engine.add_observer(listen)
    pending = sorted(scenario.requests, key=lambda r: r.arrival)
    history: History = []
    try:
        while steps is None or len(history) < steps:
            while pending and (pending[0].arrival <= len(history) or not engine.has_unfinished_requests()):
                r = pending.pop(0)
                engine.add_request(r.request_id, r.prompt, r.params)
            if not engine.has_unfinished_requests():
                break
            engine.step()
            history.append(log[:])
            log.clear()
            view.step(len(history), history[-1])
            if on_step is not None:
                on_step(len(history), history[-1])
            if pause and not _next_step_wanted():
                break
    finally:
        engine.remove_observer(listen)
    view.summary(scenario, history, finished=not (pending or engine.has_unfinished_requests()))
    return history


def _next_step_wanted() -> bool:
    """Wait for a key on the terminal: q (or Ctrl-C / Ctrl-D) quits, anything else goes on."""
    import termios
    import tty
    sys.stderr.write("Enter: next step · q: quit ")
    sys.stderr.flush()
    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)       # keep keys typed ahead
        key = sys.stdin.read(1)
    except KeyboardInterrupt:
        key = "q"
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)
        sys.stderr.write("\r\033[K")
    return key not in ("q", "Q", "\x04", "")


def _positive(name: str):
    """An argparse type: an integer >= 1, or an error naming the flag and the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1, got {value}")
        return value
    return parse


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc). Returns the exit status: 0, 1 for an error
    while loading or running (printed), 2 for bad arguments (argparse's usage error)."""
    ap = argparse.ArgumentParser(prog="python -m nanopaged.trace", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="local HF model folder (Llama, Mistral, Qwen2, Qwen3) or hub id (default: SmolLM2-135M-Instruct)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--scenario", default=None, metavar="NAME",
                      help="; ".join([f"{s.name}: {s.title}" for s in SCENARIOS.values()]) + " (default fig6)")
    what.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT",
                      help="trace your own prompts instead (greedy, all at the start)")
    ap.add_argument("--max-tokens", type=_positive("--max-tokens"), default=8, metavar="N",
                    help="per --prompt (default 8)")
    ap.add_argument("--block-size", type=_positive("--block-size"), default=None, metavar="N",
                    help="tokens per block (default 4)")
    ap.add_argument("--num-gpu-blocks", type=_positive("--num-gpu-blocks"), default=None, metavar="N",
                    help="blocks in the device pool (default: the scenario's small pool; 16 with --prompt)")
    ap.add_argument("--steps", type=_positive("--steps"), default=None, metavar="N", help="stop after N steps")
    ap.add_argument("--no-pause", action="store_true", help="print every step without waiting for a key")
    ap.add_argument("--export", default=None, metavar="FILE.svg|FILE.html",
                    help="also write the whole trace: .svg the console's pictures, .html a replay page "
                         "(the dashboard, stepped with the arrow keys)")
    ap.add_argument("--width", type=_positive("--width"), default=None, metavar="N",
                    help="characters per line (default: the terminal's; 120 when not a terminal)")
    spec = ap.add_argument_group("speculative decoding (chapter 19; default: the scenario's, usually off)")
    spec.add_argument("--speculative-method", choices=["ngram", "draft_model"], default=None,
                      help="propose drafts by prompt lookup, or with a draft model (--draft-model)")
    spec.add_argument("--num-speculative-tokens", type=_positive("--num-speculative-tokens"), default=None,
                      metavar="K", help="drafts per step (default 4)")
    spec.add_argument("--prompt-lookup-min", type=_positive("--prompt-lookup-min"), default=None, metavar="N",
                      help="shortest n-gram matched (ngram)")
    spec.add_argument("--prompt-lookup-max", type=_positive("--prompt-lookup-max"), default=None, metavar="N",
                      help="longest n-gram matched (ngram)")
    spec.add_argument("--draft-model", default=None, metavar="PATH", help="the draft's local HF folder (draft_model)")
    args = ap.parse_args(argv)
    speculative = None
    if args.speculative_method is not None:
        speculative = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens or 4}
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(args, key) is not None:
                speculative[key] = getattr(args, key)
        if args.draft_model is not None:
            speculative["model"] = args.draft_model
    elif any(getattr(args, k) is not None for k in ("num_speculative_tokens", "prompt_lookup_min",
                                                    "prompt_lookup_max", "draft_model")):
        ap.error("--num-speculative-tokens, --prompt-lookup-min/max and --draft-model need --speculative-method")
    if args.scenario is not None and args.scenario not in SCENARIOS:
        ap.error(f"unknown scenario {args.scenario!r}: choose one of {', '.join(SCENARIOS)}")
    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        ap.error(f"--prompt must be non-empty text, got {args.prompt!r}")
    if args.export is not None:
        folder = os.path.dirname(os.path.abspath(args.export))
        if os.path.splitext(args.export)[1].lower() not in (".svg", ".html"):
            ap.error(f"--export must name a .svg or .html file, got {args.export!r}")
        if not os.path.isdir(folder):
            ap.error(f"--export {args.export!r}: the folder {folder!r} does not exist")
    scenario = prompt_scenario(args.prompt, args.max_tokens) if args.prompt else SCENARIOS[args.scenario or "fig6"]

    tty = sys.stdout.isatty()
    svg = args.export is not None and args.export.lower().endswith(".svg")
    console = Console(record=svg, highlight=False, width=args.width or (None if tty else 120))
    err = Console(stderr=True, highlight=False, soft_wrap=True)     # messages are never cut into lines
    try:
        with err.status("loading the model ..."):
            engine = scenario.build_engine(args.model, args.block_size, args.num_gpu_blocks, speculative)
        recorder = ReplayRecorder(engine) if args.export is not None and not svg else None
        run_trace(engine, scenario, console, steps=args.steps, pause=tty and sys.stdin.isatty() and not args.no_pause,
                  on_step=recorder.record if recorder else None)
        if svg:
            console.save_svg(args.export, title=f"nanopaged trace: {scenario.name}")
        elif recorder is not None:
            with open(args.export, "w", encoding="utf-8") as f:
                f.write(replay_page(recorder.snapshots, f"nanopaged trace: {scenario.name}",
                                    f"{scenario.title}. {scenario.watch}"))
        if args.export is not None:
            err.print(f"trace written to {args.export}")
    except (ValueError, OSError, RuntimeError) as e:       # FileNotFoundError is an OSError
        err.print(Text.assemble(("error: ", "red"), str(e)))
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
