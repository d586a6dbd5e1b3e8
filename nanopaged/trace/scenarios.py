"""Scenarios for the tracer: the paper's figures, and each sharing feature, as real runs.

Each scenario is a handful of requests (greedy or seeded, ignore_eos, so every run is the
same) plus the small engine that makes its point visible, and a test that finds, in the
run's events (events.py), the step where the point is made:

    fig6     the paper's Figure 6: one request; the prefill fills blocks, decode fills
             the last one, then a new block is allocated
    fig7     the paper's Figure 7: two requests in one pool, their blocks interleaved
    cow      parallel sampling (n=2): the prompt's blocks shared (ref_count 2), then
             copy-on-write when both samples write into the shared last block (§4.4)
    prefix   a second request reusing the first one's cached prompt blocks (vLLM v1's
             automatic prefix caching)
    preempt  a pool too small for three requests: one swapped out to the CPU pool and
             back in, one recomputed because the CPU pool is full (§4.5)
    speculative  n-gram speculative decoding on a prompt that repeats itself: drafts
             accepted, and a rejection at a block boundary whose block is taken back
             (chapter 19)
    pipeline  the model split over 2 pipeline stages (worker processes): two requests
             in two batches in flight at once, each kept out of the other's (chapter 20)
    lora     three LoRA adapters and two adapter slots: a request waits for a slot while
             both hold adapters in use, then takes the one a finished request left
             (chapter 22; the adapters are random, made for the run)

`python -m nanopaged.trace --scenario NAME` runs one (cli.py). The engine settings are
the scenario's; the engine's flags (--block-size, --num-gpu-blocks, --speculative-config,
...) override them, and the tracer then says whether the point was still made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import events as ev
from ..lora_request import LoRARequest
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine

History = list[list]           # the events of each step (index 0 is step 1), and the tracer's BatchesInFlight


@dataclass(frozen=True)
class BatchesInFlight:
    """The tracer's record of a step under pipeline parallelism (not an engine event: the
    tracer reads the scheduler's in-flight batches before and after the step). run_trace
    puts it last in the step's list.

    batches: each batch's request ids, oldest first: those in flight before the step,
        then those it sent; the step took in the oldest one's output.
    """

    batches: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a scenario, added before step `arrival + 1` (0: at the start).
    prompt: text, or token ids (as LLMEngine.add_request takes them). lora: the name of
    the scenario's adapter it runs with (one of Scenario.lora_adapters), None: none."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival: int = 0
    lora: str | None = None


@dataclass(frozen=True)
class Scenario:
    """A traced run: requests, the engine to run them on, and the point it makes.

    Attributes:
        name, title: for the command line and the trace's header.
        watch: what to look at, one or two sentences.
        requests: the requests, with their arrival steps.
        num_gpu_blocks, num_cpu_blocks, block_size, preemption_mode,
            enable_prefix_caching, dtype: the engine (EngineConfig's fields). The named
            scenarios run in float32, so chapter 13's figures are what every CPU draws
            (in bfloat16 a seeded sample can pick another token); your own prompts in
            the engine's "auto".
        speculative_config: speculative decoding (EngineConfig's field: None, or a dict
            such as {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5}).
        pipeline_parallel_size, max_num_batched_tokens: EngineConfig's fields (the
            latter None: the engine's default).
        lora_adapters, max_loras: multi-LoRA: the names of the adapters the run makes
            (make_adapters), and the model's adapter slots; () : no LoRA.
        transition: the point, as a phrase ("a new block is allocated right after ...").
        find: the first step (1-based) of a run's history at which the point has been
            made, or None; see shown_at.
    """

    name: str
    title: str
    watch: str
    requests: tuple[TraceRequest, ...]
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    block_size: int = 4
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    speculative_config: dict | None = None
    pipeline_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    lora_adapters: tuple[str, ...] = ()
    max_loras: int = 1
    transition: str = ""
    find: Callable[[History], int | None] | None = field(default=None, repr=False)

    def build_engine(self, model=None, **engine_args) -> LLMEngine:
        """The scenario's engine on `model` (None: the default model); engine_args
        (EngineConfig's fields) override the scenario's. Raises what EngineConfig /
        LLMEngine raise."""
        from ..config import EngineConfig
        from ..engine.llm_engine import LLMEngine
        own = dict(num_gpu_blocks=self.num_gpu_blocks, num_cpu_blocks=self.num_cpu_blocks,
                   block_size=self.block_size, preemption_mode=self.preemption_mode,
                   enable_prefix_caching=self.enable_prefix_caching, dtype=self.dtype,
                   speculative_config=self.speculative_config, pipeline_parallel_size=self.pipeline_parallel_size)
        if self.max_num_batched_tokens is not None:
            own.update(max_num_batched_tokens=self.max_num_batched_tokens,
                       max_num_seqs=min(self.max_num_batched_tokens, 128))   # a budget >= max_num_seqs
        if self.lora_adapters:
            own.update(enable_lora=True, max_loras=self.max_loras)
        return LLMEngine(EngineConfig(model=model, **{**own, **engine_args}))

    def make_adapters(self, engine: LLMEngine, folder) -> dict[str, LoRARequest]:
        """The scenario's adapters, written in `folder` for `engine`'s model (random, rank
        4, seeded by their order: lora/random_adapter.py), by name; lora_int_id 1, 2, ...
        in the order of lora_adapters."""
        from ..lora.random_adapter import write_random_adapter
        return {name: LoRARequest(name, i + 1, str(write_random_adapter(Path(folder) / name, engine.model_config,
                                                                        seed=i)))
                for i, name in enumerate(self.lora_adapters)}

    def shown_at(self, history: History) -> int | None:
        """The step at which this run made the scenario's point (None: it did not)."""
        return None if self.find is None else self.find(history)


def _first_step(history: History, found: Callable[[list[ev.Event], list[ev.Event]], bool]) -> int | None:
    """First step k (1-based) with found(events of step k, all events up to step k)."""
    seen: list[ev.Event] = []
    for k, events in enumerate(history, start=1):
        seen += events
        if found(events, seen):
            return k
    return None


def _of(kind, events):
    return [e for e in events if isinstance(e, kind)]


def _new_block_in_decode(history: History) -> int | None:
    """fig6: a decode step that allocates a block (the previous step filled the last one)."""
    def found(step, _):
        decoding = {e.seq_id for e in _of(ev.SequenceScheduled, step) if e.kind == "decode"}
        return any(e.seq_id in decoding for e in _of(ev.BlockAllocated, step))
    return _first_step(history, found)


def _interleaved(history: History) -> int | None:
    """fig7: blocks allocated to one request, then another, then the first again."""
    def found(_, seen):
        owner = {s: e.request_id for e in _of(ev.RequestAdded, seen) for s in e.seq_ids}
        runs = []
        for e in _of(ev.BlockAllocated, seen):
            if not runs or runs[-1] != owner[e.seq_id]:
                runs.append(owner[e.seq_id])
        return len(runs) > len(set(runs))
    return _first_step(history, found)


def _copy_on_write_after_sharing(history: History) -> int | None:
    """cow: a copy-on-write, once blocks have been shared."""
    def found(step, seen):
        return bool(_of(ev.CopyOnWrite, step)) and bool(_of(ev.BlocksShared, seen))
    return _first_step(history, found)


def _later_request_hits(history: History) -> int | None:
    """prefix: a prefix-cache hit by a request other than the first one."""
    def found(step, seen):
        first = _of(ev.RequestAdded, seen)[0].request_id
        return any(e.request_id != first and e.num_tokens > 0 for e in _of(ev.PrefixCacheHit, step))
    return _first_step(history, found)


def _swapped_back_and_recomputed(history: History) -> int | None:
    """preempt: a request swapped out and back in, and another one preempted by recompute."""
    def found(_, seen):
        swapped = {e.request_id for e in _of(ev.Preempted, seen) if e.mode == "swap"}
        back = swapped & {e.request_id for e in _of(ev.SwapIn, seen)}
        recomputed = {e.request_id for e in _of(ev.Preempted, seen) if e.mode == "recompute"}
        return any(r != b for r in recomputed for b in back)
    return _first_step(history, found)


def taken_back(events: list[ev.Event]) -> list[int]:
    """Speculative decoding's rollback in one step's events: the indices of the
    BlockFreed events that give back blocks past a sequence's accepted tokens. The
    scheduler publishes them right after the sequence's DraftsVerified, with only the
    BlockCached of the blocks its accepted tokens filled in between (SpecDecodeScheduler._verified)."""
    found, verified = [], None
    for i, e in enumerate(events):
        if isinstance(e, ev.DraftsVerified):
            verified = e.seq_id
        elif isinstance(e, ev.BlockFreed) and e.seq_id == verified:
            found.append(i)
        elif not (isinstance(e, ev.BlockCached) and e.seq_id == verified):
            verified = None
    return found


def _drafts_accepted_then_block_taken_back(history: History) -> int | None:
    """speculative: a step in which a sequence keeps some drafts, rejects the rest, and
    gives back a block that held only rejected slots."""
    def found(step, _):
        back = {step[i].seq_id for i in taken_back(step)}
        return any(e.seq_id in back and 0 < e.num_accepted < len(e.spec_token_ids)
                   for e in _of(ev.DraftsVerified, step))
    return _first_step(history, found)


def _two_batches_in_flight(history: History) -> int | None:
    """pipeline: a step during which two batches were in flight, with no request in both."""
    def found(step, _):
        batches = [set(b) for e in step if isinstance(e, BatchesInFlight) for b in e.batches]
        return len(batches) >= 2 and not set.intersection(*batches)
    return _first_step(history, found)


def _waits_for_a_lora_slot_then_runs(history: History) -> int | None:
    """lora: a request passed over for want of a LoRA slot, scheduled in a later step."""
    def found(step, seen):
        waited = {e.request_id for e in _of(ev.WaitingForLoRASlot, seen)}
        return any(e.request_id in waited for e in _of(ev.SequenceScheduled, step))
    return _first_step(history, found)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario(
        "fig6", "Figure 6: block table translation",
        "One request, the paper's prompt. The prefill writes 7 tokens into two blocks, the "
        "second one 3/4 full; the first decode fills it; the next one needs a new block.",
        (TraceRequest("A", "Four score and seven years ago our", _greedy(6)),),
        num_gpu_blocks=8, transition="a new block is allocated in a decode, right after the last one filled",
        find=_new_block_in_decode),
    Scenario(
        "fig7", "Figure 7: two requests in one physical pool",
        "Two requests grow one block at a time, each when its last block is full, so their "
        "logical blocks end up interleaved in the pool: neither needs contiguous memory.",
        (TraceRequest("A", "Four score and seven years ago our", _greedy(6)),
         TraceRequest("B", "It was the best of times", _greedy(6))),
        num_gpu_blocks=12, transition="the two requests' blocks interleave in the pool",
        find=_interleaved),
    Scenario(
        "cow", "Copy-on-write: parallel sampling, n=2",
        "One prompt, two samples. The prompt is computed once; the second sample forks the "
        "first (its blocks get ref_count 2). Both then write into the shared, half-full last "
        "block: one gets a copy first, the other writes in place.",
        (TraceRequest("A", "The best thing about paging is",
                      SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=6, ignore_eos=True)),),
        num_gpu_blocks=10, transition="blocks shared with ref_count 2, then a copy-on-write",
        find=_copy_on_write_after_sharing),
    Scenario(
        "prefix", "Prefix caching: a second request reuses the first one's blocks",
        "A and B start with the same instruction. A finishes; its full blocks stay in the "
        "prefix cache while free. B arrives, finds them by hash and computes only the rest.",
        (TraceRequest("A", "Answer in one word. Question: what is the capital of France?", _greedy(3)),
         TraceRequest("B", "Answer in one word. Question: what is the capital of Italy?", _greedy(3), arrival=3)),
        num_gpu_blocks=12, transition="the second request hits the first one's cached blocks",
        find=_later_request_hits),
    Scenario(
        "preempt", "Preemption: swap out and back in, and recompute",
        "Three requests in a pool of 6 blocks, preemption_mode='swap', a CPU pool of 2 blocks. "
        "When a running request needs a block and none is free, the latest arrival is "
        "preempted: C's 2 blocks fit in the CPU pool (swap); later B's 3 do not, the CPU pool "
        "being full, so B is recomputed. When A finishes, C is swapped back in, then B "
        "recomputes its prompt and output in one prefill.",
        (TraceRequest("A", "The best way to learn is", _greedy(8)),
         TraceRequest("B", "Once upon a time", _greedy(8)),
         TraceRequest("C", "The capital of France is", _greedy(4))),
        num_gpu_blocks=6, num_cpu_blocks=2, preemption_mode="swap",
        transition="one request swapped out and back in, another recomputed",
        find=_swapped_back_and_recomputed),
    Scenario(
        "speculative", "Speculative decoding: n-gram drafts, verified in one forward",
        "The prompt asks to copy a list, so the text repeats itself and prompt lookup (n-gram) "
        "drafts up to 4 tokens a step; each verify step computes the last token and the drafts "
        "in one forward and keeps the drafts the model agrees with. At step 3 the fourth draft "
        "is rejected at a block boundary: the block reserved for it is taken back.",
        (TraceRequest("A", "Copy the list exactly.\nList: red apple, green pear, blue plum, yellow lemon.\n"
                           "Copy: red apple, green", _greedy(12)),),
        num_gpu_blocks=24,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3},
        transition="drafts accepted, then a rejected one's block taken back",
        find=_drafts_accepted_then_block_taken_back),
    Scenario(
        "pipeline", "Pipeline parallelism: two batches in flight over two stages",
        "The model is split over 2 stages, each a worker process. A step's token budget of 8 "
        "holds one prompt's chunk, so A goes down the pipe in one batch and B in another right "
        "behind it: two batches in flight. A request is never in both (its next step needs the "
        "token its batch samples at the last stage), so from then on A and B take turns, "
        "each step sending one batch and taking in the older one.",
        (TraceRequest("A", "The best way to learn a language is to", _greedy(4)),
         TraceRequest("B", "Once upon a time, in a small village by the", _greedy(4))),
        num_gpu_blocks=16, pipeline_parallel_size=2, max_num_batched_tokens=8,
        transition="two batches in flight at once, no request in both",
        find=_two_batches_in_flight),
    Scenario(
        "lora", "Multi-LoRA: three adapters, two slots",
        "A, B and C each run with an adapter of their own (x, y, z: random, made for this run), D with "
        "none. The model holds 2 adapters at once (max_loras=2): A's and B's take both slots, so C waits "
        "for a slot, and D, which needs none, joins past it. When A finishes, no running request uses x: "
        "its slot takes z, and C runs beside B.",
        (TraceRequest("A", "The best way to learn is", _greedy(3), lora="x"),
         TraceRequest("B", "Once upon a time", _greedy(8), lora="y"),
         TraceRequest("C", "The capital of France is", _greedy(4), lora="z"),
         TraceRequest("D", "It was the best of times", _greedy(4))),
        num_gpu_blocks=24, lora_adapters=("x", "y", "z"), max_loras=2,
        transition="a request waits for a LoRA slot, then runs in the slot a finished request's adapter left",
        find=_waits_for_a_lora_slot_then_runs),
]}


def prompt_scenario(prompts: list[str], max_tokens: int) -> Scenario:
    """A scenario of the user's own prompts (ids A, B, ...), greedy, all at the start,
    on a 16-block pool with an equal CPU pool and the engine's own preemption mode."""
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"prompts must be non-empty strings, got {prompts!r}")
    ids = [chr(ord("A") + i) if i < 26 else f"R{i}" for i in range(len(prompts))]
    return Scenario("prompt", "your prompts", "Each step: who runs, and where their tokens' K/V live.",
                    tuple(TraceRequest(i, p, _greedy(max_tokens)) for i, p in zip(ids, prompts)),
                    num_gpu_blocks=16, num_cpu_blocks=16, preemption_mode="auto", dtype="auto")
