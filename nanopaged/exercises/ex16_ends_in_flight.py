"""Exercise 16 (chapter 16): async scheduling must not schedule a token past the end."""
from __future__ import annotations

import functools

NUMBER = 16
CHAPTER = "16-async-scheduling.md"
TITLE = "AsyncScheduler._ends_in_flight: no step for a sequence that is surely done"
TARGETS = ["nanopaged.async_sched.scheduler:AsyncScheduler._ends_in_flight"]
TASK = """
With async scheduling the scheduler plans step t+1 while step t runs, counting the
token t is sampling for each sequence as a placeholder (its table
self.num_output_placeholders: seq_id -> tokens in flight) before it exists. Sometimes that token is surely the sequence's last: it reaches
max_tokens, or the sequence reaches max_model_len. Then the sequence must not get a
step t+1: that step would compute the token's K/V and sample a next token, only to
throw it away. Write `_ends_in_flight`, which says so; the scheduler skips a running
sequence for which it returns True. (Stops that depend on the token's value, eos or a
stop token, cannot be known in advance: those cost one wasted token.)
"""
HINT = """
k = self.num_output_placeholders.get(seq.seq_id, 0) tokens are in flight (no entry: none).
Nothing is in flight (k == 0):
False, always (that is every sequence of the synchronous engine). Otherwise the
sequence will have len(seq.output_token_ids) + k output tokens and seq.num_tokens + k
tokens in all once they land; it is done if the first reaches
group.sampling_params.max_tokens or the second reaches self.max_model_len.
"""

_BLOCK = 4


def _sequence(num_prompt, num_output, placeholders, max_tokens):
    """(seq, group): a running sequence with `num_output` tokens appended, its
    num_computed_tokens counting `placeholders` in flight (_ask gives the scheduler
    those)."""
    from nanopaged import SamplingParams
    from nanopaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
    from nanopaged.messages import EngineCoreRequest

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(0, 0, list(range(1, num_prompt + 1)), _BLOCK)
    seq.output_token_ids = list(range(100, 100 + num_output))
    seq.num_computed_tokens = seq.num_tokens + placeholders
    seq.status = SequenceStatus.RUNNING
    return seq, SequenceGroup(EngineCoreRequest("r", seq.prompt_token_ids, params, frozenset({0}), 0.0), [seq])


def _scheduler(max_model_len=256):
    from nanopaged.config import EngineConfig
    from nanopaged.async_sched.scheduler import AsyncScheduler
    from nanopaged.core.block_manager import BlockManager

    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=max_model_len,
                          async_scheduling=True)
    return AsyncScheduler(config, BlockManager(16, _BLOCK))


def _ask(scheduler, num_prompt, num_output, placeholders, max_tokens):
    seq, group = _sequence(num_prompt, num_output, placeholders, max_tokens)
    scheduler.num_output_placeholders.clear()
    if placeholders:
        scheduler.num_output_placeholders[seq.seq_id] = placeholders
    return scheduler._ends_in_flight(seq, group)


def check_max_tokens():
    """with max_tokens=5: True exactly when the tokens appended plus the ones in flight reach 5"""
    scheduler = _scheduler()
    for output, k in ((0, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2)):
        want = output + k >= 5
        got = _ask(scheduler, 6, output, k, max_tokens=5)
        assert got == want, (f"max_tokens=5, {output} tokens appended, {k} in flight: you said {got}, "
                             f"it is {want} (the sequence will have {output + k} tokens)")


def check_nothing_in_flight():
    """with no token in flight it is False, even one token before max_tokens or max_model_len (that token is still to compute)"""
    scheduler = _scheduler(max_model_len=10)
    for prompt, output, max_tokens in ((3, 0, 1), (3, 4, 5), (3, 0, 50), (8, 1, 50), (9, 0, 50)):
        got = _ask(scheduler, prompt, output, 0, max_tokens)
        assert not got, (f"a prompt of {prompt}, {output} tokens appended, none in flight (max_tokens={max_tokens}, "
                         f"max_model_len=10): you said {got}, but the sequence has not got its last token yet, "
                         "and nothing in flight will bring it: it must be scheduled")


def check_max_model_len():
    """with max_model_len=10: True exactly when prompt + output + in flight reach 10 tokens"""
    scheduler = _scheduler(max_model_len=10)
    for prompt, output, k in ((6, 2, 1), (6, 3, 1), (7, 2, 1), (6, 2, 2), (5, 2, 2), (8, 0, 1), (9, 0, 1)):
        want = prompt + output + k >= 10
        got = _ask(scheduler, prompt, output, k, max_tokens=100)
        assert got == want, (f"max_model_len=10, a prompt of {prompt}, {output} tokens appended, {k} in flight "
                             f"(max_tokens 100): you said {got}, it is {want}")


def _run_async(prompts, params, max_model_len=None):
    """LLM.generate with async scheduling on the tiny model: (tokens and finish reasons,
    positions computed in all)."""
    from nanopaged import LLM

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), block_size=_BLOCK, num_gpu_blocks=64, attention_backend="torch",
              preemption_mode="recompute", num_cpu_blocks=0, async_scheduling=True, max_model_len=max_model_len)
    scheduler, computed = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def counted():
        if len(computed) == 200:         # these requests need 30 steps at most
            raise AssertionError("the engine is stuck: 200 steps and the requests are not done (a sequence "
                                 "that still needs a token is never scheduled?)")
        out = schedule()
        computed.append(out.total_num_scheduled_tokens)
        return out
    scheduler.schedule = counted
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outs], sum(computed)


@functools.cache
def _engines_own(case):
    from . import engines_own

    with engines_own():
        return _run_async(*_cases()[case])


@functools.cache
def _cases():
    from nanopaged import SamplingParams

    def greedy(n, **kw):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
    return {
        "max_tokens 1, 2, 3 and 7": ([[1, 2, 3, 4, 5], list(range(20, 33)), [7, 8], [9, 9, 9]],
                                     [greedy(1), greedy(2), greedy(3), greedy(7)], None),
        "n=2 with max_tokens 3, and max_tokens 4": ([[5, 6, 7], [8, 9]],
                                                    [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3,
                                                                    ignore_eos=True), greedy(4)], None),
        # max_tokens=None: up to the context (prompt + max_tokens > max_model_len is refused)
        "a prompt of max_model_len - 2 = 30 tokens": ([list(range(40, 70)), [1, 2, 3]], [greedy(None), greedy(10)], 32),
    }


def check_engine_stops_in_time():
    """the engine with async scheduling on your code: the engine's own tokens, and not one position computed more than it computes"""
    for case, args in _cases().items():
        got, computed = _run_async(*args)
        want, want_computed = _engines_own(case)
        assert got == want, f"{case}: with your code the engine produced {got}, with its own {want}"
        why = ("a step was given to a sequence that was done" if computed > want_computed
               else "a sequence waited a step it did not need to")
        assert computed == want_computed, (f"{case}: with your code the engine computed {computed} positions "
                                           f"in all, with its own {want_computed}: {why}")


CHECKS = [check_max_tokens, check_nothing_in_flight, check_max_model_len, check_engine_stops_in_time]
