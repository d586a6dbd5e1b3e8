"""LoRAModelRunner: the runner's side of multi-LoRA.

Each step's message (a LoRASchedulerOutput: messages.py here) says which slots to fill
and which slot each scheduled sequence uses. Before the forward the runner loads those
adapters into the model's slots (LoRAModel.load_lora_slot), from its host cache of
max_cpu_loras adapters (least recently used out) or from disk, then writes every token's
slot into the model's LoRABatch, in prepare_inputs: before the eager forward and before
a CPU graph's replay alike. It knows adapters only as the message names them.
vLLM: `vllm/lora/worker_manager.py` (LRUCacheWorkerLoRAManager), `vllm/v1/worker/lora_model_runner_mixin.py`.
"""
from __future__ import annotations

from collections import OrderedDict

from ..lora_request import LoRARequest
from ..messages import PreemptionCosts
from ..worker.model_input import ModelInput
from ..worker.model_runner import ModelRunner
from .adapter import LoRAAdapter, load_adapter
from .messages import LoRASchedulerOutput


class LoRAModelRunner(ModelRunner):
    """ModelRunner that loads adapters into slots and tells the model each token's slot.

    Attributes:
        cpu_adapters: lora_int_id -> LoRAAdapter (this rank's layers), least recently used
            first, at most lora_config.num_cpu_loras of them.
        num_disk_loads: adapters read from disk so far.
    """

    def __init__(self, config, model, **kwargs) -> None:
        super().__init__(config, model, **kwargs)
        self.lora_config = config.lora_config
        self.cpu_adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_disk_loads = 0

    def _update_states(self, so: LoRASchedulerOutput) -> None:
        super()._update_states(so)
        for slot, lora in so.lora_loads.items():
            self.model.load_lora_slot(slot, self._adapter(lora))

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's weights for this rank's layers, from the host cache or the disk
        (the Processor checked the folder; LoRAAdapterError if it changed since)."""
        adapter = self.cpu_adapters.pop(lora.lora_int_id, None)
        if adapter is None:
            adapter = load_adapter(lora.lora_path, self.model.config, self.lora_config.max_lora_rank,
                                   layers=set(self.model.lora_layers))
            self.num_disk_loads += 1
        self.cpu_adapters[lora.lora_int_id] = adapter
        while len(self.cpu_adapters) > self.lora_config.num_cpu_loras:
            self.cpu_adapters.popitem(last=False)
        return adapter

    def prepare_inputs(self, so: LoRASchedulerOutput) -> ModelInput:
        """ModelRunner.prepare_inputs, and each token's slot in the model's LoRABatch (-1
        for a sequence without an adapter)."""
        inp = super().prepare_inputs(so)
        starts = inp.attn_metadata.query_start_loc_list
        slots = []
        for i, seq_id in enumerate(inp.seq_ids):
            slots += [so.lora_slots.get(seq_id, -1)] * (starts[i + 1] - starts[i])
        self.model.lora_batch.set(slots)
        return inp

    def measure_preemption_costs(self) -> PreemptionCosts:
        """ModelRunner.measure_preemption_costs, its forwards without adapters."""
        self.model.lora_batch.token_slots = None
        return super().measure_preemption_costs()
