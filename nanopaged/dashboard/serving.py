"""Serving the live dashboard: the page, and its stream of snapshots as server-sent events.

    GET /dashboard                 the page (dashboard/page/index.html; plain HTML, CSS, JS)
    GET /dashboard/static/{name}   its dashboard.js and dashboard.css
    GET /dashboard/events          text/event-stream: one `data: <json>\\n\\n` per snapshot
                                   (dataclasses.asdict of a DashboardSnapshot), and a
                                   `: keep-alive` comment line after 15 s without one

The engine core builds a snapshot at most every 0.2 s, and only while a viewer watches:
the DashboardHub here runs a DashboardSampler (dashboard/sampler.py) as a watcher of the
core process (AsyncLLM.watch) while any viewer is connected, fills in the requests' text
if asked (from AsyncLLM's own state: the core knows token ids only), encodes each
snapshot once and puts it in every viewer's mailbox. A mailbox holds one snapshot, the
newest: a viewer that reads slowly, or not at all (its socket's buffers full), skips the
snapshots it had no time for (counted in `dropped`, /metrics'
nanopaged:dashboard_dropped_updates_total). Nothing waits for a viewer: not the engine,
not the output handler, not the other viewers; and a stalled viewer holds one snapshot.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

from .messages import DashboardSnapshot
from .sampler import DashboardSampler

PAGE_DIR = Path(__file__).resolve().parent / "page"
KEEP_ALIVE_S = 15.0                  # a comment line this often keeps proxies from closing the stream
WATCHER = "dashboard"                # the DashboardSampler's name in the core process (AsyncLLM.watch)
_CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                  ".html": "text/html; charset=utf-8"}


def snapshot_json(snapshot) -> str:
    """json.dumps(dataclasses.asdict(snapshot)), compact, without asdict's copies:
    asdict copies every one of the pool's per-block lists in Python, which stalls the
    event loop on a large pool; the dataclasses here hold only plain values and lists,
    so their __dict__s are the same JSON."""
    d = dict(vars(snapshot))
    d["requests"] = [{**vars(r), "seqs": [vars(q) for q in r.seqs]} for r in snapshot.requests]
    d["steps"] = [vars(st) for st in snapshot.steps]
    d["stages"] = [vars(st) for st in snapshot.stages]
    return json.dumps(d, separators=(",", ":"))


class LatestOnly:
    """A one-slot mailbox: `put` never waits and replaces an unread item (a drop);
    `get` waits for an item. Attributes: dropped, the items replaced unread."""

    def __init__(self) -> None:
        self.item: str | None = None
        self.dropped = 0
        self.closed = False
        self._ready = asyncio.Event()

    def close(self) -> None:
        """Wake the reader for good: `get` returns None at once from now on."""
        self.closed = True
        self._ready.set()

    def put(self, item: str) -> None:
        if self.item is not None:
            self.dropped += 1
        self.item = item
        self._ready.set()

    async def get(self, timeout: float) -> str | None:
        """The newest item, or None after timeout seconds without one."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        self._ready.clear()
        item, self.item = self.item, None
        return item


class DashboardHub:
    """The server's dashboard viewers: one watcher of the core process while any watches.

    Args:
        engine: an AsyncLLM (what is used of it: watch, unwatch, and for show_text its
            tokenizer and output_processor.request_states).
        show_text: fill the requests' prompt and output text (--dashboard-show-text);
            without it a snapshot carries ids and counts only.
    """

    def __init__(self, engine, show_text: bool = False) -> None:
        self.engine, self.show_text = engine, show_text
        self.viewers: set[LatestOnly] = set()
        self.latest: str | None = None            # the newest snapshot, as JSON
        self.num_snapshots = 0
        self._dropped_by_gone = 0                 # by viewers that have left
        self._prompt_texts: dict[str, str] = {}   # token-id prompts decoded once (show_text)
        self.closing = False                      # close(): no new streams either

    @property
    def dropped(self) -> int:
        """Snapshots some viewer skipped because it had not read the one before."""
        return self._dropped_by_gone + sum(v.dropped for v in self.viewers)

    def close(self) -> None:
        """The server is stopping: end every viewer's stream (it would otherwise hold the
        graceful shutdown until uvicorn cancels it, logging errors)."""
        self.closing = True
        for box in self.viewers:
            box.close()

    def _on_snapshot(self, snapshot: DashboardSnapshot) -> None:
        """The watcher's callback (AsyncLLM's output handler): the text filled in if
        show_text, encoded once, handed to every viewer (never waits)."""
        if self.show_text:
            snapshot = self._with_text(snapshot)
        self.latest = snapshot_json(snapshot)
        self.num_snapshots += 1
        for box in self.viewers:
            box.put(self.latest)

    async def events(self):
        """One viewer's server-sent events, until it goes (the response is cancelled)."""
        box = LatestOnly()
        if self.closing:
            box.close()
        first = not self.viewers
        self.viewers.add(box)
        try:
            if first:                              # the core sends the current state at once
                self.engine.watch(WATCHER, DashboardSampler, self._on_snapshot)
            elif self.latest is not None:          # current: the core flushes before it idles
                box.put(self.latest)
            yield ": nanopaged dashboard\n\n"      # the headers go out now, not at the first snapshot
            while not box.closed:
                data = await box.get(KEEP_ALIVE_S)
                if box.closed:
                    break                          # the server is stopping: end the stream
                yield ": keep-alive\n\n" if data is None else f"data: {data}\n\n"
        finally:
            self.viewers.discard(box)
            self._dropped_by_gone += box.dropped
            if not self.viewers:
                self.engine.unwatch(WATCHER)

    def _with_text(self, snapshot: DashboardSnapshot) -> DashboardSnapshot:
        """A copy of snapshot with each request's prompt and (first sequence's) output
        text, from the engine's front end (its OutputProcessor's request states)."""
        states, texts = self.engine.output_processor.request_states, {}
        requests = []
        for r in snapshot.requests:
            state = states.get(r.request_id)
            if state is not None:
                first = state.completions.get(0)
                prompt = state.prompt          # None for a prompt of token ids (chat): decoded once
                if prompt is None:
                    prompt = self._prompt_texts.get(r.request_id) or self.engine.tokenizer.decode(
                        state.prompt_token_ids)
                    texts[r.request_id] = prompt
                r = dataclasses.replace(r, prompt=prompt, output=first.text if first is not None else "")
            requests.append(r)
        self._prompt_texts = texts
        return dataclasses.replace(snapshot, requests=requests)


def page_file(name: str) -> tuple[bytes, str] | None:
    """(content, content type) of a file of the page's folder, or None (no such file,
    or a name that is not a plain file name: no path ever leaves the folder)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+\.(html|js|css)", name):
        return None
    path = PAGE_DIR / name
    if not path.is_file():
        return None
    return path.read_bytes(), _CONTENT_TYPES[path.suffix]
