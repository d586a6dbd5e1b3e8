"""Exercise 3 (chapter 03): the scheduler's waiting queue and token budget."""
from __future__ import annotations

NUMBER = 3
CHAPTER = "03-scheduler.md"
TITLE = "Scheduler: admit waiting requests within a step's limits"
TARGETS = ["nanopaged.core.scheduler:Scheduler._chunk",
           "nanopaged.core.scheduler:Scheduler._schedule_waiting"]
TASK = """
Write the scheduler's third phase, the one that lets waiting requests join the batch
(continuous batching: the batch is rebuilt every step), and the chunking rule it uses.
`_schedule_waiting` goes through the waiting queue strictly first come first served
and admits requests while the step's limits allow: max_num_seqs, the token budget and
free blocks; `_chunk` says how much of a prompt fits in what is left of the budget.
Every request the engine serves is admitted by your code.
"""
HINT = """
_chunk: without chunked prefill a prompt is never cut; with it, min(tokens, budget left),
and never below 0 (step.budget can go negative: a request alone in a step may exceed it).

_schedule_waiting, in a loop over self.waiting[0] (look at the head, pop it only once it
is admitted; `break` at the first one that does not fit: FCFS never skips the head):
- stop when the queue is empty, when step.preempted, when self.swapped is not empty, or
  when len(self.running) reaches self.config.scheduler_config.max_num_seqs;
- ask the block manager once what it already has: computed =
  self.block_manager.get_computed_blocks(group); if computed.never_fits (the whole pool
  could not hold it), pop it and self.queues.finish_too_long(group);
- first, *rest = group.seqs_to_compute(). The first sequence computes
  first_tokens = first.num_tokens - computed.num_computed_tokens (cache hits excluded),
  each other one s.num_tokens - computed.num_shared_tokens (rest_tokens, their sum);
- only a lone sequence is chunked: n_first = first_tokens if rest else self._chunk(...);
- it does not fit if n_first == 0, or if n_first + rest_tokens > step.budget while the
  step already has work (step.scheduled): a request alone may take a whole step;
- its first sequence computes up to first_end = computed.num_computed_tokens + n_first;
  starts = self._allocate(group, computed, first_end) (block_manager.allocate) takes the blocks, or
  says None (changing nothing) when too few are free: then it does not fit;
- admit it: pop it, then self._admit(step, group, first_end, starts) does the rest (it
  sets each sequence's num_computed_tokens to its start: the scheduler is their writer).
"""


def _scheduler(num_blocks=6, budget=16, max_num_seqs=3, chunked=True):
    from nanopaged.config import EngineConfig
    from nanopaged.core.block_manager import BlockManager
    from nanopaged.core.scheduler import Scheduler

    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                          enable_chunked_prefill=chunked, preemption_mode="recompute")
    return Scheduler(config, BlockManager(num_blocks, 4))


def _add(sched, request_id, first_token, num_prompt_tokens, max_tokens=4):
    from nanopaged.messages import EngineCoreRequest
    from nanopaged.sampling_params import SamplingParams

    prompt = list(range(first_token, first_token + num_prompt_tokens))
    sched.add_request(EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens),
                                        eos_token_ids=frozenset(), arrival_time=float(first_token)))


def _scheduled(sched, out):
    """{request_id: tokens} of a SchedulerOutput."""
    request_of = {s.seq_id: rid for rid, g in sched.requests.items() for s in g.seqs}
    return {request_of[i]: n for i, n in out.num_scheduled_tokens.items()}


def check_chunk():
    """_chunk gives a prompt all its tokens, or with chunked prefill what is left of the budget (never < 0)"""
    for chunked in (True, False):
        sched = _scheduler(chunked=chunked)
        for tokens, budget in ((7, 16), (7, 5), (7, 7), (1, 0), (9, -3), (12, 12)):
            want = min(tokens, max(budget, 0)) if chunked else tokens
            got = sched._chunk(tokens, budget)
            assert got == want, (f"enable_chunked_prefill={chunked}, {tokens} tokens, budget left {budget}: "
                                 f"you said {got}, it is {want}")


