"""The tracer's replay page, `python -m nanopaged.trace --export FILE.html`
(nanopaged/dashboard/replay.py), and the dashboard page it inlines
(nanopaged/dashboard/page/).

No browser here: the page's structure, the snapshots it embeds (one per step, parsed
back from the file, checked against what the engine did), that it fetches nothing,
and that chapter 13's replay figures are pages of the current code. A browser test
drives the page itself."""
import io
import json
import re
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest
import torch
from rich.console import Console

from nanopaged import SamplingParams
from nanopaged import events as ev
from nanopaged.dashboard.messages import DashboardRequest, DashboardSequence, DashboardSnapshot, DashboardStep
from nanopaged.trace.cli import main, run_trace
from nanopaged.dashboard.replay import DASHBOARD_DIR, ReplayRecorder, replay_page
from nanopaged.trace.scenarios import SCENARIOS, TraceRequest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "chapters" / "figures"
EMBEDDED = re.compile(r"<script>window\.NANOPAGED_REPLAY = (.*?);</script>", re.S)


def embedded(page: str) -> list[dict]:
    """The snapshots a replay page embeds, parsed back."""
    (data,) = EMBEDDED.findall(page)
    return json.loads(data)


def from_dict(d: dict) -> DashboardSnapshot:
    """A snapshot parsed back from JSON, as the dataclass (the inverse of asdict)."""
    d = dict(d, requests=[DashboardRequest(**dict(r, seqs=[DashboardSequence(**q) for q in r["seqs"]]))
                          for r in d["requests"]], steps=[DashboardStep(**s) for s in d["steps"]])
    return DashboardSnapshot(**d)


def replayed(engine, scenario):
    """run_trace with a ReplayRecorder: (history, the snapshots as JSON would carry them)."""
    recorder = ReplayRecorder(engine)
    history = run_trace(engine, scenario, Console(file=io.StringIO()), on_step=recorder.record)
    return history, json.loads(json.dumps([asdict(s) for s in recorder.snapshots]))


def tiny(name, prompts):
    s = SCENARIOS[name]
    return replace(s, requests=tuple(replace(r, prompt=p) for r, p in zip(s.requests, prompts)))


def state(snapshot, block):
    """A device block's state as the page names it (data-state)."""
    ref = snapshot["gpu_ref_count"][block]
    return "shared" if ref > 1 else "used" if ref else "cached" if snapshot["gpu_cached"][block] else "free"


# -- the snapshots ------------------------------------------------------------------------------

def test_a_snapshot_per_step_with_the_shared_blocks_and_the_copy_on_write(tiny_model_dir):
    scenario = tiny("cow", [[1, 2, 3, 4, 5, 6, 7]])
    history, snaps = replayed(scenario.build_engine(str(tiny_model_dir)), scenario)
    assert [s["step"] for s in snaps] == list(range(1, len(history) + 1))
    assert all(len(s["steps"]) == 1 and s["steps"][0]["step"] == s["step"] for s in snaps)
    first = snaps[0]
    assert first["running"] == ["A"] and [r["request_id"] for r in first["requests"]] == ["A"]
    assert [q["block_table"] for q in first["requests"][0]["seqs"]] == [[0, 1], [0, 1]]      # seq 1 forked seq 0
    assert [state(first, b) for b in (0, 1, 2)] == ["shared", "shared", "free"]
    assert first["gpu_owners"][:3] == [["A"], ["A"], []] and first["gpu_ref_count"][:2] == [2, 2]
    assert first["steps"][0]["scheduled"] == [{"request_id": "A", "seq_id": 0, "kind": "prefill", "num_tokens": 7}]
    [cow] = [e for e in history[1] if isinstance(e, ev.CopyOnWrite)]
    assert snaps[1]["steps"][0]["copy_on_write"] == [{"seq_id": cow.seq_id, "src": cow.src, "dst": cow.dst}]
    assert snaps[1]["stats"]["num_copy_on_write"] == 1
    assert snaps[-1]["requests"] == [] and all(o == [] for o in snaps[-1]["gpu_owners"])
    assert {f.name for f in fields(DashboardSnapshot)} == set(first)


