"""The tracer, `python -m nanopaged.trace` (nanopaged/trace/: cli.py, view.py, scenarios.py).

Fast tests use the tiny random Llama: the scenarios' mechanics with token-id prompts as
long as the real ones, the command line (bad arguments, --no-pause, --steps, --export,
Enter and q in a terminal). The tests marked slow run the real scenarios on the default
model and check that each shows the transition it exists to show. After every traced
step the event stream is replayed against the block manager (tests/invariants.py)."""
import io
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console

from nanopaged import LLM, SamplingParams
from nanopaged import events as ev
from nanopaged.exercises.ex19_spec_rollback import scripted_drafts
from nanopaged.trace.scenarios import SCENARIOS, BatchesInFlight, TraceRequest, taken_back
from nanopaged.trace.cli import main, run_trace

from invariants import EventReplay, check_block_invariants

ROOT = Path(__file__).resolve().parents[2]


def of(kind, events):
    return [e for e in events if isinstance(e, kind)]


def traced(engine, scenario, **kw):
    """run_trace on a string console, the event replay checked after every step."""
    replay = EventReplay(engine)
    step = engine.step

    def checked_step():
        outputs = step()
        check_block_invariants(engine)
        replay.check()
        return outputs

    engine.step = checked_step
    console = Console(file=io.StringIO(), width=120, highlight=False)
    try:
        history = run_trace(engine, scenario, console, **kw)
    finally:
        del engine.step
        engine.remove_observer(replay.apply)
    return history, console.file.getvalue()


# -- the scenarios ----------------------------------------------------------------------------

PREFIX = list(range(40, 52))                       # three full blocks of 4


def tiny_variant(name):
    """The scenario with token-id prompts as long as the real ones (the tiny tokenizer
    cuts text into many more tokens), so its engine settings make the same point."""
    s = SCENARIOS[name]
    if name == "prefix":
        prompts = [PREFIX + [1, 2, 3], PREFIX + [4, 5, 6]]
    else:
        lengths = {"fig6": [7], "fig7": [7, 6], "cow": [7], "preempt": [6, 4, 5], "speculative": [27],
                   "pipeline": [10, 10], "lora": [6, 4, 5, 7]}[name]
        prompts = [list(range(20 * i + 1, 20 * i + 1 + n)) for i, n in enumerate(lengths)]
    return replace(s, requests=tuple(replace(r, prompt=p) for r, p in zip(s.requests, prompts)))


@contextmanager
def drafts_for(model_dir, scenario, wrong=(36,)):
    """With speculative decoding on, the tiny random model never repeats itself, so
    n-gram lookup finds nothing to draft: inside this block the proposer drafts the
    request's own greedy future instead (computed without speculation), wrong at the
    positions `wrong` (36: the first slot of block 9, as in the real scenario)."""
    if scenario.speculative_config is None:
        yield
        return
    (r,) = scenario.requests
    llm = LLM(str(model_dir), block_size=scenario.block_size, num_gpu_blocks=64, dtype="float32")
    (out,) = llm.generate([r.prompt], r.params, use_tqdm=False)
    with scripted_drafts(r.prompt + list(out.outputs[0].token_ids), set(wrong)):
        yield


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_scenario_makes_its_point_on_the_tiny_model(tiny_model_dir, name):
    scenario = tiny_variant(name)
    engine = scenario.build_engine(str(tiny_model_dir))
    try:
        with drafts_for(tiny_model_dir, scenario):
            history, text = traced(engine, scenario)
    finally:
        engine.shutdown()                       # pipeline: its worker processes
    at = scenario.shown_at(history)
    assert at is not None, text
    assert f"Shown at step {at}: {scenario.transition}." in text
    assert "all requests finished" in text and f"step {len(history)} " in text


def test_a_scenario_that_misses_its_point_says_so(tiny_model_dir):
    scenario = replace(tiny_variant("preempt"), num_gpu_blocks=64)       # room for everyone
    history, text = traced(scenario.build_engine(str(tiny_model_dir)), scenario)
    assert scenario.shown_at(history) is None
    assert "Not shown in this run: one request swapped out and back in" in text