def check_first_come_first_served():
    """requests join strictly in arrival order: a small one never skips a head that does not fit"""
    sched = _scheduler(num_blocks=4, budget=20)
    _add(sched, "A", 100, 8)                 # 2 blocks
    _add(sched, "B", 200, 12)                # 3 blocks: only 2 left after A
    _add(sched, "C", 300, 2)                 # 1 block: would fit, but B is ahead of it
    got = _scheduled(sched, sched.schedule())
    assert got == {"A": 8}, (f"a pool of 4 blocks, budget 20, waiting A (8 tokens), B (12), C (2): step 1 scheduled {got}, "
                             "want {'A': 8} (B needs 3 blocks, 2 are free; C must wait behind B)")
    assert [g.request_id for g in sched.waiting] == ["B", "C"], \
        f"waiting queue after step 1: {[g.request_id for g in sched.waiting]}, want ['B', 'C']"


def check_step_limits():
    """a step stays within max_num_batched_tokens (a prompt too long is chunked, or waits without chunked prefill) and max_num_seqs"""
    for chunked, want in ((True, {"A": 6, "B": 5, "C": 5}), (False, {"A": 6, "B": 5})):
        sched = _scheduler(budget=16, chunked=chunked)
        for rid, first, n in (("A", 100, 6), ("B", 200, 5), ("C", 300, 7)):
            _add(sched, rid, first, n)
        got = _scheduled(sched, sched.schedule())
        assert got == want, (f"budget 16 tokens, prompts A 6, B 5, C 7, enable_chunked_prefill={chunked}: "
                             f"step 1 scheduled {got}, want {want}")
    sched = _scheduler(num_blocks=16, budget=64, max_num_seqs=2)
    for rid, first in (("A", 100), ("B", 200), ("C", 300)):
        _add(sched, rid, first, 3)
    got = _scheduled(sched, sched.schedule())
    assert got == {"A": 3, "B": 3}, f"max_num_seqs=2, three short prompts: step 1 scheduled {got}, want A and B"
    sched = _scheduler(num_blocks=16, budget=8)
    _add(sched, "long", 100, 20)
    got = _scheduled(sched, sched.schedule())
    assert got == {"long": 8}, f"budget 8, one prompt of 20 tokens: step 1 scheduled {got}, want its first 8 tokens"


def check_when_nobody_joins():
    """nobody joins in a step that preempted or while one is swapped out; a request the pool can never hold is finished ("length")"""
    import logging

    from nanopaged.core.scheduler_output import ScheduledStep
    from nanopaged.core.sequence import SequenceStatus

    for why in ("preempted", "swapped"):
        sched = _scheduler()
        _add(sched, "A", 100, 3)
        step = ScheduledStep(budget=16, preempted=why == "preempted")
        if why == "swapped":
            sched.swapped.append(object())   # stands for a swapped-out request
        sched._schedule_waiting(step)
        assert not step.scheduled and len(sched.waiting) == 1, (
            f"a step with {'a preemption' if why == 'preempted' else 'a request swapped out'}: your "
            f"_schedule_waiting admitted {[s.seq_group.request_id for s in step.scheduled]}, want nobody")
    sched = _scheduler(num_blocks=2)             # 8 slots in all
    _add(sched, "grown", 100, 8)                 # fits... until it has grown (as after a preemption)
    _add(sched, "next", 200, 2)
    seq = sched.requests["grown"].seqs[0]
    seq.append_token(1)
    logger = logging.getLogger("nanopaged.core.scheduler")
    level, logger.level = logger.level, logging.ERROR       # (its warning is expected here)
    try:
        got = _scheduled(sched, sched.schedule())
    finally:
        logger.setLevel(level)
    assert seq.status == SequenceStatus.FINISHED_LENGTH, (
        f"a waiting request of 9 tokens in a pool of 8 slots can never run; its status is {seq.status.name}, "
        "want FINISHED_LENGTH (self.queues.finish_too_long)")
    assert got == {"next": 2}, f"the request behind it should then run: step 1 scheduled {got}, want {{'next': 2}}"


def check_engine_runs_on_it():
    """the engine admits every request with your code (small budget, chunked prompts, preemption): same tokens"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    prompts = [list(range(1, 12)), list(range(20, 26)), [7, 8], list(range(40, 58))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 12, 5, 4)]
    same_as_engines_own(prompts, params, num_gpu_blocks=10, max_num_batched_tokens=8, max_num_seqs=3,
                        preemption_mode="recompute")
    same_as_engines_own(prompts, params, enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32,
                        max_num_seqs=2)


CHECKS = [check_chunk, check_first_come_first_served, check_step_limits, check_when_nobody_joins,
          check_engine_runs_on_it]
