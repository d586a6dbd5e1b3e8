"""Multi-LoRA, the scheduler's side: which adapter sits in which of the model's
max_loras slots, and who may run.

The model holds max_loras adapters at once (model.py here), so a step can serve at most
that many distinct adapters. The scheduler decides which, and tells the runner in the
step's message (a LoRASchedulerOutput: each scheduled sequence's slot, and the slots to
load first). The rule:

- a request holds its adapter's slot while it is running or swapped (preemption by swap
  keeps it; by recompute it waits again and asks again);
- a waiting request whose adapter is in a slot may join; one whose adapter is not takes
  a free slot: an empty one first, else the least recently used of those whose adapter
  no running or swapped request uses;
- a waiting request that finds no free slot is passed over (the base's `_can_join`), and
  the requests behind it join only if they need no slot at all (no adapter). So the
  adapters in use drain, and the first slot freed goes to the oldest waiting request's
  adapter: nobody starves, and admission stays first come first served among requests
  that need a slot.

Sequences of a request with an adapter start their prefix-cache hashes from a salt of its
lora_int_id (Sequence.cache_salt): the same prompt under two adapters shares no block,
under the same adapter it does. S-LoRA (Sheng et al. 2023) and vLLM's scheduler
(`vllm/v1/core/sched/scheduler.py`, its max_loras check) do the same.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..core.scheduler_output import ScheduledStep
from ..core.sequence import SequenceGroup
from ..events import WaitingForLoRASlot
from ..lora_request import LoRARequest
from ..messages import EngineCoreRequest
from .messages import LoRAEngineCoreRequest, LoRASchedulerOutput


class LoRAScheduler(Scheduler):
    """The scheduler with LoRA adapter slots (see the module doc).

    Attributes:
        lora_requests: request_id -> its LoRARequest, for requests with an adapter.
        slots: slot -> the LoRARequest loaded there (None: empty); len == max_loras.
        num_slot_loads: adapters loaded into a slot so far.
    """

    scheduler_output_cls = LoRASchedulerOutput

    def __init__(self, config: EngineConfig, block_manager: BlockManager, **kwargs) -> None:
        super().__init__(config, block_manager, **kwargs)
        self.lora_requests: dict[str, LoRARequest] = {}
        self.slots: list[LoRARequest | None] = [None] * config.lora_config.max_loras
        self.num_slot_loads = 0
        self._last_used = [0] * len(self.slots)       # the step that last used each slot (LRU)
        self._num_steps = 0
        self._loads: dict[int, LoRARequest] = {}      # slot -> adapter to load, not yet sent
        self._passed_over = False                    # a request with an adapter waits this step
        self._announced: set[str] = set()            # waiting for a slot, its event published

    def _make_group(self, request: EngineCoreRequest) -> SequenceGroup:
        group = super()._make_group(request)
        if isinstance(request, LoRAEngineCoreRequest):
            lora = self.lora_requests[group.request_id] = request.lora_request
            for seq in group.seqs:               # its blocks are named under its adapter only
                seq.cache_salt = f"lora:{lora.lora_int_id}".encode()
        return group

    def _request_removed(self, group: SequenceGroup) -> None:
        super()._request_removed(group)
        self.lora_requests.pop(group.request_id, None)
        self._announced.discard(group.request_id)

    def schedule(self) -> LoRASchedulerOutput:
        self._passed_over = False
        self._num_steps += 1
        return super().schedule()

    def _can_join(self, group: SequenceGroup, step: ScheduledStep) -> bool:
        """A request with an adapter joins if its adapter has a slot (one is given to it
        here if free); none does behind one that found no slot."""
        lora = self.lora_requests.get(group.request_id)
        if lora is None:
            return super()._can_join(group, step)
        if self._passed_over:
            return False
        if self._slot_for(lora) is None:
            self._passed_over = True
            if self.observers and group.request_id not in self._announced:
                self._announced.add(group.request_id)
                self.observers.publish(WaitingForLoRASlot(group.request_id, lora.lora_int_id,
                                                          tuple(s.lora_int_id for s in self.slots)))
            return False
        self._announced.discard(group.request_id)
        return super()._can_join(group, step)

    def _slot_for(self, lora: LoRARequest) -> int | None:
        """The slot holding `lora`, else a free one, now given to it (loaded before the next
        forward); None when every slot's adapter is in use."""
        for slot, held in enumerate(self.slots):
            if held is not None and held.lora_int_id == lora.lora_int_id:
                return slot
        in_use = {self.lora_requests[g.request_id].lora_int_id for g in (*self.running, *self.swapped)
                  if g.request_id in self.lora_requests}
        free = [s for s, held in enumerate(self.slots) if held is None or held.lora_int_id not in in_use]
        if not free:
            return None
        slot = min(free, key=lambda s: (self.slots[s] is not None, self._last_used[s]))
        self.slots[slot] = self._loads[slot] = lora
        self._last_used[slot] = self._num_steps
        self.num_slot_loads += 1
        return slot

    def _after_schedule(self, step: ScheduledStep, samples: list[bool], out: LoRASchedulerOutput) -> None:
        """Each scheduled sequence's slot, and the slots to load before the forward."""
        slot_of = {held.lora_int_id: s for s, held in enumerate(self.slots) if held is not None}
        for s in step.scheduled:
            lora = self.lora_requests.get(s.seq_group.request_id)
            if lora is not None:
                slot = slot_of[lora.lora_int_id]       # running: its adapter holds a slot
                out.lora_slots[s.seq.seq_id] = slot
                self._last_used[slot] = self._num_steps
        out.lora_loads, self._loads = self._loads, {}
        super()._after_schedule(step, samples, out)
