"""TraceView: the tracer's pictures of one engine step, drawn with rich.

cli.py drives the engine; after every step it hands this view the step's events
(events.py) and the view draws, from those events and from the engine's current state:

    step 3 ───────────────────────────────────────────
    scheduled  A/seq 0 decode: 1 token, position 8          the decision (events)
    blocks     A/seq 0 gets new block 2 as logical 2        what happened to blocks
    queues     running A · swapped - · waiting -
    A/seq 0 · running                                       each sequence's block table
    logical  physical  filled  tokens
          0         0     4/4  Four│ score│ and│ seven
          1         1     4/4   years│ ago│ our│ relationship
          2         2     1/4   was│·│·│·
    next ' a' → block 2, slot 1                             the token sampled this step
    device pool: 8 blocks, 5 free       prefix cache: ...   the pool, coloured by owner

Colours follow requests (A green, B magenta, ...). In the pool grid a cell shows the
block id (* when the prefix cache names it) and its holders with the ref count
(A×2: two of A's sequences share it; A+B: two requests share a cached prefix); "free"
blocks are empty, "cached" ones are free but still reusable by a prefix-cache hit.
The paper's Figures 6 and 7 draw the same three things: logical blocks, the block table,
physical blocks. With speculative decoding (chapter 19) a verify step also shows each
sequence's drafts, the ones the model accepted, the model's own token where it first
disagreed, and the blocks taken back because they held only rejected drafts' slots.
With pipeline parallelism (chapter 20) a step shows the batches in flight during it.
With multi-LoRA (chapter 22) a sequence's table names its request's adapter, and a step
shows who waits for an adapter slot.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.columns import Columns
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .. import events as ev
from ..dashboard.sampler import lora_names
from .scenarios import BatchesInFlight, taken_back

if TYPE_CHECKING:
    from ..core.sequence import Sequence
    from ..engine.llm_engine import LLMEngine
    from ..lora_request import LoRARequest
    from .scenarios import History, Scenario

PALETTE = ["green", "magenta", "cyan", "yellow", "bright_blue", "red", "bright_green", "bright_magenta"]
CELL_WIDTH = 6              # characters inside one cell of a pool grid
GRID_COLUMNS = 8            # cells per row
MAX_GRID_CELLS = 128        # a bigger pool shows its first 128 blocks


class TraceView:
    """Draws a traced run on a rich Console: a header, then each step, then a summary.

    Args:
        engine: the LLMEngine being traced (read, never changed).
        console: where to draw (Console(record=True) to export it afterwards).
    """

    def __init__(self, engine: LLMEngine, console: Console) -> None:
        self.engine, self.console = engine, console
        self.colours: dict[str, str] = {}             # request id -> colour, in arrival order
        self.seq_request: dict[int, str] = {}         # seq id -> request id
        self._token_text: dict[int, str] = {}
        self._seen: dict[int, Sequence] = {}          # seq id -> its Sequence (kept once it finishes)

    def colour(self, request_id: str) -> str:
        """The request's colour: the next of PALETTE the first time it is seen."""
        return self.colours.setdefault(request_id, PALETTE[len(self.colours) % len(PALETTE)])

    def request(self, request_id: str) -> Text:
        """The request id in its colour."""
        return Text(request_id, style=self.colour(request_id))

    def seq(self, seq_id: int) -> Text:
        """"A/seq 0": a sequence named with its request, in the request's colour."""
        rid = self.seq_request.get(seq_id, "?")
        return Text(f"{rid}/seq {seq_id}", style=self.colour(rid))

    def token(self, token_id: int) -> str:
        """One token as text (tokenizer.decode), newlines and tabs made visible."""
        if token_id not in self._token_text:
            text = self.engine.tokenizer.decode([token_id])
            self._token_text[token_id] = text.replace("\n", "↵").replace("\t", "⇥") or "∅"
        return self._token_text[token_id]

    def tokens(self, token_ids, slots: int) -> Text:
        """The tokens of one block, │-separated, · for each empty slot."""
        parts = [self.token(t) for t in token_ids] + ["·"] * (slots - len(token_ids))
        return Text("│").join(Text(p) for p in parts)

    # -- the trace ------------------------------------------------------------------------------

    def header(self, scenario: Scenario, loras: dict[str, LoRARequest] | None = None) -> None:
        """The scenario, the engine's settings and the requests, in a panel; loras: the
        scenario's adapters by name (Scenario.make_adapters)."""
        e, bm = self.engine, self.engine.block_manager
        body = Text.assemble((scenario.title, "bold"), "\n", scenario.watch, "\n\n",
                             f"model {e.model_path.name} · block size {bm.block_size} · {bm.num_gpu_blocks} "
                             f"device blocks · {bm.num_cpu_blocks} CPU blocks · preemption "
                             f"{e.config.scheduler_config.preemption_mode} · prefix caching "
                             f"{'on' if bm.enable_prefix_caching else 'off'} · weights {e.weights.describe()}")
        sc = e.config.speculative_config
        if sc is not None:
            body.append(f" · speculative decoding: {sc.method}, {sc.num_speculative_tokens} drafts a step"
                        + (f", n-grams of {sc.prompt_lookup_min}-{sc.prompt_lookup_max}" if sc.method == "ngram" else ""))
        pp = e.config.parallel_config.pipeline_parallel_size
        if pp > 1:
            body.append(f" · pipeline parallelism: {pp} stages (worker processes), up to {pp} batches in flight")
        lc = e.config.lora_config
        if lc is not None:
            body.append(f" · LoRA: {lc.max_loras} adapter slot{'s' if lc.max_loras > 1 else ''} of rank "
                        f"{lc.max_lora_rank}")
        for r in scenario.requests:
            p = r.params
            sampling = "greedy" if p.temperature == 0 else f"temperature {p.temperature}, seed {p.seed}"
            when = "at the start" if r.arrival == 0 else f"before step {r.arrival + 1}"
            lora = (loras or {}).get(r.lora)
            adapter = f", adapter {lora.lora_name} (lora_int_id {lora.lora_int_id})" if lora is not None else ""
            body.append_text(Text.assemble("\nrequest ", self.request(r.request_id),
                                           f" ({when}, n={p.n}, {sampling}, max_tokens {p.max_tokens}{adapter}): "
                                           f"{r.prompt!r}"))
        self.console.print(Panel(body, title=f"nanopaged trace · {scenario.name}", title_align="left"))

    def step(self, number: int, events: list[ev.Event]) -> None:
        """Draw step `number`: its events, then the engine's state after it."""
        for e in events:
            if isinstance(e, ev.RequestAdded):
                self.seq_request.update(dict.fromkeys(e.seq_ids, e.request_id))
        self.console.rule(f"step {number}", style="bold")
        self.console.print(self.decision(events))
        self.console.print(self.block_tables())
        below = Table.grid(padding=(0, 4))
        below.add_column(min_width=GRID_COLUMNS * (CELL_WIDTH + 1) + 1)     # never squeeze the grid
        below.add_column()
        below.add_row(Group(*filter(None, (self.pool(), self.cpu_pool()))), self.prefix_cache() or "")
        self.console.print(below)

    def summary(self, scenario: Scenario, history: History, finished: bool) -> None:
        """How many steps ran, and the step where the scenario made its point (if it did)."""
        self.console.rule(f"{len(history)} steps, {'all requests finished' if finished else 'stopped early'}",
                          style="bold")
        if scenario.find is None:
            return
        at = scenario.shown_at(history)
        if at is not None:
            self.console.print(f"Shown at step {at}: {scenario.transition}.")
        elif not finished:
            self.console.print(f"Not shown in these {len(history)} steps: {scenario.transition}.")
        else:
            self.console.print(Text.assemble(("Not shown in this run: ", "bold red"), scenario.transition,
                                             " (with another pool or block size the engine does something else)."))

    # -- the parts of a step --------------------------------------------------------------------

    def decision(self, events: list[ev.Event]) -> Table:
        """The scheduler's decision and what happened to blocks, from the step's events."""
        rows: dict[str, list[Text]] = {k: [] for k in ("added", "scheduled", "in flight", "drafts", "preempted",
                                                       "swapped", "lora", "blocks", "finished", "queues")}
        for e in events:
            if isinstance(e, ev.RequestAdded):
                rows["added"].append(Text.assemble(self.request(e.request_id),
                                                   f": {e.num_prompt_tokens} prompt tokens, seqs {list(e.seq_ids)}"))
            elif isinstance(e, ev.SequenceScheduled):
                last = e.start + e.num_tokens - 1
                where = f"position {e.start}" if e.num_tokens == 1 else f"positions {e.start}-{last}"
                forks = f" (seq {', '.join(map(str, e.forks))} samples from it too)" if e.forks else ""
                k = len(e.spec_token_ids)
                drafts = f" (its last token and {k} draft{'s' if k > 1 else ''})" if k else ""
                rows["scheduled"].append(Text.assemble(self.seq(e.seq_id), f" {e.kind}: {e.num_tokens} token"
                                                       f"{'s' if e.num_tokens > 1 else ''}, {where}{forks}{drafts}"))
            elif isinstance(e, BatchesInFlight) and e.batches:
                rows["in flight"].append(self.batches(e))
            elif isinstance(e, ev.DraftsVerified):
                rows["drafts"].append(self.verified(e))
            elif isinstance(e, ev.Preempted):
                rows["preempted"].append(Text.assemble(self.request(e.request_id), f" by {e.mode}"))
            elif isinstance(e, (ev.SwapOut, ev.SwapIn)):
                out = isinstance(e, ev.SwapOut)
                pairs = ", ".join(f"{a}→cpu {b}" if out else f"cpu {a}→{b}" for a, b in e.block_pairs)
                rows["swapped"].append(Text.assemble(self.request(e.request_id), " out to" if out else " back from",
                                                     f" the CPU pool, blocks copied {pairs}"))
            elif isinstance(e, ev.WaitingForLoRASlot):
                rows["lora"].append(Text.assemble(self.request(e.request_id), (
                    f" waits for a LoRA slot: its adapter (lora_int_id {e.lora_int_id}) is in no slot, and all "
                    f"{len(e.slots)} hold adapters in use ({', '.join(map(str, e.slots))})", "bold")))
            elif isinstance(e, ev.RequestFinished):
                rows["finished"].append(Text.assemble(self.request(e.request_id),
                                                      f" ({', '.join(map(str, e.finish_reasons))}), blocks freed"))
        rows["blocks"] = self.block_lines(events)
        s = self.engine.scheduler
        rows["queues"] = [Text(" · ".join(f"{name} {' '.join(g.request_id for g in q) or '-'}" for name, q in
                                          (("running", s.running), ("swapped", s.swapped), ("waiting", s.waiting))))]
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for name, lines in rows.items():
            if lines:
                grid.add_row(name, Text("\n").join(lines))
        return grid

    def batches(self, e: BatchesInFlight) -> Text:
        """The batches in flight during the step, oldest first: "batch 1: A (output taken
        in) · batch 2: B" (pipeline parallelism)."""
        parts = []
        for i, batch in enumerate(e.batches):
            part = Text(f"batch {i + 1}: ")
            part.append_text(Text(" ").join(self.request(r) for r in batch))
            parts.append(part.append(" (output taken in)" if i == 0 else ""))
        return Text(" · ").join(parts)

    def verified(self, e: ev.DraftsVerified) -> Text:
        """One sequence's drafts after verification: the drafts, how many the model
        accepted, and the model's own token after them (at the first rejected draft's
        position, or the bonus token when all were accepted)."""
        k, a = len(e.spec_token_ids), e.num_accepted
        drafts = "[" + ", ".join(repr(self.token(t)) for t in e.spec_token_ids) + "]"
        line = Text.assemble(self.seq(e.seq_id), f" proposed {drafts}: {'all ' if a == k else ''}{a} accepted")
        seq = self._seen.get(e.seq_id)
        position = e.start + 1 + a                  # the token the model chose itself
        own = (self.token(seq.token_ids_slice(position, position + 1)[0])
               if seq is not None and position < seq.num_tokens else None)
        if a < k:
            line.append(f", {self.token(e.spec_token_ids[a])!r} rejected at position {position}")
            if own is not None:
                line.append(f", where the model's own token is {own!r}")
            line.append(f"; slots from position {e.num_computed_tokens} on taken back")
        elif own is not None:
            line.append(f", then the model's own next token (the bonus): {own!r}")
        return line

    def block_lines(self, events: list[ev.Event]) -> list[Text]:
        """One line per block event, a run of one kind for one sequence merged into one."""
        runs: list[list] = []
        # speculative decoding: the blocks past a sequence's accepted tokens, given back
        # after its drafts were verified (spec_decode.scheduler.free_slots_past_computed)
        back = {id(events[i]) for i in taken_back(events)}
        for e in events:
            last = runs[-1][0] if runs else None
            if (isinstance(e, (ev.BlockAllocated, ev.BlockFreed, ev.BlockCached, ev.BlockEvicted))
                    and type(e) is type(last) and getattr(e, "seq_id", None) == getattr(last, "seq_id", None)
                    and (id(e) in back) == (id(last) in back)):
                runs[-1].append(e)
            else:
                runs.append([e])
        lines = []
        for run in runs:
            e, ids = run[0], ", ".join(str(getattr(x, "block_id", "")) for x in run)
            s = "s" if len(run) > 1 else ""
            if id(e) in back:
                free = ", ".join(str(x.block_id) for x in run if x.ref_count == 0)
                lines.append(Text.assemble(self.seq(e.seq_id), (f" takes back block{s} {ids}: no accepted token "
                                                               f"in {'them' if s else 'it'}", "bold"),
                                           f"; free again: {free}" if free else ""))
            elif isinstance(e, ev.BlockAllocated):
                lines.append(Text.assemble(self.seq(e.seq_id), f" gets new block{s} {ids} as logical "
                                           + ", ".join(str(x.logical_index) for x in run)))
            elif isinstance(e, ev.BlockFreed):
                free = ", ".join(str(x.block_id) for x in run if x.ref_count == 0)
                held = ", ".join(str(x.block_id) for x in run if x.ref_count)
                lines.append(Text.assemble(self.seq(e.seq_id), f" releases block{s} {ids}",
                                           f"; free again: {free}" if free else "",
                                           f"; still held by others: {held}" if held else ""))
            elif isinstance(e, ev.BlockCached):
                lines.append(Text(f"block{s} {ids} named in the prefix cache (full, hashed)", style="dim"))
            elif isinstance(e, ev.BlockEvicted):
                lines.append(Text(f"block{s} {ids} evicted from the prefix cache for reuse", style="dim"))
            elif isinstance(e, ev.BlocksShared):
                lines.append(Text.assemble(self.seq(e.seq_id), f" shares block{'s' if len(e.block_ids) > 1 else ''} "
                                           f"{', '.join(map(str, e.block_ids))} "
                                           "with ", self.seq(e.parent_seq_id), " (ref_count + 1)"))
            elif isinstance(e, ev.PrefixCacheHit):
                hit = (f" prefix-cache hit: reuses blocks {', '.join(map(str, e.block_ids))}, "
                       f"{e.num_tokens} tokens not computed")
                lines.append(Text.assemble(self.seq(e.seq_id), (hit, "bold")))
            elif isinstance(e, ev.CopyOnWrite):
                cow = (f" copy-on-write: its logical block {e.logical_index} was shared block {e.src}, "
                       f"copied to block {e.dst}")
                lines.append(Text.assemble(self.seq(e.seq_id), (cow, "bold")))
        return lines

    def block_tables(self) -> Columns:
        """Each unfinished sequence's block table: logical -> physical (×ref_count), fill, tokens;
        its title names its state, and the adapter its request runs with (multi-LoRA)."""
        tables, adapters = [], lora_names(self.engine) or {}
        for rid, group in self.engine.requests.items():
            for seq in group.seqs:
                self.seq_request[seq.seq_id] = rid
                self._seen[seq.seq_id] = seq
                bt = seq.block_table
                where = "CPU pool (swapped out)" if seq.is_swapped else seq.status.name.lower()
                if rid in adapters:
                    where += f" · adapter {adapters[rid]}"
                t = Table(title=Text.assemble(self.seq(seq.seq_id), f" · {where}"), title_justify="left",
                          box=None, pad_edge=False, header_style="dim", caption_justify="left")
                for name in ("logical", "physical", "filled"):
                    t.add_column(name, justify="right")
                t.add_column("tokens")
                for logical, physical, filled, tokens in self.table_rows(seq):
                    cell = Text(physical, style=self.colour(rid))
                    cell.highlight_regex(r" ×\d+", "bold")          # a shared block's ref count
                    t.add_row(logical, cell, filled, tokens)
                if not bt.block_ids:
                    why = "waits to be computed" if seq.status.name == "WAITING" else seq.status.name.lower()
                    t.add_row("-", "-", "-", Text(f"no blocks: {why}", style="dim"))
                t.caption = self.next_slot(seq)
                tables.append(t)
        return Columns(tables, padding=(1, 4))

    def table_rows(self, seq: Sequence) -> list[tuple[str, str, str, Text]]:
        """The rows of seq's block table as the trace draws them, one per logical block i:
        (logical, physical, filled, tokens) =

            str(i);
            the physical block id, "cpu 3" when the table is in the CPU pool (swapped
                out), "5 ×2" when a device block's ref_count is 2 or more;
            "3/4": how many of the block's block_size slots hold tokens whose K/V are
                written (seq.num_computed_tokens counts them);
            those tokens as text, self.tokens(their ids, block_size).
        """
        bm, bs = self.engine.block_manager, self.engine.block_manager.block_size
        bt, rows = seq.block_table, []
        for i, block_id in enumerate(bt.block_ids):
            fill = min(bs, seq.num_computed_tokens - i * bs)
            physical = f"cpu {block_id}" if seq.is_swapped else str(block_id)
            if not seq.is_swapped and bm.ref_count[block_id] > 1:
                physical += f" ×{bm.ref_count[block_id]}"
            tokens = self.tokens(seq.token_ids_slice(i * bs, i * bs + fill), bs)
            rows.append((str(i), physical, f"{fill}/{bs}", tokens))
        return rows

    def next_slot(self, seq: Sequence) -> str | None:
        """The caption under seq's table: where the K/V of the token it sampled this step
        will be written (by the next step, at position num_tokens - 1). None unless seq
        has just sampled (it has output tokens and every token but the last is
        computed) and is not finished and not swapped out. Else "next 'tok' → block 5,
        slot 2" (that slot of the table's last block; tok is repr(self.token(id))), or
        "next 'tok' → needs a new block" when the last block is full."""
        bt, bs = seq.block_table, self.engine.block_manager.block_size
        if (not seq.output_token_ids or seq.num_computed_tokens != seq.num_tokens - 1 or seq.is_swapped
                or seq.status.is_finished):
            return None
        n = seq.num_computed_tokens
        return (f"next {self.token(seq.output_token_ids[-1])!r} → "
                + (f"block {bt.block_ids[-1]}, slot {n % bs}" if n % bs else "needs a new block"))

    def holders(self) -> dict[int, list[str]]:
        """Device block id -> the requests whose sequences hold it, each named once."""
        holders: dict[int, dict[str, None]] = {}
        for rid, group in self.engine.requests.items():
            for seq in group.seqs:
                if not seq.is_swapped:
                    for b in seq.block_table.block_ids:
                        holders.setdefault(b, {})[rid] = None
        return {b: list(rids) for b, rids in holders.items()}

    def pool(self) -> Group:
        """The device pool as a grid of blocks coloured by owner."""
        bm, holders = self.engine.block_manager, self.holders()
        cells = []
        for b in range(min(bm.num_gpu_blocks, MAX_GRID_CELLS)):
            cached = bm.block_hash[b] is not None
            if b in holders:
                label = "+".join(holders[b]) + (f"×{bm.ref_count[b]}" if bm.ref_count[b] > 1 else "")
                style = f"bold black on {self.colour(holders[b][0])}"
            else:
                label, style = ("cached", "italic") if cached else ("free", "dim")
            cells.append(Text(f"{b}{'*' if cached else ''}\n{label}", style=style, justify="center"))
        return _grid(f"device pool: {bm.num_gpu_blocks} blocks, {bm.get_num_free_gpu_blocks()} free", cells,
                     bm.num_gpu_blocks, "owner×ref_count · * named in the prefix cache")

    def cpu_pool(self) -> Group | None:
        """The CPU swap pool, when something is swapped out."""
        bm = self.engine.block_manager
        if bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks:
            return None
        owners = {b: rid for rid, g in self.engine.requests.items() for s in g.seqs if s.is_swapped
                  for b in s.block_table.block_ids}
        cells = [Text(f"cpu {b}\n{owners[b]}", style=f"bold black on {self.colour(owners[b])}", justify="center")
                 if b in owners else Text(f"cpu {b}\nfree", style="dim", justify="center")
                 for b in range(min(bm.num_cpu_blocks, MAX_GRID_CELLS))]
        return _grid(f"CPU swap pool: {bm.num_cpu_blocks} blocks, {bm.get_num_free_cpu_blocks()} free", cells,
                     bm.num_cpu_blocks)

    def prefix_cache(self) -> Table | None:
        """The prefix cache: each named block, its tokens, who holds it (or free, reusable)."""
        bm = self.engine.block_manager
        if not bm.cached_blocks:
            return None
        n, holders = len(bm.cached_blocks), self.holders()
        t = Table(title=f"prefix cache: {n} full block{'s' if n > 1 else ''} named by hash", title_justify="left",
                  box=None, pad_edge=False, header_style="dim")
        for name, justify in (("block", "right"), ("tokens", "left"), ("state", "left")):
            t.add_column(name, justify=justify)
        for b in sorted(bm.cached_blocks.values()):
            state = (Text("held by ") + Text("+").join(map(self.request, holders[b])) if b in holders
                     else Text("free, reusable", style="italic"))
            t.add_row(str(b), self.tokens(bm.block_token_ids[b], bm.block_size), state)
        return t


def _grid(title: str, cells: list[Text], total: int, caption: str | None = None) -> Group:
    """Cells in boxed rows of GRID_COLUMNS under a title (which is not wrapped to the grid)."""
    grid = Table(show_header=False, box=box.SQUARE, padding=0, show_lines=True)
    width = min(GRID_COLUMNS, len(cells))
    for _ in range(width):
        grid.add_column(width=CELL_WIDTH, justify="center")
    for i in range(0, len(cells), width):
        row = cells[i:i + width]
        grid.add_row(*row, *[""] * (width - len(row)))
    notes = [caption] if caption else []
    if total > len(cells):
        notes.append(f"(the first {len(cells)} of {total} blocks)")
    return Group(Text(title), grid, *(Text(n, style="dim") for n in notes))
