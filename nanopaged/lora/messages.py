"""Multi-LoRA's messages: the base's request and step message with the adapters added.

The Processor sends a LoRAEngineCoreRequest for a request that names an adapter
(processor.py here); the scheduler sends a LoRASchedulerOutput every step
(LoRAScheduler.scheduler_output_cls), which tells the runner which slot each sequence
uses and which slots to fill first. Both are registered to cross hosts (utils/codec.py).
vLLM keeps `lora_request` on its EngineCoreRequest and the slot mapping in its
`LoRAMapping` (`vllm/lora/layers/utils.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..lora_request import LoRARequest
from ..messages import EngineCoreRequest, SchedulerOutput
from ..utils import codec


@dataclass
class LoRAEngineCoreRequest(EngineCoreRequest):
    """EngineCoreRequest of a request that runs with an adapter.

    Attributes:
        lora_request: its LoRARequest (its folder checked by the Processor).
    """

    lora_request: LoRARequest


@dataclass
class LoRASchedulerOutput(SchedulerOutput):
    """SchedulerOutput plus the adapters.

    Attributes:
        lora_slots: seq_id -> the slot (0 <= slot < max_loras) whose adapter its tokens use,
            for each scheduled sequence with an adapter; absent: none (the base model).
        lora_loads: slot -> the adapter to load into it before this step's forward (its
            previous adapter, if any, is gone: no request in flight uses it).
    """

    lora_slots: dict[int, int] = field(default_factory=dict)
    lora_loads: dict[int, LoRARequest] = field(default_factory=dict)


codec.register(LoRAEngineCoreRequest, LoRASchedulerOutput)