def test_speculative_shows_drafts_kept_the_rejected_one_and_the_block_taken_back(tiny_model_dir):
    scenario = tiny_variant("speculative")
    with drafts_for(tiny_model_dir, scenario):
        history, text = traced(scenario.build_engine(str(tiny_model_dir)), scenario)
    verified = [[(e.start, e.num_accepted, len(e.spec_token_ids), e.num_computed_tokens)
                 for e in of(ev.DraftsVerified, step)] for step in history]
    # step 2: all 4 drafts kept (positions 28-31) and the bonus token; step 3: drafts
    # for 33-36, the one at 36 (block 9's first slot) wrong, so 36 is not computed
    assert verified[:3] == [[], [(27, 4, 4, 32)], [(32, 3, 4, 36)]]
    [scheduled] = of(ev.SequenceScheduled, history[2])
    assert (scheduled.kind, scheduled.start, scheduled.num_tokens, len(scheduled.spec_token_ids)) == ("verify", 32, 5, 4)
    assert [e.block_id for e in of(ev.BlockAllocated, history[2])] == [8, 9]
    [back] = [history[2][i] for i in taken_back(history[2])]
    assert (back.block_id, back.ref_count) == (9, 0)
    assert of(ev.BlockAllocated, history[3])[0].block_id == 9     # from the front of the free queue
    flat = " ".join(text.split())                       # long lines are wrapped at 120 columns
    assert "verify: 5 tokens, positions 27-31 (its last token and 4 drafts)" in flat
    assert "all 4 accepted, then the model's own next token (the bonus):" in flat
    assert "3 accepted" in flat and "rejected at position 36, where the model's own token is" in flat
    assert "A/seq 0 takes back block 9: no accepted token in it; free again: 9" in flat
    assert "speculative decoding: ngram, 4 drafts a step, n-grams of 1-3" in flat
    assert scenario.shown_at(history) == 3


def test_speculative_without_a_rejection_does_not_make_its_point(tiny_model_dir):
    scenario = tiny_variant("speculative")
    with drafts_for(tiny_model_dir, scenario, wrong=()):
        history, text = traced(scenario.build_engine(str(tiny_model_dir)), scenario)
    assert all(e.num_accepted == len(e.spec_token_ids) for step in history for e in of(ev.DraftsVerified, step))
    assert not any(taken_back(step) for step in history)
    assert scenario.shown_at(history) is None and "Not shown in this run: drafts accepted" in text


def test_pipeline_shows_two_batches_in_flight_and_no_request_in_both(tiny_model_dir):
    """At pp=2 with a token budget that one prompt's chunk fills, A's batch and B's are in
    flight together from step 1 on; each step takes in the older one and sends the
    other request's next batch, so they take turns, and no request is ever in both."""
    scenario = tiny_variant("pipeline")
    engine = scenario.build_engine(str(tiny_model_dir))
    try:
        history, text = traced(engine, scenario)
    finally:
        engine.shutdown()
    batches = [[b for e in step if isinstance(e, BatchesInFlight) for b in e.batches] for step in history]
    # 10-token prompts, a budget of 8: two prefill chunks each, then 4 decodes each, in turns
    assert batches[:9] == [[("A",), ("B",)], [("B",), ("A",)]] * 4 + [[("A",), ("B",)]], batches
    assert batches[9] == [("B",)] and all(b == [] for b in batches[10:]), batches     # B's last batch alone
    scheduled = [{e.request_id for e in of(ev.SequenceScheduled, step)} for step in history]
    assert scheduled[0] == {"A", "B"}               # step 1 sent both batches, then each step one
    assert all(s == set(b[-1]) for s, b in zip(scheduled[1:9], batches[1:9])), (scheduled, batches)
    flat = " ".join(text.split())
    assert "in flight batch 1: A (output taken in) · batch 2: B" in flat
    assert "pipeline parallelism: 2 stages (worker processes), up to 2 batches in flight" in flat
    assert scenario.shown_at(history) == 1


