"""The tracer's replay page: `python -m nanopaged.trace --export FILE.html`.

The server's live dashboard (GET /dashboard, nanopaged/entrypoints/openai/dashboard/)
draws DashboardSnapshots (messages.py) as they stream in. Here the same page draws a
traced run offline: after every step the tracer takes a snapshot of the engine, and
the export writes one self-contained HTML file, the dashboard's index.html with its
dashboard.css and dashboard.js inlined and the snapshots embedded as

    <script>window.NANOPAGED_REPLAY = [snapshot of step 1, snapshot of step 2, ...];</script>

so the page steps through them (buttons, ← and →) instead of connecting to a server.
No URL is fetched: the file opens from a disk on a machine with no network.

The snapshot of a step is built from the engine in this process (the scheduler's queues
and the block manager, build_snapshot) and from the step's events (dashboard_step).
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
    """What step `step` decided, from its events: who ran (prefill, decode or verify),
    who was preempted and how, which blocks were copied on write."""
    return DashboardStep(
        step=step,
        scheduled=[{"request_id": e.request_id, "seq_id": e.seq_id, "kind": e.kind, "num_tokens": e.num_tokens}
                   for e in events if isinstance(e, ev.SequenceScheduled)],
        preempted=[{"request_id": e.request_id, "mode": e.mode} for e in events if isinstance(e, ev.Preempted)],
        copy_on_write=[{"seq_id": e.seq_id, "src": e.src, "dst": e.dst}
                       for e in events if isinstance(e, ev.CopyOnWrite)])


def build_snapshot(engine: LLMEngine, steps: list[DashboardStep], step: int, now: float,
                   tokens_per_s: float = 0.0) -> DashboardSnapshot:
    """The engine's state now, as a DashboardSnapshot (read, never changed).

    A stand-in, with the same arguments, for the server's build_snapshot
    (nanopaged/engine/dashboard.py, issue 27), which is written at the same time as this
    page; the tracer switches to it once it is in. Requests are listed queue by queue
    (running, swapped, waiting); a finished sequence of an unfinished request (its
    blocks already freed) is left out."""
    s, bm = engine.scheduler, engine.block_manager
    owners: list[list[str]] = [[] for _ in range(bm.num_gpu_blocks)]
    cpu_owners: list[str | None] = [None] * bm.num_cpu_blocks
    requests = []
    for status, queue in (("running", s.running), ("swapped", s.swapped), ("waiting", s.waiting)):
        for group in queue:
            rid, seqs = group.request_id, []
            for seq in group.seqs:
                if seq.status.is_finished:
                    continue
                table = list(seq.block_table.block_ids)
                for b in table:
                    if seq.is_swapped:
                        cpu_owners[b] = rid
                    elif rid not in owners[b]:
                        owners[b].append(rid)            # each request named once, in table order
                seqs.append(DashboardSequence(seq.seq_id, table, seq.is_swapped, seq.num_computed_tokens,
                                              seq.num_tokens))
            requests.append(DashboardRequest(rid, status, len(group.prompt_token_ids),
                                             sum(len(q.output_token_ids) for q in group.seqs), seqs))
    total, queries = bm.num_gpu_blocks, bm.prefix_cache_queries
    stats = {"tokens_per_s": tokens_per_s,
             "kv_usage": (total - bm.get_num_free_gpu_blocks()) / total if total else 0.0,
             "prefix_cache_hit_rate": bm.prefix_cache_hits / queries if queries else 0.0,
             "num_preemptions": s.num_preemptions, "num_copy_on_write": bm.num_copy_on_write,
             "num_generated_tokens": s.num_generated_tokens}
    return DashboardSnapshot(
        step=step, time=now, block_size=bm.block_size, num_gpu_blocks=total, num_cpu_blocks=bm.num_cpu_blocks,
        gpu_ref_count=list(bm.ref_count), gpu_cached=[h is not None for h in bm.block_hash],
        gpu_owners=owners, cpu_owners=cpu_owners, requests=requests,
        running=[g.request_id for g in s.running], waiting=[g.request_id for g in s.waiting],
        swapped=[g.request_id for g in s.swapped], steps=list(steps), stats=stats)


def with_text(snapshot: DashboardSnapshot, engine: LLMEngine) -> DashboardSnapshot:
    """snapshot with each request's prompt and output (its first sequence's) as text,
    as the server's --dashboard-show-text fills them; the tracer's prompts are the
    user's own, so its replay page shows them."""
    for r in snapshot.requests:
        group = engine.requests[r.request_id]
        r.prompt = engine.tokenizer.decode(group.prompt_token_ids)
        r.output = engine.tokenizer.decode(group.seqs[0].output_token_ids)
    return snapshot


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
        snapshot = build_snapshot(self.engine, [dashboard_step(step, events)], step, now - self._start, rate)
        self.snapshots.append(with_text(snapshot, self.engine))


def replay_page(snapshots: list[DashboardSnapshot], title: str = "nanopaged trace", about: str = "") -> str:
    """The dashboard page with its CSS and JS inlined and `snapshots` embedded: one
    self-contained HTML file that fetches nothing. title: the page's; about: a text
    shown above the pools (the scenario: what it is, what to watch).

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
    if about:
        page = page.replace('<p id="about" hidden></p>', f'<p id="about">{html.escape(about)}</p>')
    return page.replace("<title>nanopaged · KV pool and scheduler</title>", f"<title>{html.escape(title)}</title>")


def _replace_between(page: str, name: str, body: str) -> str:
    """page with what lies between <!-- nanopaged:NAME --> and <!-- /nanopaged:NAME -->
    (the markers included) replaced by body."""
    pattern = re.compile(rf"<!-- nanopaged:{name} -->.*?<!-- /nanopaged:{name} -->", re.DOTALL)
    if not pattern.search(page):
        raise ValueError(f"index.html has no <!-- nanopaged:{name} --> section to inline")
    return pattern.sub(lambda _: body, page, count=1)
