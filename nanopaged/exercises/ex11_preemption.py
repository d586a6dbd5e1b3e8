"""Exercise 11 (chapter 11): preempt a request, by swap or by recompute."""
from __future__ import annotations

NUMBER = 11
CHAPTER = "11-preemption.md"
TITLE = "Preemption: choose swap or recompute, and preempt"
TARGETS = ["nanopaged.core.scheduler:Scheduler._should_swap",
           "nanopaged.core.scheduler:Scheduler._preempt"]
TASK = """
Write the scheduler's two preemption functions (PagedAttention §4.5). When a running
request needs a block and none is free, the scheduler takes the latest arrival and
calls _preempt on it. _should_swap picks the way: never swap in "recompute" mode,
recompute whenever the CPU pool cannot take the request's blocks, swap in "swap" mode,
and in "auto" mode ask the measured PreemptionCosts which is cheaper. _preempt then
does it: swap the request's blocks out to the CPU pool (it waits in `swapped`), or free
them and forget their K/V (it waits at the head of `waiting`, to prefill prompt and
output again). Every preemption of the engine goes through your two functions.
"""
HINT = """
_should_swap: the running sequences are group.get_seqs(SequenceStatus.RUNNING); count
their distinct block ids once (a set: forked sequences share blocks) and add up their
num_computed_tokens; the CPU question is self.block_manager.can_swap_out(group).
_preempt: self.num_preemptions += 1; step.preempted = True; swap = self._should_swap(
group); take running = group.get_seqs(SequenceStatus.RUNNING) before changing any status
(a finished sequence stays finished) and self.runner_view.forget(seq.seq_id) each.
Swap: step.blocks_to_swap_out += self.block_manager.swap_out(group), statuses SWAPPED,
self.swapped.appendleft(group), num_preemptions_swap += 1. Recompute: for each,
self.block_manager.free(seq), num_computed_tokens = 0, status WAITING; then
self.waiting.appendleft(group), num_preemptions_recompute += 1.
"""


class _AskedCosts:
    """A PreemptionCosts stand-in that answers `answer` and records what it was asked."""

    def __init__(self, answer: bool) -> None:
        self.answer, self.asked = answer, []

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        self.asked.append((num_blocks, num_tokens))
        return self.answer


def _world(mode, num_cpu_blocks=8, costs=None):
    """A scheduler over an 8-block pool and request "B", taken out of the running queue
    as schedule() does before it preempts: three sequences of one prompt (n=3), two
    running (7 tokens each, 6 computed, sharing block 2: tables [2, 5] and [2, 6]) and
    one finished. Request "C" waits, "D" is swapped out already (in the queues only)."""
    from nanopaged.config import EngineConfig
    from nanopaged.core.block_manager import BlockManager
    from nanopaged.core.scheduler import Scheduler
    from nanopaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
    from nanopaged.messages import EngineCoreRequest
    from nanopaged.sampling_params import SamplingParams

    bm = BlockManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=num_cpu_blocks)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, preemption_mode=mode)
    sched = Scheduler(config, bm, costs=costs)

    def group(rid, prompt):
        request = EngineCoreRequest(rid, prompt, SamplingParams(n=3, max_tokens=10), frozenset(), 1.0)
        return SequenceGroup(request, [Sequence(3 * ord(rid) + i, i, prompt, 4) for i in range(3)])

    b = group("B", [1, 2, 3, 4, 5])
    for seq, own, out in zip(b.seqs, (5, 6), ([7, 8], [9, 10])):
        seq.output_token_ids = list(out)
        seq.status = SequenceStatus.RUNNING
        for block_id in (2, own):
            bm.block_pool.touch(block_id)
            seq.block_table.append_block(block_id)
        seq.num_computed_tokens = 6
        sched.runner_view.known[seq.seq_id] = 7
    done = b.seqs[2]
    done.output_token_ids, done.num_computed_tokens, done.status = [11, 12, 13, 14], 9, SequenceStatus.FINISHED_STOPPED
    sched.waiting.append(group("C", [20, 21, 22]))
    sched.swapped.append(group("D", [30, 31, 32]))
    return sched, b