def test_lora_shows_a_request_waiting_for_a_slot_then_taking_the_one_left_free(tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    """Three adapters, two slots: A's and B's adapters take both, so C waits (one
    WaitingForLoRASlot, printed) and D, which needs no adapter, joins past it; the step
    after A finishes, C runs. Each table names its request's adapter, and the adapters'
    folder (random ones, made by the tracer, no peft) is gone once the run ends."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scenario = tiny_variant("lora")
    history, text = traced(scenario.build_engine(str(tiny_model_dir)), scenario)
    [wait] = [e for step in history for e in of(ev.WaitingForLoRASlot, step)]
    assert (wait.request_id, wait.lora_int_id, wait.slots) == ("C", 3, (1, 2))
    scheduled = [{e.request_id for e in of(ev.SequenceScheduled, step)} for step in history]
    a_done = next(k for k, step in enumerate(history) if "A" in {e.request_id for e in of(ev.RequestFinished, step)})
    assert scheduled[0] == {"A", "B", "D"} and all("C" not in s for s in scheduled[:a_done + 1])
    assert "C" in scheduled[a_done + 1] and scenario.shown_at(history) == a_done + 2
    flat = " ".join(text.split())
    assert ("C waits for a LoRA slot: its adapter (lora_int_id 3) is in no slot, and all 2 hold adapters in use "
            "(1, 2)") in flat
    assert "A/seq 0 · running · adapter x" in flat and "C/seq 2 · waiting · adapter z" in flat
    assert "D/seq 3 · running logical" in flat                    # the base model: no adapter named
    assert "LoRA: 2 adapter slots of rank 16" in flat and "max_tokens 4, adapter z (lora_int_id 3))" in flat
    assert os.listdir(tmp_path) == []


def test_requests_arrive_at_their_step_and_an_idle_engine_does_not_wait(tiny_model_dir):
    scenario = replace(tiny_variant("prefix"), requests=(
        TraceRequest("A", PREFIX + [1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),
        TraceRequest("B", PREFIX + [2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), arrival=1),
        TraceRequest("C", PREFIX + [3], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), arrival=9)))
    history, _ = traced(scenario.build_engine(str(tiny_model_dir)), scenario)
    added = [[e.request_id for e in of(ev.RequestAdded, step)] for step in history]
    assert added == [["A"], ["B"], [], ["C"]]          # C would arrive at step 10: nobody is left


# -- the command line (tiny model, in process) ------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--num-gpu-blocks", "many"], "argument --num-gpu-blocks: invalid int value: 'many'"),
    (["--enable-prefix-caching", "maybe"], "expected true or false, got 'maybe'"),
    (["--steps", "-3"], "--steps must be an integer >= 1, got -3"),
    (["--scenario", "fig8"], "unknown scenario 'fig8': choose one of fig6, fig7, cow, prefix, preempt, speculative, pipeline"),
    (["--scenario", "fig6", "--prompt", "hi"], "not allowed with argument"),
    (["--prompt", " "], "--prompt must be non-empty text, got [' ']"),
    (["--export", "trace.png"], "--export must name a .svg or .html file, got 'trace.png'"),
    (["--export", "/no/such/folder/t.svg"], "the folder '/no/such/folder' does not exist"),
])
def test_bad_arguments_are_named_with_their_value(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--block-size", "0"], "block_size must be a positive integer, got 0"),
    (["--speculative-config", '{"method": "eagle"}'], "speculative_config.method must be one of"),
    (["--speculative-config", '{"num_speculative_tokens": 0}'],
     "speculative_config.num_speculative_tokens must be a positive integer, got 0"),
])
def test_bad_engine_values_are_errors_naming_the_field(capsys, args, message):
    """The engine's flags are checked where LLM(...)'s arguments are: EngineConfig."""
    assert main(["--prompt", "Hello", *args]) == 1
    assert message in capsys.readouterr().err


def test_a_model_that_cannot_load_is_an_error_not_a_traceback(capsys, tmp_path):
    assert main(["--model", str(tmp_path / "missing"), "--no-pause"]) == 1
    assert "error:" in capsys.readouterr().err


def test_a_prompt_bigger_than_the_pool_is_an_error(capsys, tiny_model_dir):
    assert main(["--model", str(tiny_model_dir), "--prompt", "Hello, my name is nanopaged.", "--num-gpu-blocks", "2",
                 "--block-size", "2"]) == 1
    assert "but the KV cache holds only 2 blocks" in capsys.readouterr().err


def test_without_a_terminal_every_step_is_printed(capsys, tiny_model_dir):
    assert main(["--model", str(tiny_model_dir), "--prompt", "Hello", "Paris", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"─ step (\d+) ─", out) == ["1", "2", "3"]
    assert "3 steps, all requests finished" in out
    assert "A/seq 0 prefill" in out and "B/seq 1 decode: 1 token" in out and "device pool: 16 blocks" in out


def test_speculative_config_turns_speculation_on(capsys, tiny_model_dir):
    assert main(["--model", str(tiny_model_dir), "--prompt", "Hello", "--max-tokens", "3",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}']) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: ngram, 2 drafts a step, n-grams of 1-1" in " ".join(out.split())
    assert "all requests finished" in out


def test_a_bad_speculative_config_is_an_error_not_a_traceback(capsys, tiny_model_dir):
    assert main(["--model", str(tiny_model_dir), "--prompt", "Hello", "--speculative-config", '{"method": "draft_model"}']) == 1
    assert "speculative_config.model is required" in capsys.readouterr().err


def test_steps_stops_early(capsys, tiny_model_dir):
    assert main(["--model", str(tiny_model_dir), "--prompt", "Hello", "--steps", "2", "--no-pause"]) == 0
    assert "2 steps, stopped early" in capsys.readouterr().out


def test_export_svg_writes_the_whole_trace(capsys, tiny_model_dir, tmp_path):
    """(--export FILE.html writes a replay page instead: tests/dashboard/test_replay.py.)"""
    path = tmp_path / "trace.svg"
    assert main(["--model", str(tiny_model_dir), "--prompt", "Hello", "--max-tokens", "2",
                 "--export", str(path)]) == 0
    assert f"trace written to {path}" in capsys.readouterr().err
    root = ET.fromstring(path.read_text())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    shown = "".join(root.itertext()).replace("\xa0", " ")
    assert "step 2" in shown and "device pool" in shown


def test_in_a_terminal_enter_steps_and_q_quits(tiny_model_dir):
    pty = pytest.importorskip("pty")
    import select
    pid, fd = pty.fork()
    if pid == 0:                                              # the child: the tracer on a terminal
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "nanopaged.trace", "--model", str(tiny_model_dir),
                                  "--prompt", "Hello", "--max-tokens", "6"])
    seen = b""

    def read_until(marker: bytes, count: int) -> None:
        nonlocal seen
        while seen.count(marker) < count:
            ready, _, _ = select.select([fd], [], [], 120)
            try:
                seen += os.read(fd, 1 << 16) if ready else b""
            except OSError:                                   # the child has exited
                ready = []
            assert ready, seen[-2000:]

    read_until(b"q: quit", 1)
    os.write(fd, b"\n")
    read_until(b"q: quit", 2)
    os.write(fd, b"q")
    try:
        read_until(b"stopped early", 1)
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert b"2 steps, stopped early" in seen and b"step 3" not in seen


# -- the real scenarios (the default model) ---------------------------------------------------

@pytest.fixture(scope="module")
def real_runs(default_model_dir):
    """Each scenario run once on the default model: name -> (history, text, engine)."""
    runs = {}
    for name, scenario in SCENARIOS.items():
        engine = scenario.build_engine(str(default_model_dir))
        runs[name] = (*traced(engine, scenario), engine)
    return runs


@pytest.mark.slow
def test_fig6_gains_a_block_right_after_the_last_one_fills(real_runs):
    history, text, _ = real_runs["fig6"]
    prefill, fill, grow = history[:3]
    assert [(e.kind, e.num_tokens) for e in of(ev.SequenceScheduled, prefill)] == [("prefill", 7)]
    assert [(e.block_id, e.logical_index) for e in of(ev.BlockAllocated, prefill)] == [(0, 0), (1, 1)]
    assert [(e.kind, e.start) for e in of(ev.SequenceScheduled, fill)] == [("decode", 7)]   # slot 4 of 4
    assert not of(ev.BlockAllocated, fill)
    assert [(e.kind, e.start) for e in of(ev.SequenceScheduled, grow)] == [("decode", 8)]
    assert [(e.block_id, e.logical_index) for e in of(ev.BlockAllocated, grow)] == [(2, 2)]
    assert "→ needs a new block" in text and "A/seq 0 gets new block 2 as logical 2" in text
    assert "Shown at step 3" in text


@pytest.mark.slow
def test_fig7_interleaves_two_requests_in_one_pool(real_runs):
    history, text, _ = real_runs["fig7"]
    owner = {0: "A", 1: "B"}
    order = [owner[e.seq_id] for step in history for e in of(ev.BlockAllocated, step)]
    assert order[:6] == ["A", "A", "B", "B", "A", "B"]
    assert "Shown at step" in text


@pytest.mark.slow
def test_cow_shares_the_prompt_blocks_then_copies_on_write(real_runs):
    history, text, _ = real_runs["cow"]
    shared = of(ev.BlocksShared, history[0])
    assert [(e.seq_id, e.parent_seq_id, e.block_ids) for e in shared] == [(1, 0, (0, 1))]
    assert "0 ×2" in text and "1 ×2" in text                    # ref_count 2 in both tables
    [cow] = of(ev.CopyOnWrite, history[1])
    assert (cow.logical_index, cow.src) == (1, 1)
    assert "Shown at step 2" in text


@pytest.mark.slow
def test_prefix_second_request_hits_the_first_ones_cached_blocks(real_runs):
    history, text, _ = real_runs["prefix"]
    hits = [e for step in history for e in of(ev.PrefixCacheHit, step)]
    assert [e.request_id for e in hits] == ["B"] and len(hits[0].block_ids) >= 2
    assert hits[0].num_tokens == 4 * len(hits[0].block_ids)
    assert "cached" in text and "free, reusable" in text


@pytest.mark.slow
def test_preempt_swaps_one_out_and_in_and_recomputes_another(real_runs):
    history, text, _ = real_runs["preempt"]

    def steps(kind, request_id, **fields):
        return [k for k, step in enumerate(history, start=1) for e in of(kind, step)
                if e.request_id == request_id and all(getattr(e, f) == v for f, v in fields.items())]

    [out], [recompute], [back] = steps(ev.Preempted, "C", mode="swap"), steps(ev.Preempted, "B", mode="recompute"), \
        steps(ev.SwapIn, "C")
    assert out < recompute < back
    assert not steps(ev.Preempted, "A") and len(steps(ev.Preempted, "B")) == len(steps(ev.Preempted, "C")) == 1
    redo = [e for step in history[recompute:] for e in of(ev.SequenceScheduled, step) if e.request_id == "B"][0]
    assert redo.kind == "prefill" and redo.start == 0 and redo.num_tokens > 4       # prompt + output again
    assert "CPU swap pool: 2 blocks, 0 free" in text


@pytest.mark.slow
def test_speculative_accepts_drafts_then_takes_back_a_block_at_the_boundary(real_runs):
    history, text, _ = real_runs["speculative"]
    verified = [[(e.start, e.num_accepted, len(e.spec_token_ids), e.num_computed_tokens)
                 for e in of(ev.DraftsVerified, step)] for step in history]
    assert verified[1:3] == [[(27, 4, 4, 32)], [(32, 3, 4, 36)]]      # chapter 19's trace
    assert [history[2][i].block_id for i in taken_back(history[2])] == [9]
    flat = " ".join(text.split())
    assert "proposed [' lemon', '.', '↵', 'Copy']: 3 accepted, 'Copy' rejected at position 36, where the " \
           "model's own token is '↵'" in flat
    assert "Shown at step 3" in text


@pytest.mark.slow
def test_the_command_exports_fig6_as_svg(tmp_path):
    out = tmp_path / "fig6.svg"
    proc = subprocess.run([sys.executable, "-m", "nanopaged.trace", "--scenario", "fig6", "--export", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Shown at step 3" in proc.stdout
    assert ET.parse(out).getroot().tag.endswith("svg")


def svg_lines(path) -> list[str]:
    """The non-blank text lines of a rich SVG export, whitespace removed (rich writes
    each styled run as a <text> whose clip-path names its line)."""
    lines: dict[int, str] = {}
    for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text"):
        m = re.search(r"line-(\d+)\)", t.get("clip-path", ""))
        if m:
            lines[int(m.group(1))] = lines.get(int(m.group(1)), "") + "".join((t.text or "").split())
    return [line for _, line in sorted(lines.items()) if line]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_chapter_figures_are_what_the_tracer_draws_today(real_runs, name):
    if torch.cuda.is_available():
        pytest.skip("the figures were drawn on the CPU in float32; a GPU in bfloat16 may sample other tokens")
    _, text, _ = real_runs[name]
    fresh = [line for line in ("".join(t.split()) for t in text.splitlines()) if line]
    assert svg_lines(ROOT / "chapters" / "figures" / f"trace-{name}.svg") == fresh, (
        "the figure is stale: regenerate it with "
        f"python -m nanopaged.trace --scenario {name} --export chapters/figures/trace-{name}.svg")
