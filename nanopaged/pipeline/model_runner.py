"""PipelineModelRunner: the runner of one pipeline stage.

Every stage gets every SchedulerOutput and keeps the same per-sequence record (the
scheduler sends each step's sampled tokens back, as in the base engine: vLLM v1 does
the same with PP), so each stage builds the same ModelInput. Then

    first stage:   embed, its layers               -> send IntermediateTensors
    middle stage:  recv, its layers                -> send
    last stage:    recv, its layers, norm, logits  -> prompt logprobs, sample

A stage before the last answers the step with an empty ModelRunnerOutput; the executor
takes the last stage's. Its KV cache holds its own layers only (model.num_kv_cache_layers),
so at the same memory a stage holds pp times the tokens. For the live dashboard it
reports what it is doing (receiving, computing, sending) on its `stage_progress`, which
the worker process points at the executor's board and brackets with preparing and idle
(stage_progress.py).

vLLM: `vllm/v1/worker/gpu_model_runner.py` (`execute_model`'s `get_pp_group()` branches),
`vllm/v1/worker/gpu_worker.py` (the send/recv of intermediate tensors).
"""
from __future__ import annotations

import torch

from ..layers.attention import AttentionMetadata
from ..messages import ModelRunnerOutput, SchedulerOutput
from ..worker.model_input import ModelInput
from ..worker.model_runner import ModelRunner
from ..multiproc.stage_progress import COMPUTING, RECEIVING, SENDING, StageReporter
from .hop import IntermediateTensors, recv, send


class PipelineModelRunner(ModelRunner):
    """ModelRunner of the stage `model.pp.rank` of `model.pp.size` (the model is a
    PipelineStageModel: pipeline/stage_model.py).

    Attributes:
        stage_progress: where it reports its state: a private StageReporter until the
            worker process gives it the board's (worker_proc.WorkerProc).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stage_progress = StageReporter()

    def _forward(self, inp: ModelInput):
        """Receive the previous stage's IntermediateTensors (its step has the same
        num_tokens rows), run this stage's layers, send the result on. Returns the final
        hidden states [num_tokens, hidden_size] on the last stage, None on the others."""
        pp, progress = self.model.pp, self.stage_progress
        received = None
        if not pp.is_first_rank:
            progress.set(RECEIVING)
            received = recv(pp, len(inp.input_ids), self.model.config.hidden_size, self.dtype)
        progress.set(COMPUTING)
        out = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata, received)
        if pp.is_last_rank:
            return out
        progress.set(SENDING)
        send(pp, out)
        return None

    def _after_forward(self, so: SchedulerOutput, inp: ModelInput, hidden) -> ModelRunnerOutput | None:
        if not self.model.pp.is_last_rank:
            return ModelRunnerOutput()          # only the last stage has logits
        return super()._after_forward(so, inp, hidden)

    @torch.inference_mode()
    def sample_tokens(self, sampling_input) -> ModelRunnerOutput:
        """The last stage samples the waiting step (structured outputs); the others,
        which sampled nothing, answer an empty output."""
        if not self.model.pp.is_last_rank:
            return ModelRunnerOutput()
        self.stage_progress.set(COMPUTING)         # the step's batch, still (its execute_model's)
        return super().sample_tokens(sampling_input)

    def _profile_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """This stage's layers alone, zeros for the previous stage's output: no
        communication (the executor adds the stages' times)."""
        received = None
        if not self.model.pp.is_first_rank:
            zeros = torch.zeros(len(input_ids), self.model.config.hidden_size, dtype=self.dtype, device=self.device)
            received = IntermediateTensors(zeros, zeros.clone())
        self.model(input_ids, positions, self.kv_cache, meta, received)

