"""Exercise 13 (chapter 13): draw a block table, as the tracer does."""
from __future__ import annotations

NUMBER = 13
CHAPTER = "13-tracer.md"
TITLE = "Tracer: a block table's rows, where the next token goes"
TARGETS = ["nanopaged.trace.view:TraceView.table_rows",
           "nanopaged.trace.view:TraceView.next_slot"]
TASK = """
Write the part of the tracer's picture that is the paper's Figures 6 and 7: a
sequence's block table, one row per logical block (its physical block, how full it is,
the tokens it holds), and the caption under it that says where the token sampled this
step will have its K/V written: a slot of the last block, or a new block. Both read the
engine's state (the sequence's block table, the block manager's ref counts) and change
nothing. `python -m nanopaged.trace` draws every step with them, and so does the check.
"""
HINT = """
table_rows: bm = self.engine.block_manager, bs = bm.block_size, bt = seq.block_table.
Block i holds min(bs, seq.num_computed_tokens - i * bs) written tokens
(num_computed_tokens, not seq.num_tokens: the token sampled last has no K/V yet), whose
ids are seq.token_ids_slice(i * bs, i * bs + fill). The physical text is str(block_id),
or f"cpu {block_id}" when seq.is_swapped (its table holds CPU-pool blocks); add
f" ×{bm.ref_count[block_id]}" for a device block held more than once.
next_slot: return None unless seq.output_token_ids, seq.num_computed_tokens ==
seq.num_tokens - 1, not seq.is_swapped and not seq.status.is_finished. The new token
goes to position n = seq.num_computed_tokens: offset n % bs of the last block, or a new
block when that is 0. The token's text is repr(self.token(seq.output_token_ids[-1])).
"""


class _Tokenizer:
    """Decodes token id i as "t<i>"."""

    @staticmethod
    def decode(ids):
        return "".join(f"t{i}" for i in ids)


