"""The messages that cross the engine's boundaries, one dataclass each.

vLLM v1 splits the engine into layers that talk only through plain data, so that any
layer can live in another process (the EngineCore behind AsyncLLM, a worker per
tensor-parallel rank). This file holds the base engine's messages, in the order a
request meets them:

    Processor            --EngineCoreRequest-->   EngineCore          (tokens in)
    Scheduler.schedule   --SchedulerOutput-->     ModelRunner         (what to compute)
    ModelRunner          --ModelRunnerOutput-->   Scheduler.update_from_output
    EngineCore           --EngineCoreOutputs-->   OutputProcessor     (tokens out)
    OutputProcessor      --RequestOutput-->       the user            (outputs.py)

plus PreemptionCosts, which the runner measures once at start and the scheduler reads,
and WeightsInfo, what each worker's weights hold (for the tracer and the dashboard).

They carry the base engine's fields only. A later feature that must say more defines
its own message in its package (features.py lists them), registered with utils/codec.py
there when it crosses hosts: a subclass of one of these with its fields added (the
scheduler's `scheduler_output_cls` and the runner's `runner_output_cls` name the
classes they make), or a message of its own (e.g. the argument of a step's deferred
sampling call, EngineCore._deferred_sampling).

Nothing here holds a live object of another layer (no Sequence, no block manager, no
tokenizer): ids, token ids, numbers and SamplingParams only. A *sequence* (one of a
request's n completions) is what vLLM v1 calls a request inside the core
and the worker; it is named by its engine-wide `seq_id`.
vLLM: `vllm/v1/engine/__init__.py`, `vllm/v1/core/sched/output.py`, `vllm/v1/outputs.py`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams, StructuredOutputsParams
from .utils import codec


class FinishReason(enum.Enum):
    """Why a sequence ended (vLLM v1's FinishReason); str() gives the OpenAI word."""

    STOP = "stop"        # an eos id, a stop token id, a stop string (or a feature's own end)
    LENGTH = "length"    # max_tokens, max_model_len, or more KV blocks than the pool has
    ABORT = "abort"      # abort_request()

    def __str__(self) -> str:
        return self.value


# -- Processor -> EngineCore --------------------------------------------------------------

@dataclass
class EngineCoreRequest:
    """A request as the core sees it: token ids and settings, never text.

    Attributes:
        request_id: the caller's id, unique among unfinished requests.
        prompt_token_ids: the prompt, already tokenized (chat template applied).
        sampling_params: a validated SamplingParams (max_tokens resolved to an int).
        eos_token_ids: the ids that end a sequence unless ignore_eos (the tokenizer's
            eos and every id generation_config.json lists), a frozenset.
        arrival_time: time.monotonic() when the Processor made it, seconds (FCFS order).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float


# -- Scheduler -> ModelRunner ------------------------------------------------------------

@dataclass
class NewRequestData:
    """A sequence the runner must (re)learn in full: first scheduled, resumed after a
    preemption, or a fork whose tokens and blocks were just replaced. vLLM's name, one
    per *sequence* here: vLLM v1 runs each of n samples as a child request of its own,
    so its "request" is our sequence (the same holds for CachedRequestData). The runner drops
    what it knew of `seq_id` and keeps this instead (its generator excepted: a seeded
    stream goes on where it was, so preemption does not change samples).

    Attributes:
        seq_id: the sequence (vLLM v1's req_id).
        index: its index among the request's sequences (seeds the i-th random stream).
        prompt_token_ids: the prompt.
        output_token_ids: tokens generated so far (non-empty after a recompute or fork).
        sampling_params: the request's SamplingParams.
        block_ids: its block table, physical block ids in logical order.
        num_computed_tokens: tokens whose K/V are already in those blocks (a cache hit).
    """

    seq_id: int
    index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """The sequences the runner already knows, as deltas since it last saw them
    (parallel lists, one entry per sequence; vLLM v1's CachedRequestData).

    Attributes:
        seq_ids: the sequences.
        new_token_ids: output tokens it has not seen (the last sampled one, on a decode).
        new_block_ids: block ids appended to its table; when block_ids_replaced[i] the
            whole new table instead (after copy-on-write or swap-in moved a block).
        block_ids_replaced: see new_block_ids.
        num_computed_tokens: its num_computed_tokens before this step.
    """

    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    block_ids_replaced: list[bool] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's work for the runner, self-contained (it needs nothing else).

    Attributes:
        scheduled_new_reqs: NewRequestData of sequences the runner must learn.
        scheduled_cached_reqs: deltas for the ones it knows.
        num_scheduled_tokens: seq_id -> tokens computed this step (the uncached prompt
            or a chunk of it on prefill, 1 on decode, 0 for a fork that only samples).
        total_num_scheduled_tokens: their sum (<= max_num_batched_tokens).
        sample_from: fork seq_id -> the seq_id whose last row it samples from this step
            (the other n - 1 completions of a request whose prefill just completed).
        blocks_to_copy: (src, dst) device block pairs, copied before the forward
            (copy-on-write).
        blocks_to_swap_out / blocks_to_swap_in: (device, cpu) / (cpu, device) block pairs,
            copied before the forward (swap preemption).
        finished_seq_ids: sequences that left since the last step; the runner forgets them.
        num_blocks_taken_back: seq_id -> how many trailing block ids the runner drops
            from its record of that sequence before appending this step's new block
            ids (a scheduler that gave a sequence slots past what a step computed took
            the blocks holding only those slots back); only for cached deltas that
            append (block_ids_replaced False), absent when 0.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    sample_from: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    finished_seq_ids: set[int] = field(default_factory=set)
    num_blocks_taken_back: dict[int, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """True when the step computes no token (copies and swaps may still be due)."""
        return self.total_num_scheduled_tokens == 0

    def start_positions(self) -> dict[int, int]:
        """seq_id -> its num_computed_tokens when the step starts, for every sequence sent."""
        c = self.scheduled_cached_reqs
        starts = dict(zip(c.seq_ids, c.num_computed_tokens))
        starts.update((r.seq_id, r.num_computed_tokens) for r in self.scheduled_new_reqs)
        return starts


# -- ModelRunner -> Scheduler ------------------------------------------------------------

@dataclass
class Logprobs:
    """Log-probabilities of a few tokens per row (vLLM v1's LogprobsLists), raw: the
    log_softmax of the model's logits before temperature, penalties or any filter.

    Attributes:
        token_ids: [num_rows][k + 1]: the sampled (or prompt) token first, then the top-k.
        logprobs: [num_rows][k + 1], natural log, same order.
        ranks: [num_rows]: rank of the first token in its row's distribution (1 = best).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def row(self, i: int) -> "Logprobs":
        return Logprobs([self.token_ids[i]], [self.logprobs[i]], [self.ranks[i]])

    def __getitem__(self, rows: slice) -> "Logprobs":
        """The rows `rows` (a slice), as a Logprobs."""
        return Logprobs(self.token_ids[rows], self.logprobs[rows], self.ranks[rows])


@dataclass
class ModelRunnerOutput:
    """What one forward produced.

    Attributes:
        sampled_token_ids: seq_id -> the token sampled for it (only sequences whose
            prompt is fully computed after this step sample).
        logprobs: seq_id -> Logprobs of its new tokens (one row each, in order), for
            sequences whose SamplingParams.logprobs is set.
        prompt_logprobs: seq_id -> Logprobs of the prompt tokens at positions
            [start + 1, end] computed this step (row j: the token at position start+1+j),
            for sequences whose SamplingParams.prompt_logprobs is set.
    """

    sampled_token_ids: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)


@dataclass
class PreemptionCosts:
    """What preempting costs on this machine, measured by the model runner when the
    engine starts (ModelRunner.measure_preemption_costs), read by the scheduler.

    Attributes:
        seconds_per_block_swap: copying one KV block (all layers, K and V) between the
            device pool and the CPU pool, one way.
        seconds_per_token_recompute: prefilling one token again.
    A swap costs 2 * blocks * seconds_per_block_swap (out, later back in); a recompute
    costs tokens * seconds_per_token_recompute (the paper's §4.5 trade-off).
    """

    seconds_per_block_swap: float
    seconds_per_token_recompute: float

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        return 2 * num_blocks * self.seconds_per_block_swap < num_tokens * self.seconds_per_token_recompute


@dataclass
class WeightsInfo:
    """The weights a model holds resident, by format (Worker.describe_weights, once at
    start; the EngineCore sums its ranks' with `combine`: tensor-parallel shards, and
    each pipeline stage's own copy of a tied embedding). A decode step reads all of it
    but the embedding rows it does not look up. The tracer's header and the dashboard
    show it (chapter 21).

    Attributes:
        bytes_by_format: format -> bytes. A dtype's name ("float32", "bfloat16") for
            plain parameters; a quantized layer's own names for what its quant_method
            holds (GGUF's block types: "Q4_1", "Q8_0", ...; "float32" for a matrix it
            widened).
    """

    bytes_by_format: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """All the resident bytes of the weights."""
        return sum(self.bytes_by_format.values())

    def describe(self) -> str:
        """"Q4_1 66.4 MB + Q8_0 30.1 MB + float32 0.1 MB = 96.6 MB": each format's share,
        the biggest first (MB: 10^6 bytes); "float32 538.1 MB" for one format."""
        parts = [f"{name} {size / 1e6:.1f} MB" for name, size in
                 sorted(self.bytes_by_format.items(), key=lambda kv: (-kv[1], kv[0]))]
        return " + ".join(parts) + (f" = {self.nbytes / 1e6:.1f} MB" if len(parts) > 1 else "")

    @staticmethod
    def combine(infos: list["WeightsInfo"]) -> "WeightsInfo":
        """The sum of several ranks' weights (each holds its own shard)."""
        total: dict[str, int] = {}
        for info in infos:
            for name, size in info.bytes_by_format.items():
                total[name] = total.get(name, 0) + size
        return WeightsInfo(total)


# -- EngineCore -> OutputProcessor -------------------------------------------------------

@dataclass
class EngineCoreOutput:
    """What happened to one sequence in one step.

    Attributes:
        request_id: its request.
        index: which of the request's completions (0..n-1).
        new_token_ids: tokens appended this step.
        new_logprobs: Logprobs of those tokens (one row each), if asked for.
        new_prompt_logprobs: Logprobs of prompt tokens computed this step, if asked for.
        finish_reason: a FinishReason once the sequence ended, else None.
        stop_reason: the stop_token_ids id that ended it; None for an eos (stop
            strings are the OutputProcessor's, which fills in the string).
        num_cached_tokens: prompt tokens found in the prefix cache (first output only).
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """One step of the core: an output per sequence that advanced or ended, and the
    requests now entirely done (all sequences finished, blocks freed).

    A core in its own process (engine_core_client.EngineCoreProc) also fills:
        scheduler_stats: EngineCore.get_stats() after the step.
        rejected_requests: request_id -> why add_request refused it.
        pongs: the numbers of the PINGs taken in before this step (its loop turns).
        watcher_outputs: watcher name -> the payload it added to this message (a
            watcher of the core: engine_core_client.CoreWatcher); {} mostly.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_requests: set[str] = field(default_factory=set)
    scheduler_stats: dict[str, int | float] | None = None
    rejected_requests: dict[str, str] = field(default_factory=dict)
    pongs: list[int] = field(default_factory=list)
    watcher_outputs: dict[str, object] = field(default_factory=dict)


class EngineCoreRequestType(enum.Enum):
    """What a message from the front end to a core process asks (vLLM's
    EngineCoreRequestType). Payloads: ADD an EngineCoreRequest; ABORT a list of request
    ids; STOP_SEQUENCES a list of (request_id, index); PING a number, answered in the
    next outputs' pongs; WATCH (name, factory): start the watcher `name`, built once
    by factory(), or stop it when factory is None; SHUTDOWN None."""

    ADD = "add"
    ABORT = "abort"
    STOP_SEQUENCES = "stop_sequences"
    PING = "ping"
    WATCH = "watch"
    SHUTDOWN = "shutdown"


@dataclass
class EngineCoreDead:
    """The last message of a core process that failed: why (its traceback, as text)."""

    reason: str



# The messages that cross hosts in a multi-node engine (utils/codec.py: data only, no
# pickle), with the request settings they carry.
codec.register(StructuredOutputsParams, SamplingParams, NewRequestData, CachedRequestData, SchedulerOutput,
               Logprobs, ModelRunnerOutput, PreemptionCosts, WeightsInfo)
