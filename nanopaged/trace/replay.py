"""The tracer's replay page: `python -m nanopaged.trace --export FILE.html`.

The server's live dashboard (GET /dashboard, nanopaged/entrypoints/openai/dashboard/)
draws DashboardSnapshots (messages.py) as they stream in. Here the same page draws a
traced run offline: after every step the tracer takes a snapshot of the engine, and
the export writes one self-contained HTML file, the dashboard's index.html with its
dashboard.css and dashboard.js inlined and the snapshots embedded as

    <script>window.NANOPAGED_REPLAY = [snapshot of step 1, snapshot of step 2, ...];</script>

so the page steps through them (buttons, ← and →) instead of connecting to a server.
No URL is fetched: the file opens from a disk on a machine with no network.

The snapshot is taken here, from the engine in this process (engine.requests, the
scheduler's queues, the block manager), and from the step's events (events.py).
"""
from __future__ import annotations

import html
import json
import re
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from .. import events as ev
from ..messages import DashboardRequest, DashboardSequence, DashboardSnapshot, DashboardStep

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine

DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "entrypoints" / "openai" / "dashboard"


def dashboard_step(step: int, events: list[ev.Event]) -> DashboardStep:
    """What step `step` decided, from its events: who ran (a SequenceScheduled with
    drafts is a "verify"), who was preempted and how, which blocks were copied on write."""
    return DashboardStep(
        step=step,
        scheduled=[{"request_id": e.request_id, "seq_id": e.seq_id,
                    "kind": "verify" if e.spec_token_ids else e.kind, "num_tokens": e.num_tokens}
                   for e in events if isinstance(e, ev.SequenceScheduled)],
        preempted=[{"request_id": e.request_id, "mode": e.mode} for e in events if isinstance(e, ev.Preempted)],
        copy_on_write=[{"seq_id": e.seq_id, "src": e.src, "dst": e.dst}
                       for e in events if isinstance(e, ev.CopyOnWrite)])


def engine_snapshot(engine: LLMEngine, steps: list[DashboardStep], seconds: float,
                    tokens_per_s: float, show_text: bool = True) -> DashboardSnapshot:
    """The engine's state now, as the dashboard draws it (DashboardSnapshot's fields).

    Args:
        engine: an in-process LLMEngine (read, never changed).
        steps: the decisions since the last snapshot; its step is the last one's.
        seconds: the snapshot's time; tokens_per_s: the rate the caller measured.
        show_text: fill each request's prompt and output (seq 0's) as text.
    """
    bm, s = engine.block_manager, engine.scheduler
    owners: list[dict[str, None]] = [{} for _ in range(bm.num_gpu_blocks)]
    cpu_owners: list[str | None] = [None] * bm.num_cpu_blocks
    queue = {g.request_id: name for name, q in (("running", s.running), ("waiting", s.waiting),
                                                 ("swapped", s.swapped)) for g in q}
    requests = []
    for rid, group in engine.requests.items():
        for seq in group.seqs:
            for b in seq.block_table.block_ids:
                if seq.is_swapped:
                    cpu_owners[b] = rid
                else:
                    owners[b][rid] = None           # each request named once, in table order
        first = group.seqs[0]
        requests.append(DashboardRequest(
            request_id=rid, status=queue.get(rid, "running"), num_prompt_tokens=len(group.prompt_token_ids),
            num_output_tokens=max(len(q.output_token_ids) for q in group.seqs),
            seqs=[DashboardSequence(q.seq_id, list(q.block_table.block_ids), q.is_swapped, q.num_computed_tokens,
                                    q.num_tokens) for q in group.seqs],
            prompt=engine.tokenizer.decode(group.prompt_token_ids) if show_text else None,
            output=engine.tokenizer.decode(first.output_token_ids) if show_text else None))
    cached = set(bm.cached_blocks.values())
    stats = engine.get_stats()
    queries = stats["prefix_cache_queries"]
    return DashboardSnapshot(
        step=steps[-1].step if steps else engine.num_steps, time=seconds, block_size=bm.block_size,
        num_gpu_blocks=bm.num_gpu_blocks, num_cpu_blocks=bm.num_cpu_blocks,
        gpu_ref_count=list(bm.ref_count), gpu_cached=[b in cached for b in range(bm.num_gpu_blocks)],
        gpu_owners=[list(o) for o in owners], cpu_owners=cpu_owners, requests=requests,
        running=[g.request_id for g in s.running], waiting=[g.request_id for g in s.waiting],
        swapped=[g.request_id for g in s.swapped], steps=steps,
        stats={"tokens_per_s": tokens_per_s,
               "kv_usage": 1 - stats["num_free_gpu_blocks"] / max(1, stats["num_total_gpu_blocks"]),
               "prefix_cache_hit_rate": stats["prefix_cache_hits"] / queries if queries else 0.0,
               "num_preemptions": stats["num_preemptions"], "num_copy_on_write": stats["num_copy_on_write"]})


class ReplayRecorder:
    """Takes a snapshot after every traced step: pass its `record` to run_trace as
    on_step. tokens/s is measured as the server's is: tokens generated over the last
    second of wall time (the tracer's steps include its drawing, so it is slow)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.snapshots: list[DashboardSnapshot] = []
        self._start = time.monotonic()
        self._generated: deque[tuple[float, int]] = deque([(self._start, engine.num_generated_tokens)])

    def record(self, step: int, events: list[ev.Event]) -> None:
        now, generated = time.monotonic(), self.engine.num_generated_tokens
        while len(self._generated) > 1 and now - self._generated[1][0] >= 1.0:
            self._generated.popleft()                  # keep one point at least a second old
        then, before = self._generated[0]
        self._generated.append((now, generated))
        rate = (generated - before) / (now - then) if now > then else 0.0
        self.snapshots.append(engine_snapshot(self.engine, [dashboard_step(step, events)], now - self._start, rate))


def replay_page(snapshots: list[DashboardSnapshot], title: str = "nanopaged trace") -> str:
    """The dashboard page with its CSS and JS inlined and `snapshots` embedded: one
    self-contained HTML file that fetches nothing.

    The JSON is written with every "<" as \\u003c (the same string to JSON.parse), so
    no prompt text can close the <script> it sits in."""
    page = (DASHBOARD_DIR / "index.html").read_text()
    css = (DASHBOARD_DIR / "dashboard.css").read_text()
    js = (DASHBOARD_DIR / "dashboard.js").read_text()
    for name, text, tag in (("dashboard.css", css, "</style"), ("dashboard.js", js, "</script")):
        if tag in text.lower():
            raise ValueError(f"{name} contains {tag!r}, which would end its inlined element early")
    data = json.dumps([asdict(s) for s in snapshots], separators=(",", ":")).replace("<", "\\u003c")
    page = _replace_between(page, "css", f"<style>\n{css}</style>")
    page = _replace_between(page, "js", f"<script>window.NANOPAGED_REPLAY = {data};</script>\n<script>\n{js}</script>")
    return page.replace("<title>nanopaged · KV pool and scheduler</title>", f"<title>{html.escape(title)}</title>")


def _replace_between(page: str, name: str, body: str) -> str:
    """page with what lies between <!-- nanopaged:NAME --> and <!-- /nanopaged:NAME -->
    (the markers included) replaced by body."""
    pattern = re.compile(rf"<!-- nanopaged:{name} -->.*?<!-- /nanopaged:{name} -->", re.DOTALL)
    if not pattern.search(page):
        raise ValueError(f"index.html has no <!-- nanopaged:{name} --> section to inline")
    return pattern.sub(lambda _: body, page, count=1)
