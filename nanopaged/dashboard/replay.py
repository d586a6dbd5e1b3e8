"""The tracer's replay page: `python -m nanopaged.trace --export FILE.html`.

The server's live dashboard page (dashboard/page/) drawing a traced run
offline: after every step the server's own DashboardSampler (dashboard/sampler.py) takes
a snapshot, and the export writes one self-contained HTML file, index.html with its CSS
and JS inlined and the snapshots embedded as

    <script>window.NANOPAGED_REPLAY = [snapshot of step 1, snapshot of step 2, ...];</script>

so the page steps through them (buttons, ← and →). It fetches nothing: it opens from
a disk on a machine with no network.
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from .. import events as ev
from .messages import DashboardSnapshot
from .sampler import DashboardSampler

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine

DASHBOARD_DIR = Path(__file__).resolve().parent / "page"


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
    on_step. It is the server's DashboardSampler, handed each step's events and asked
    for a snapshot after every step rather than at most 5 a second (its tokens/s is
    the tracer's: slow, since each step is drawn too; the replay page hides it)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.sampler = DashboardSampler()
        self.snapshots: list[DashboardSnapshot] = []

    def record(self, step: int, events: list[ev.Event]) -> None:
        for e in events:
            self.sampler(e)
        self.sampler.end_step(step, self.engine)
        snapshot = self.sampler.poll(self.engine, force=True)
        snapshot.step = step       # the tracer's step: a pipeline's last call may take in no batch
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