def _step():
    from nanopaged.core.scheduler_output import ScheduledStep

    return ScheduledStep(budget=64)


def check_should_swap_by_mode():
    """recompute mode never swaps; swap mode swaps when the CPU pool has room for the blocks, and recomputes when it has not"""
    for mode, cpu, want in (("recompute", 8, False), ("swap", 8, True), ("swap", 3, True), ("swap", 2, False),
                            ("swap", 0, False), ("auto", 2, False)):
        sched, b = _world(mode, num_cpu_blocks=cpu, costs=_AskedCosts(True))
        got = sched._should_swap(b)
        assert got is want or got == want, (
            f'preemption_mode "{mode}", a request holding 3 distinct blocks, a CPU pool of {cpu} free blocks: '
            f"you said swap={got}, it is swap={want}" + ("" if cpu >= 3 else " (the CPU pool cannot take them)"))


def check_should_swap_auto_asks_the_costs():
    """auto mode asks PreemptionCosts.prefer_swap with the request's distinct blocks and its running sequences' computed tokens"""
    for answer in (True, False):
        costs = _AskedCosts(answer)
        sched, b = _world("auto", costs=costs)
        got = sched._should_swap(b)
        assert costs.asked, "auto mode with room in the CPU pool: you did not ask self.costs.prefer_swap"
        assert costs.asked[-1] == (3, 12), (
            f"the two running sequences hold blocks [2, 5] and [2, 6] (3 distinct: block 2 is shared and is copied "
            f"once) and have 6 + 6 computed tokens (the finished one does not count): prefer_swap(3, 12); "
            f"you asked prefer_swap{costs.asked[-1]}")
        assert got == answer, f"prefer_swap answered {answer}, and you said swap={got}"


def check_preempt_by_recompute():
    """a recompute preemption frees the blocks, resets num_computed_tokens, and puts the request at the head of waiting"""
    from nanopaged.core.sequence import SequenceStatus

    sched, b = _world("recompute")
    step = _step()
    sched._preempt(b, step)
    bm = sched.block_manager
    assert [s.block_table.block_ids for s in b.seqs[:2]] == [[], []] and bm.get_num_free_gpu_blocks() == 8, (
        f"after a recompute preemption the tables are {[s.block_table.block_ids for s in b.seqs[:2]]} and "
        f"{bm.get_num_free_gpu_blocks()} of 8 blocks are free; expected [[], []] and 8 (block 2 was held twice)")
    assert [s.num_computed_tokens for s in b.seqs[:2]] == [0, 0], \
        f"num_computed_tokens of the running sequences: {[s.num_computed_tokens for s in b.seqs[:2]]}, expected [0, 0]"
    assert [s.status for s in b.seqs] == [SequenceStatus.WAITING, SequenceStatus.WAITING,
                                          SequenceStatus.FINISHED_STOPPED], (
        f"statuses {[s.status.name for s in b.seqs]}: the running ones wait now, the finished one stays finished")
    assert [g.request_id for g in sched.waiting] == ["B", "C"] and [g.request_id for g in sched.swapped] == ["D"], (
        f"queues: waiting {[g.request_id for g in sched.waiting]}, swapped {[g.request_id for g in sched.swapped]}; "
        "expected B at the head of waiting (before C, which arrived later), swapped unchanged")
    _assert_counted(sched, step, swap=0, recompute=1)