def test_a_swapped_request_sits_in_the_cpu_pool_and_the_swapped_queue(tiny_model_dir):
    scenario = tiny("preempt", [list(range(1, 7)), list(range(21, 25)), list(range(41, 46))])
    history, snaps = replayed(scenario.build_engine(str(tiny_model_dir)), scenario)
    out = next(k for k, step in enumerate(history) for e in step if isinstance(e, ev.Preempted) and e.mode == "swap")
    s = snaps[out]
    [victim] = s["swapped"]
    assert {"request_id": victim, "mode": "swap"} in s["steps"][0]["preempted"]
    [request] = [r for r in s["requests"] if r["request_id"] == victim]
    assert request["status"] == "swapped" and all(q["on_cpu"] for q in request["seqs"])
    held = [b for q in request["seqs"] for b in q["block_table"]]
    assert held and all(s["cpu_owners"][str(b)] == victim for b in held)      # JSON: string keys
    assert all(victim not in owners for owners in s["gpu_owners"])


def test_a_finished_requests_blocks_are_free_but_cached(tiny_model_dir):
    prefix = list(range(40, 52))
    scenario = replace(SCENARIOS["prefix"], requests=(
        TraceRequest("A", prefix + [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),))
    _, snaps = replayed(scenario.build_engine(str(tiny_model_dir)), scenario)
    assert snaps[0]["stats"]["kv_usage"] == pytest.approx(4 / 12)
    assert [state(snaps[0], b) for b in range(5)] == ["used"] * 4 + ["free"]
    assert [state(snaps[-1], b) for b in range(5)] == ["cached"] * 4 + ["free"]      # 16 tokens: 4 full blocks
    assert snaps[-1]["stats"]["kv_usage"] == 0 and snaps[-1]["requests"] == []


# -- the page -----------------------------------------------------------------------------------

def one_snapshot(prompt: str) -> DashboardSnapshot:
    return DashboardSnapshot(
        step=1, time=0.5, block_size=4, num_gpu_blocks=2, num_cpu_blocks=0, gpu_ref_count=[1, 0],
        gpu_cached=[False, False], gpu_owners=[["A"], []], cpu_owners={},
        requests=[DashboardRequest("A", "running", 3, 0, [DashboardSequence(0, [0], False, 3, 3)], prompt=prompt)],
        running=["A"], waiting=[], swapped=[],
        steps=[DashboardStep(1, scheduled=[{"request_id": "A", "seq_id": 0, "kind": "prefill", "num_tokens": 3}])])


def test_the_page_inlines_its_css_and_js_and_fetches_nothing():
    page = replay_page([one_snapshot("hi")], "a title")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert (DASHBOARD_DIR / "dashboard.css").read_text() in page and (DASHBOARD_DIR / "dashboard.js").read_text() in page
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=|<link[^>]*\shref=", page)
    assert "<title>a title</title>" in page and "nanopaged:css" not in page and "nanopaged:js" not in page
    assert embedded(page) == [asdict(one_snapshot("hi"))]


def test_a_prompt_cannot_close_the_script_it_is_embedded_in():
    prompt = "</script><script>alert(1)</script><!-- x"
    page = replay_page([one_snapshot(prompt)])
    assert page.count("</script>") == 2            # the data's and the dashboard's
    assert embedded(page)[0]["requests"][0]["prompt"] == prompt


def test_every_element_the_script_looks_up_is_in_the_page():
    js, page = (DASHBOARD_DIR / "dashboard.js").read_text(), (DASHBOARD_DIR / "index.html").read_text()
    ids = set(re.findall(r'\$\("([\w-]+)"\)', js)) | {f"{a}-{b}" for a in ("queue", "count")
                                                    for b in ("running", "waiting", "swapped")}
    ids |= {"spark-tokens", "spark-kv", "spark-hit", "replay-position", "block-table"}
    assert ids and {i for i in ids if f'id="{i}"' not in page} == set()


def test_the_legend_comes_before_the_pools_and_the_swap_pool_starts_folded():
    """A default pool's grids are thousands of cells (SmolLM2's swap pool alone 11650):
    the legend sits above them, and the swap pool is a <details>, closed until
    dashboard.js opens it for blocks in use (the browser test watches it do so)."""
    page = (DASHBOARD_DIR / "index.html").read_text()
    assert page.index('id="legend"') < page.index('id="gpu-pool"') < page.index('id="cpu-pool"'), page
    assert re.search(r'<details id="cpu-pool" hidden>\s*<summary><h2>CPU swap pool <span id="cpu-summary"', page)


def test_the_served_page_loads_its_files_and_events_under_its_own_path_without_the_key():
    """The page's files and its event stream are fetched relative to its own path (a
    prefix works), and no URL the page makes carries the key: /dashboard?key= traded it
    for a cookie that the browser sends itself (auth.py; issue 34, the key in a log)."""
    page, js = (DASHBOARD_DIR / "index.html").read_text(), (DASHBOARD_DIR / "dashboard.js").read_text()
    for name in ("static/dashboard.css", "static/dashboard.js"):
        assert f'location.pathname.replace(/\\/+$/, "") + "/{name}"' in page
    assert 'var url = location.pathname.replace(/\\/+$/, "") + "/events";' in js
    assert 'get("key")' not in page + js and '"?key="' not in page + js and "new EventSource(url)" in js


def test_export_html_writes_one_replay_page_with_a_snapshot_per_step(capsys, tiny_model_dir, tmp_path):
    path = tmp_path / "trace.html"
    assert main(["--model", str(tiny_model_dir), "--prompt", "Hello", "Paris", "--max-tokens", "3",
                 "--export", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"trace written to {path}" in err
    assert [p.name for p in tmp_path.iterdir()] == ["trace.html"]
    steps = [int(n) for n in re.findall(r"─ step (\d+) ─", out)]
    snaps = embedded(path.read_text())
    assert [s["step"] for s in snaps] == steps == [1, 2, 3]
    assert snaps[0]["running"] == ["A", "B"] and snaps[0]["requests"][0]["prompt"] == "Hello"
    assert "<title>nanopaged trace: prompt</title>" in path.read_text()
    assert '<p id="about">your prompts. Each step: who runs' in path.read_text()


# -- chapter 13's replay figures ----------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_scenario_has_a_replay_figure_linked_from_chapter_13(name):
    figure = FIGURES / f"trace-{name}.html"
    assert f"(figures/trace-{name}.html)" in (ROOT / "chapters" / "13-tracer.md").read_text()
    page = figure.read_text()
    snaps = embedded(page)
    assert [s["step"] for s in snaps] == list(range(1, len(snaps) + 1)) and snaps[-1]["requests"] == []
    # the page around the snapshots is what the current code writes (else: regenerate it)
    scenario = SCENARIOS[name]
    assert replay_page([from_dict(s) for s in snaps], f"nanopaged trace: {name}",
                       f"{scenario.title}. {scenario.watch}") == page, (
        f"stale: python -m nanopaged.trace --scenario {name} --no-pause --export chapters/figures/trace-{name}.html")


def comparable(snapshot: dict) -> dict:
    """A snapshot without what depends on the machine's speed (time, tokens/s)."""
    return dict(snapshot, time=None, stats=dict(snapshot["stats"], tokens_per_s=None))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_replay_figures_are_the_runs_of_today(default_model_dir, name):
    if torch.cuda.is_available():
        pytest.skip("the figures were made on the CPU in float32; a GPU in bfloat16 may sample other tokens")
    scenario = SCENARIOS[name]
    _, snaps = replayed(scenario.build_engine(str(default_model_dir)), scenario)
    drawn = embedded((FIGURES / f"trace-{name}.html").read_text())
    assert [comparable(s) for s in drawn] == [comparable(s) for s in snaps], (
        f"stale: python -m nanopaged.trace --scenario {name} --no-pause --export chapters/figures/trace-{name}.html")
