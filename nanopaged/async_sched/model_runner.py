"""AsyncModelRunner: the runner's side of async scheduling (chapter 16).

With async scheduling the next step is scheduled before this step's tokens are known,
so the scheduler does not send them back: the runner appends what it sampled to its
own record at once. vLLM v1's GPUModelRunner does the same (`vllm/v1/worker/
gpu_model_runner.py`, async scheduling); the scheduler's side is async_sched/scheduler.py.
"""
from __future__ import annotations

from ..messages import ModelRunnerOutput
from ..worker.model_input import ModelInput
from ..worker.model_runner import ModelRunner


class AsyncModelRunner(ModelRunner):
    """ModelRunner that records its own samples (`_after_sample`)."""

    def _after_sample(self, inp: ModelInput, out: ModelRunnerOutput) -> None:
        super()._after_sample(inp, out)      # first: a proposer reads the record without them
        self.input_batch.append_output_tokens(list(out.sampled_token_ids), list(out.sampled_token_ids.values()))
