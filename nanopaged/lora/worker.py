"""Multi-LoRA, the worker's side: once the weights are loaded (and before the KV pool is
sized, so their memory counts), the model's projections get their adapter slots
(LoRAModel.create_lora_slots: max_loras slots of rank max_lora_rank)."""
from __future__ import annotations

import logging

from ..worker.worker import Worker

logger = logging.getLogger(__name__)


class LoRAWorker(Worker):
    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        lc = config.lora_config
        self.model.create_lora_slots(lc.max_loras, lc.max_lora_rank, config.scheduler_config.max_num_batched_tokens)
        if self.rank == 0:
            logger.info("LoRA: %d adapter slot%s of rank %d, %d adapter%s cached in host memory", lc.max_loras,
                        "s" if lc.max_loras > 1 else "", lc.max_lora_rank, lc.num_cpu_loras,
                        "s" if lc.num_cpu_loras > 1 else "")