def _view():
    """A TraceView of a stand-in engine: a real BlockManager (8 blocks of 4) and a
    tokenizer that shows token i as t<i>."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from nanopaged.core.block_manager import BlockManager
    from nanopaged.trace.view import TraceView

    bm = BlockManager(num_gpu_blocks=8, block_size=4)
    return TraceView(SimpleNamespace(block_manager=bm, tokenizer=_Tokenizer()), Console(file=io.StringIO()))


def _seq(view, prompt, output, blocks, computed, swapped=False):
    """A running (or, with swapped, a swapped-out) sequence whose table holds `blocks`, with
    `computed` tokens computed; device blocks get a ref count from it."""
    from nanopaged.core.sequence import Sequence, SequenceStatus

    seq = Sequence(0, 0, list(prompt), 4)
    seq.output_token_ids = list(output)
    seq.status = SequenceStatus.SWAPPED if swapped else SequenceStatus.RUNNING
    seq.block_table.block_ids = list(blocks)
    seq.num_computed_tokens = computed
    if not swapped:
        for b in blocks:
            view.engine.block_manager.block_pool.touch(b)
    return seq


def _plain(rows):
    return [tuple(str(cell) for cell in row) for row in rows]


def check_rows():
    """one row per logical block: its index, physical block, filled/block_size and the tokens whose K/V it holds"""
    view = _view()
    seq = _seq(view, range(1, 11), [11], [5, 2, 7], 10)      # 11 tokens; the 11th was just sampled
    got = _plain(view.table_rows(seq))
    want = [("0", "5", "4/4", "t1│t2│t3│t4"), ("1", "2", "4/4", "t5│t6│t7│t8"),
            ("2", "7", "2/4", "t9│t10│·│·")]
    assert got == want, (
        "a sequence of 11 tokens whose table [5, 2, 7] has slots for 10 (the 11th was sampled this step: its K/V "
        f"are written next step), rows (logical, physical, filled, tokens) expected\n{want}\nyou returned\n{got}")
    empty = _seq(view, [1, 2], [], [], 0)
    assert view.table_rows(empty) == [], \
        f"a table with no blocks has no rows; you returned {_plain(view.table_rows(empty))}"


def check_shared_and_swapped():
    """a block held by several tables shows ×ref_count; a swapped-out table shows its CPU blocks"""
    view = _view()
    seq = _seq(view, range(1, 7), [7], [0, 3], 6)
    _seq(view, range(1, 7), [9], [0], 4)                     # a sibling holds block 0 too
    got = [row[1] for row in _plain(view.table_rows(seq))]
    assert got == ["0 ×2", "3"], \
        f"block 0 has ref_count 2, block 3 ref_count 1: physical column {got}, expected ['0 ×2', '3']"
    swapped = _seq(view, range(1, 7), [7], [1, 0], 6, swapped=True)
    got = [row[1] for row in _plain(view.table_rows(swapped))]
    assert got == ["cpu 1", "cpu 0"], (
        f"a swapped-out table lists CPU blocks 1 and 0 (no ref counts there: those are the device pool's): {got}, "
        "expected ['cpu 1', 'cpu 0']")


def check_next_slot():
    """the caption says where the sampled token's K/V go: block b, slot s, or a new block; none when nothing was sampled"""
    from nanopaged.core.sequence import SequenceStatus

    view = _view()
    cases = [(_seq(view, range(1, 7), [7], [3, 1], 6), "next 't7' → block 1, slot 2",
              "6 tokens in blocks [3, 1], a 7th sampled"),
             (_seq(view, range(1, 9), [9], [3, 1], 8), "next 't9' → needs a new block",
              "8 tokens in blocks [3, 1] (both full), a 9th sampled"),
             (_seq(view, range(1, 5), [], [2], 4), None, "a prompt of 4 tokens, nothing sampled yet"),
             (_seq(view, range(1, 7), [7], [1, 0], 6, swapped=True), None, "a sequence swapped out to the CPU pool")]
    waiting = _seq(view, range(1, 7), [7], [], 0)
    waiting.status = SequenceStatus.WAITING
    finished = _seq(view, range(1, 7), [7, 8], [], 0)
    finished.status, finished.num_computed_tokens = SequenceStatus.FINISHED_LENGTH, 7
    cases += [(waiting, None, "a sequence preempted by recompute (no blocks, nothing computed)"),
              (finished, None, "a finished sequence (blocks freed)")]
    for seq, want, what in cases:
        got = view.next_slot(seq)
        assert got == want, f"{what}: you returned {got!r}, expected {want!r}"


def _trace_text():
    """The cow and preempt scenarios (token-id prompts) traced on the tiny model, as text."""
    import io
    from dataclasses import replace

    from rich.console import Console

    from nanopaged import EngineConfig, LLMEngine
    from nanopaged.trace.scenarios import SCENARIOS
    from nanopaged.trace.cli import run_trace

    from . import tiny_model_folder

    text = ""
    for name, prompts in (("cow", [[1, 2, 3, 4, 5, 6, 7]]),
                          ("preempt", [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33, 34]])):
        s = SCENARIOS[name]
        s = replace(s, requests=tuple(replace(r, prompt=p) for r, p in zip(s.requests, prompts)))
        engine = LLMEngine(EngineConfig(model=tiny_model_folder(), block_size=s.block_size,
                                        num_gpu_blocks=s.num_gpu_blocks, num_cpu_blocks=s.num_cpu_blocks,
                                        preemption_mode=s.preemption_mode, attention_backend="torch"))
        console = Console(file=io.StringIO(), width=130, color_system=None, record=True)
        run_trace(engine, s, console)
        text += console.export_text(styles=False)
    return text


def check_engine_runs_on_it():
    """the tracer draws the cow and preempt scenarios on the tiny model with your code as with its own"""
    from . import engines_own

    got = _trace_text().splitlines()
    with engines_own():
        want = _trace_text().splitlines()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.rstrip() == w.rstrip(), (f"line {i + 1} of the trace differs; with your code:\n{g.rstrip()}\n"
                                          f"with the engine's own:\n{w.rstrip()}")
    assert len(got) == len(want), f"your trace has {len(got)} lines, the engine's own {len(want)}"


CHECKS = [check_rows, check_shared_and_swapped, check_next_slot, check_engine_runs_on_it]
