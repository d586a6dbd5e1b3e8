"""The live dashboard's messages: a DashboardSnapshot of the engine's state, and its parts.

dashboard/sampler.py builds them in the core's process; they ride to the front end in
EngineCoreOutputs.watcher_outputs, and the page (GET /dashboard, the tracer's replay page)
gets them as JSON (dataclasses.asdict). Ids and numbers only: the text fields stay None
unless a front end fills them. nanopaged's own; vLLM has no dashboard.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DashboardSequence:
    """One sequence of a request.

    Attributes:
        seq_id: the sequence (a request with n > 1 or beams has several).
        block_table: physical block ids, logical block i at index i.
        on_cpu: the table is in the CPU swap pool (swapped out), else the device pool.
        num_computed_tokens: tokens whose K/V are written.
        num_tokens: prompt + output tokens so far.
    """

    seq_id: int
    block_table: list[int]
    on_cpu: bool
    num_computed_tokens: int
    num_tokens: int


@dataclass
class DashboardRequest:
    """One unfinished request.

    Attributes:
        status: its queue: "running", "waiting" or "swapped".
        num_output_tokens: the tokens all its sequences have generated.
        prompt, output: text (output: its first sequence's), None unless the front end
            fills them (--dashboard-show-text): the core has no text.
        lora_name: the name of the LoRA adapter it runs with (LoRARequest.lora_name), or
            None for the base model.
    """

    request_id: str
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    seqs: list[DashboardSequence]
    prompt: str | None = None
    output: str | None = None
    lora_name: str | None = None


@dataclass
class DashboardStep:
    """What one engine step decided, from its events (events.py).

    Attributes:
        step: the engine's step number.
        scheduled: per scheduled sequence {"request_id", "seq_id", "kind" ("prefill",
            "decode" or "verify"), "num_tokens"}.
        preempted: per preemption {"request_id", "mode" ("swap" or "recompute")}.
        copy_on_write: per copied block {"seq_id", "src", "dst"}.
        verified: per sequence that verified drafts {"request_id", "seq_id",
            "num_drafts", "num_accepted", "taken_back" (block ids freed: they held only
            rejected drafts' slots)}.
        in_flight: pipeline parallelism: the batches in flight during the step, oldest
            first, each {"request_ids", "seq_ids"}; the step took in the first one's
            output ([] at pp=1, where a step runs one batch and waits for it).
    """

    step: int
    scheduled: list[dict] = field(default_factory=list)
    preempted: list[dict] = field(default_factory=list)
    copy_on_write: list[dict] = field(default_factory=list)
    verified: list[dict] = field(default_factory=list)
    in_flight: list[dict] = field(default_factory=list)


@dataclass
class DashboardStage:
    """One pipeline stage as its first rank last reported it (multiproc/stage_progress.py).

    Attributes:
        stage: its index (0 embeds the tokens, the last one samples).
        ranks: its global ranks (pp_rank * tp + tp_rank, tp of them).
        state: "idle" (waiting for its next batch), "receiving" (waiting for the previous
            stage's hidden states), "computing" (its layers; the last stage also its
            logits and sampling), "sending" (waiting for its last send to complete), or
            "unknown" (its ranks are on another host: nothing reported).
        batch: the number of the batch it is on (idle: the last it finished), the
            executor's call id of that batch's execute_model; None before the first, or
            unknown.
        request_ids, seq_ids: that batch's while it is in flight (one of the snapshot's
            in_flight, the same seq ids); [] once taken in, or none.
    """

    stage: int
    ranks: list[int]
    state: str
    batch: int | None = None
    request_ids: list[str] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)


@dataclass
class DashboardSnapshot:
    """The engine's state after a step.

    Attributes:
        step: the last step it includes; time: seconds since the engine started.
        block_size: tokens per block; num_gpu_blocks, num_cpu_blocks: the pools' sizes.
        gpu_ref_count: each device block's ref_count (0: free), for the first
            min(num_gpu_blocks, dashboard/sampler.MAX_BLOCKS) blocks, as are the other
            per-block lists.
        gpu_cached: [same length] the block is in the prefix cache.
        gpu_owners: [same length] the ids of the requests holding the block, each once
            ([] when free; n sequences of one request sharing it: one id, ref_count n).
        cpu_owners: CPU block id -> the request holding it, for the held blocks among the
            first MAX_BLOCKS (a swap pool is mostly free; JSON makes the keys strings).
        requests: every unfinished request; running, waiting, swapped: their ids by queue.
        steps: the decisions of the steps since the last snapshot, oldest first, the
            last dashboard/sampler.MAX_STEPS of them (the step numbers show a gap).
        stats: "tokens_per_s" (generated, over the last second), "kv_usage" (fraction of
            device blocks in use), "prefix_cache_hit_rate", "num_preemptions",
            "num_copy_on_write", "num_generated_tokens".
        pipeline_parallel_size: the stages the model is split over (chapter 20).
        in_flight: the batches sent down the pipeline and not yet taken in, oldest first
            (the oldest is the furthest along), each {"request_ids", "seq_ids"}: at most
            pipeline_parallel_size - 1 between two steps ([] at pp=1).
        weight_bytes: the model's weights as the workers hold them, format -> bytes
            (messages.WeightsInfo.bytes_by_format: "float32", or GGUF's "Q4_1", ...).
        stages: pipeline parallelism in a server's engine core: one DashboardStage per
            stage, first to last, what its workers reported as the snapshot was taken;
            [] at pp=1, and in the tracer's replay (read between its steps, the workers'
            live states would be a race, not a replay).
    """

    step: int
    time: float
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu_ref_count: list[int]
    gpu_cached: list[bool]
    gpu_owners: list[list[str]]
    cpu_owners: dict[int, str]
    requests: list[DashboardRequest]
    running: list[str]
    waiting: list[str]
    swapped: list[str]
    steps: list[DashboardStep] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    pipeline_parallel_size: int = 1
    in_flight: list[dict] = field(default_factory=list)
    stages: list[DashboardStage] = field(default_factory=list)
    weight_bytes: dict[str, int] = field(default_factory=dict)
