"""Tracer: `python -m nanopaged.trace`, watch the engine think, one step at a time.

    python -m nanopaged.trace [--scenario NAME | --prompt TEXT ...] [--max-tokens N]
        [--steps N] [--no-pause] [--export FILE.svg|FILE.html] [--width N]
        [the engine's flags: --model PATH --block-size 4 --num-gpu-blocks N
         --speculative-config JSON ...]

It runs the real engine on a small pool (block size 4, so paging is visible) and after
every step draws the scheduler's decision (who ran, prefill or decode, who was preempted,
swapped back or finished), what happened to blocks (allocated, shared, copied on write,
cached, evicted, taken back from rejected drafts), each sequence's block table and the
physical pool coloured by owner (view.py), with pipeline parallelism the batches in
flight, and with multi-LoRA each request's adapter and who waits for an adapter slot.
These are the PagedAttention paper's Figures 6 and 7 drawn from a live engine; the
scenarios (scenarios.py) replay them. vLLM has no tracer, only the KV-cache events of
`vllm/distributed/kv_events.py`.

In a terminal Enter shows the next step and q quits; with --no-pause, or without a
terminal, every step is printed. --export FILE.svg writes the trace as SVG, FILE.html
as a replay page (replay.py). Chapter 13 explains it.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Callable

from rich.console import Console
from rich.text import Text

from .. import events as ev
from ..engine.arg_utils import add_cli_args, engine_kwargs
from ..dashboard.sampler import batches_during_step, in_flight_batches
from ..utils.cli import quiet_broken_pipe
from ..dashboard.replay import ReplayRecorder, replay_page
from .scenarios import SCENARIOS, BatchesInFlight, History, Scenario, prompt_scenario
from .view import TraceView

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine


def run_trace(engine: LLMEngine, scenario: Scenario, console: Console, *, steps: int | None = None,
              pause: bool = False, on_step: Callable[[int, list[ev.Event]], None] | None = None) -> History:
    """Run `scenario` on `engine`, drawing each step on `console` (view.py); returns the
    events of each step (index 0: step 1, with the requests added before it).

    A request is added before step `arrival + 1`, or at once if the engine is idle; the
    run ends when nothing is left, or after `steps` steps. pause=True waits for a key
    after each step (q stops). on_step(number, events) runs after each step is drawn.
    With batches in flight (pipeline parallelism) a step's list ends with the tracer's
    BatchesInFlight record. A scenario's LoRA adapters are made in a temporary folder,
    removed when the run ends.

    Raises:
        ValueError: as add_request (e.g. a prompt bigger than the whole pool).
    """
    folder = tempfile.TemporaryDirectory(prefix="nanopaged-trace-lora-") if scenario.lora_adapters else None
    loras = scenario.make_adapters(engine, folder.name) if folder is not None else {}
    view = TraceView(engine, console)
    view.header(scenario, loras)
    log: list[ev.Event] = []
    listen = log.append
    engine.add_observer(listen)
    pending = sorted(scenario.requests, key=lambda r: r.arrival)
    history: History = []
    seq_request: dict[int, str] = {}
    in_flight = in_flight_batches(engine)          # None: one batch at a time (no pipeline)
    try:
        while steps is None or len(history) < steps:
            while pending and (pending[0].arrival <= len(history) or not engine.has_unfinished_requests()):
                r = pending.pop(0)
                engine.add_request(r.request_id, r.prompt, r.params, lora_request=loras[r.lora] if r.lora else None)
            if not engine.has_unfinished_requests():
                break
            engine.step()
            events, after = log[:], in_flight_batches(engine)
            log.clear()
            for e in events:
                if isinstance(e, (ev.RequestAdded, ev.SequenceScheduled)):
                    ids = e.seq_ids if isinstance(e, ev.RequestAdded) else (e.seq_id, *e.forks)
                    seq_request.update(dict.fromkeys(ids, e.request_id))
            if after is not None:
                scheduled = [i for e in events if isinstance(e, ev.SequenceScheduled) for i in (e.seq_id, *e.forks)]
                during = batches_during_step(in_flight, after, scheduled)
                events.append(BatchesInFlight(tuple(tuple(dict.fromkeys(seq_request.get(i, "?") for i in b))
                                                    for b in during)))
            in_flight = after
            history.append(events)
            view.step(len(history), history[-1])
            if on_step is not None:
                on_step(len(history), history[-1])
            if pause and not _next_step_wanted():
                break
    finally:
        engine.remove_observer(listen)
        if folder is not None:
            folder.cleanup()
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


def make_arg_parser() -> argparse.ArgumentParser:
    """The tracer's own flags, then the engine's (engine/arg_utils.py)."""
    ap = argparse.ArgumentParser(prog="python -m nanopaged.trace", description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--scenario", default=None, metavar="NAME",
                      help="; ".join([f"{s.name}: {s.title}" for s in SCENARIOS.values()]) + " (default fig6)")
    what.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT",
                      help="trace your own prompts instead (greedy, all at the start)")
    ap.add_argument("--max-tokens", type=_positive("--max-tokens"), default=8, metavar="N",
                    help="per --prompt (default 8)")
    ap.add_argument("--steps", type=_positive("--steps"), default=None, metavar="N", help="stop after N steps")
    ap.add_argument("--no-pause", action="store_true", help="print every step without waiting for a key")
    ap.add_argument("--export", default=None, metavar="FILE.svg|FILE.html",
                    help="also write the whole trace: .svg the console's pictures, .html a replay page "
                         "(the dashboard, stepped with the arrow keys)")
    ap.add_argument("--width", type=_positive("--width"), default=None, metavar="N",
                    help="characters per line (default: the terminal's; 120 when not a terminal)")
    add_cli_args(ap, "the engine (EngineConfig's fields); a flag not given keeps the scenario's "
                     "(block size 4; a pool of a few blocks and float32, or with --prompt 16 blocks and auto)")
    return ap


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc). Returns the exit status: 0, 1 for an error
    while loading or running (printed), 2 for bad arguments (argparse's usage error)."""
    ap = make_arg_parser()
    args = ap.parse_args(argv)
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
            engine = scenario.build_engine(**engine_kwargs(args))
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