def check_preempt_by_swap():
    """a swap preemption sends the blocks to the CPU pool (pairs in blocks_to_swap_out), marks the sequences SWAPPED, and queues the request first in swapped"""
    from nanopaged.core.sequence import SequenceStatus

    sched, b = _world("swap")
    step = _step()
    sched._preempt(b, step)
    bm = sched.block_manager
    pairs = dict(step.blocks_to_swap_out)
    assert sorted(pairs) == [2, 5, 6] and len(step.blocks_to_swap_out) == 3, (
        f"step.blocks_to_swap_out is {step.blocks_to_swap_out}: expected one (device, cpu) pair for each of the "
        "distinct blocks 2, 5, 6, as block_manager.swap_out returns them")
    assert [s.block_table.block_ids for s in b.seqs[:2]] == [[pairs[2], pairs[5]], [pairs[2], pairs[6]]], (
        f"the running sequences' tables should point at CPU blocks now: {[s.block_table for s in b.seqs[:2]]}")
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 5, (
        f"{bm.get_num_free_gpu_blocks()} device and {bm.get_num_free_cpu_blocks()} CPU blocks free, expected 8 and 5")
    assert [s.status for s in b.seqs] == [SequenceStatus.SWAPPED, SequenceStatus.SWAPPED,
                                          SequenceStatus.FINISHED_STOPPED], (
        f"statuses {[s.status.name for s in b.seqs]}: the running ones are SWAPPED, the finished one stays finished")
    assert [s.num_computed_tokens for s in b.seqs[:2]] == [6, 6], \
        "a swapped sequence keeps its K/V (on the CPU): its num_computed_tokens stay 6"
    assert [g.request_id for g in sched.swapped] == ["B", "D"] and [g.request_id for g in sched.waiting] == ["C"], (
        f"queues: swapped {[g.request_id for g in sched.swapped]}, waiting {[g.request_id for g in sched.waiting]}; "
        "expected B at the head of swapped (it goes back first), waiting unchanged")
    _assert_counted(sched, step, swap=1, recompute=0)


def _assert_counted(sched, step, swap, recompute):
    got = (sched.num_preemptions, sched.num_preemptions_swap, sched.num_preemptions_recompute)
    assert got == (1, swap, recompute), (
        f"num_preemptions, num_preemptions_swap, num_preemptions_recompute: {got}, expected (1, {swap}, {recompute})")
    assert step.preempted, "step.preempted must be True: nobody is admitted or swapped in in a step that preempted"


def _under_pressure(num_cpu_blocks, seconds_per_block_swap, n):
    """Six requests in 14 blocks of 4 (the third with n samples), preemption "auto" with
    costs that make some preemptions swaps and others recomputes: (tokens, swaps,
    recomputes)."""
    from nanopaged import LLM, SamplingParams
    from nanopaged.messages import PreemptionCosts

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=14, num_cpu_blocks=num_cpu_blocks,
              preemption_mode="auto", enable_prefix_caching=False, max_num_seqs=4, attention_backend="torch")
    llm.engine.scheduler.costs = PreemptionCosts(seconds_per_block_swap, seconds_per_token_recompute=1e-3)
    prompts = [list(range(1 + 7 * i, 12 + 7 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(6)]
    params[2] = SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
    tokens = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"], "device blocks are still held (a leak)"
    assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"], "CPU blocks are still held (a leak)"
    return tokens, stats["num_preemptions_swap"], stats["num_preemptions_recompute"]


def check_engine_runs_on_it():
    """under memory pressure ("auto" mode) the engine preempts with your code as with its own: same tokens, swaps and recomputes"""
    from . import engines_own

    for cpu, swap_cost, n in ((9, 1.9e-3, 1), (4, 1.5e-3, 2)):
        tokens, swaps, recomputes = _under_pressure(cpu, swap_cost, n)
        with engines_own():
            want_tokens, want_swaps, want_recomputes = _under_pressure(cpu, swap_cost, n)
        where = (f"six requests in 14 blocks, a CPU pool of {cpu} blocks, a block swap costing {swap_cost * 1e3} ms "
                 f"and a token recompute 1 ms")
        assert (swaps, recomputes) == (want_swaps, want_recomputes), (
            f"{where}: with your code the engine preempted {swaps} times by swap and {recomputes} by recompute, "
            f"with its own {want_swaps} and {want_recomputes}")
        for i, (g, w) in enumerate(zip(tokens, want_tokens)):
            assert g == w, f"{where}: request {i}: with your code the engine produced {g}, with its own {w}"


CHECKS = [check_should_swap_by_mode, check_should_swap_auto_asks_the_costs, check_preempt_by_recompute,
          check_preempt_by_swap, check_engine_runs_on_it]
