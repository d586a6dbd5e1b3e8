"""Exercise 0 (chapter 00): predict a preemption, then let the engine check you."""
from __future__ import annotations

NUMBER = 0
CHAPTER = "00-overview.md"
TITLE = "Predict when a request is preempted and recomputed"
TARGETS: list[str] = []
TASK = """
Chapter 00's second snippet (requests a, b, c stepped by hand), rerun with a pool of 6
blocks of 4 tokens, preemption by recompute, and max_tokens=12 for request a:

    llm = LLM(folder, block_size=4, num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="recompute")
    (the first snippet's generate, then the second snippet with max_tokens=12 for "a")

Predict, before you run anything: at which step is a request preempted, which one, at
which step is it prefilled again, and how many tokens does that prefill compute?
"""
QUESTION = """
# Fill in the four numbers / names after the colons.
preempted_step:
preempted_request:
resumed_step:
resumed_tokens:
"""
HINT = """
Count blocks. A prompt of n tokens holds ceil(n / 4) blocks; a request needs a new block
when its next token crosses a multiple of 4. The pool has 6 blocks; the first generate
left some of them in the prefix cache (chapter 08). The scheduler preempts the request
that arrived last (chapter 03) when a running one cannot get its next block. A recompute
prefills prompt + output again, but the full blocks still in the prefix cache are not
computed again. Then check with the chapter's trace, or `engine.get_stats()`.
"""


def answer(text: str) -> dict[str, str]:
    """The student's file -> {field: value} (lines `name: value`; # comments ignored)."""
    fields = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        if ":" in line:
            name, value = line.split(":", 1)
            fields[name.strip()] = value.strip().strip("'\"")
    return fields


def run_engine() -> dict[str, str]:
    """Chapter 00's two snippets with the exercise's settings; what really happens."""
    from nanopaged import LLM, SamplingParams

    from . import tiny_model_folder

    llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="recompute")
    llm.generate(["Hello, my name is", "The capital of France is"],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("b", list(range(6, 15)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("c", [15, 16, 17], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    scheduler, runner = engine.scheduler, engine.model_runner
    request_of = {s.seq_id: rid for rid, g in engine.requests.items() for s in g.seqs}
    seen: dict[str, int] = {}          # request -> tokens computed so far
    facts: dict[str, str] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        preemptions = scheduler.num_preemptions
        out = scheduler.schedule()
        scheduled = {request_of[i]: n for i, n in out.num_scheduled_tokens.items()}
        if scheduler.num_preemptions > preemptions and "preempted_step" not in facts:
            victim = next(rid for rid in seen if rid not in scheduled and rid in engine.requests)
            facts.update(preempted_step=str(step), preempted_request=victim)
        elif "preempted_request" in facts and "resumed_step" not in facts \
                and scheduled.get(facts["preempted_request"], 0) > 1:
            facts.update(resumed_step=str(step), resumed_tokens=str(scheduled[facts["preempted_request"]]))
        for rid, n in scheduled.items():
            seen[rid] = seen.get(rid, 0) + n
        engine.output_processor.process_outputs(scheduler.update_from_output(out, runner.execute_model(out)))
    return facts


def check_preempted_step(student):
    """the step at which a request is preempted"""
    _compare(student, "preempted_step")


def check_preempted_request(student):
    """which request is preempted"""
    _compare(student, "preempted_request")


def check_resumed_step(student):
    """the step at which it is prefilled again"""
    _compare(student, "resumed_step")


def check_resumed_tokens(student):
    """how many tokens that prefill computes"""
    _compare(student, "resumed_tokens")


_FACTS: dict[str, str] = {}


def _compare(student: dict[str, str], field: str) -> None:
    if not _FACTS:
        _FACTS.update(run_engine())
    given = student.get(field, "")
    assert given, f"no answer for {field} yet"
    assert given == _FACTS[field], f"you predicted {given}; the engine did {_FACTS[field]}"


CHECKS = [check_preempted_step, check_preempted_request, check_resumed_step, check_resumed_tokens]
