"""The LoRA scheduler's rule (lora/scheduler.py), model-free: a hand-driven scheduler
(tests/sched_harness.py) whose requests name adapters. At most max_loras distinct
adapters run in a step; a request holds its adapter's slot while running or swapped; a
request that finds no free slot is passed over, and behind it only requests without an
adapter join, so slots go to the waiting requests in arrival order and none starves.
The prefix cache is keyed by adapter (Sequence.cache_salt)."""
from __future__ import annotations

from sched_harness import Harness

from nanopaged.config import EngineConfig
from nanopaged.events import WaitingForLoRASlot
from nanopaged.lora.messages import LoRAEngineCoreRequest
from nanopaged.lora.scheduler import LoRAScheduler
from nanopaged.lora_request import LoRARequest
from nanopaged.sampling_params import SamplingParams

ADAPTERS = {name: LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("ABC")}


class LoRAHarness(Harness):
    """Harness with a LoRAScheduler of max_loras slots; add(..., lora="A") names an adapter."""

    def __init__(self, max_loras: int, num_gpu_blocks: int = 64, **kwargs) -> None:
        super().__init__(num_gpu_blocks, **kwargs)
        c = self.scheduler.config
        config = EngineConfig(block_size=c.cache_config.block_size, max_num_seqs=c.scheduler_config.max_num_seqs,
                              max_num_batched_tokens=c.scheduler_config.max_num_batched_tokens,
                              max_model_len=c.max_model_len, preemption_mode=c.scheduler_config.preemption_mode,
                              enable_lora=True, max_loras=max_loras)
        self.scheduler = LoRAScheduler(config, self.block_manager)
        self.events = []
        self.add_observer(self.events.append)
        self.adapters_per_step: list[set[str]] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, lora: str | None = None,
            **sampling) -> None:
        if lora is None:
            return super().add(request_id, prompt, max_tokens, **sampling)
        self._clock += 1.0
        self.scheduler.add_request(LoRAEngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens),
                                                         frozenset(), self._clock, ADAPTERS[lora]))
        for seq in self.scheduler.requests[request_id].seqs:
            self._names[seq.seq_id] = request_id

    def schedule(self):
        """schedule(), checking the message: each sequence's slot holds its adapter, and
        at most max_loras distinct adapters run."""
        so = super().schedule()
        s = self.scheduler
        names = set()
        for seq_id, slot in so.lora_slots.items():
            lora = s.lora_requests[s.queues.seqs[seq_id][1].request_id]
            assert s.slots[slot] == lora, (seq_id, slot, s.slots)
            names.add(lora.lora_name)
        assert len(names) <= len(s.slots)
        self.adapters_per_step.append(names)
        return so


def run_to_the_end(h: LoRAHarness, max_steps: int = 200) -> list[str]:
    """Step until every request finished; the request ids in the order they first ran."""
    order = []
    for _ in range(max_steps):
        if not h.scheduler.has_unfinished_requests():
            return order
        so, _ = h.step()
        order += [r for r in dict.fromkeys(h.scheduled(so)) if r not in order]
    raise AssertionError("requests left after max_steps")


def test_a_request_finds_no_free_slot_and_only_requests_without_an_adapter_join_behind_it():
    h = LoRAHarness(max_loras=1)
    h.add("A1", [1, 2, 3], lora="A")
    h.add("B1", [4, 5, 6], lora="B")
    h.add("A2", [7, 8, 9], lora="A")      # A is loaded, but A2 is behind B1, who waits
    h.add("N1", [10, 11, 12])             # no adapter: joins
    so = h.schedule()
    assert set(h.scheduled(so)) == {"A1", "N1"}
    assert so.lora_loads == {0: ADAPTERS["A"]} and so.lora_slots == {h.sid("A1"): 0}
    assert [(e.request_id, e.lora_int_id, e.slots) for e in h.events if isinstance(e, WaitingForLoRASlot)] == [
        ("B1", 2, (1,))]
    assert [g.request_id for g in h.scheduler.waiting] == ["B1", "A2"]


def test_slots_go_to_waiting_requests_in_arrival_order_and_none_starves():
    """max_loras=1, three adapters: the adapters' requests first run in arrival order,
    a request without one runs at once, and a stream of A's does not starve B."""
    h = LoRAHarness(max_loras=1)
    for rid, lora in (("A1", "A"), ("B1", "B"), ("A2", "A"), ("C1", "C"), ("N1", None), ("B2", "B"), ("A3", "A")):
        h.add(rid, [len(rid), ord(rid[0]), 3], max_tokens=3, lora=lora)
    order = run_to_the_end(h)
    # B2 does not join B1 while A2, ahead of it, waits for a slot: arrival order exactly
    assert order == ["A1", "N1", "B1", "A2", "C1", "B2", "A3"]
    assert all(len(names) <= 1 for names in h.adapters_per_step)


def test_at_most_max_loras_adapters_a_step_with_more_in_flight():
    h = LoRAHarness(max_loras=2, max_num_seqs=16)
    for i in range(9):
        h.add(f"R{i}", [i + 1, i + 2, i + 3, i + 4, i + 5], max_tokens=2 + i % 4, lora="ABC"[i % 3])
    order = run_to_the_end(h)
    assert sorted(order) == sorted(f"R{i}" for i in range(9))
    assert max(len(names) for names in h.adapters_per_step) == 2
    assert h.scheduler.lora_requests == {}


def test_an_idle_slot_is_reloaded_least_recently_used_first():
    h = LoRAHarness(max_loras=2)
    h.add("A1", [1, 2], max_tokens=1, lora="A")
    h.step()
    h.add("B1", [3, 4], max_tokens=1, lora="B")
    h.step()                                    # A's slot 0, B's slot 1, both idle now
    h.add("A2", [5, 6], max_tokens=1, lora="A")
    a2 = h.sid("A2")
    so, _ = h.step()                            # A is loaded: no load; slot 0 used again
    assert so.lora_loads == {} and so.lora_slots == {a2: 0}
    h.add("C1", [7, 8], max_tokens=1, lora="C")
    so = h.schedule()                           # B's slot was used longest ago
    assert so.lora_loads == {1: ADAPTERS["C"]} and h.scheduler.num_slot_loads == 3


def test_a_swapped_request_keeps_its_slot_and_a_recomputed_one_asks_again():
    for mode in ("swap", "recompute"):
        h = LoRAHarness(max_loras=1, num_gpu_blocks=6, preemption_mode=mode, num_cpu_blocks=16)
        h.add("A1", list(range(1, 9)), max_tokens=12, lora="A")        # 2 blocks, grows
        h.add("A2", list(range(20, 28)), max_tokens=12, lora="A")
        h.add("B1", [40, 41], max_tokens=2, lora="B")                   # waits for A's slot
        preempted = []
        for _ in range(40):
            if not h.scheduler.has_unfinished_requests():
                break
            h.step()
            preempted += h.preempted
            if preempted and mode == "swap" and h.scheduler.swapped:
                # swapped: A still holds the slot, so B1 cannot take it
                assert h.scheduler.slots == [ADAPTERS["A"]]
        assert ("A2", mode) in preempted
        assert not h.scheduler.has_unfinished_requests()
        assert all(len(names) <= 1 for names in h.adapters_per_step)


def test_the_same_prompt_under_two_adapters_shares_no_block_and_under_one_it_hits():
    h = LoRAHarness(max_loras=2)
    prompt = list(range(1, 18))                 # 4 full blocks of 4
    h.add("A1", prompt, max_tokens=1, lora="A")
    h.step()
    for rid, lora, hits in (("B1", "B", 0), ("N1", None, 0), ("A2", "A", 16)):
        h.add(rid, prompt, max_tokens=1, lora=lora)
        h.step()
        assert h.scheduler.requests.get(rid) is None
        assert h.block_manager.prefix_cache_hits == hits, rid
        hits = h.block_manager.prefix_cache_hits


def test_without_a_salt_the_hashes_are_the_plain_ones():
    from nanopaged.core.block_manager import BlockManager, hash_block_tokens
    from nanopaged.core.sequence import Sequence

    bm, seq = BlockManager(8, 4), Sequence(0, 0, list(range(9)), 4)
    first = hash_block_tokens(None, list(range(4)))
    assert bm._full_block_hashes(seq) == [first, hash_block_tokens(first, list(range(4, 8)))]
    salted = Sequence(1, 0, list(range(9)), 4)
    salted.cache_salt = b"lora:1"
    assert bm._full_block_hashes(salted)[0] == hash_block_tokens(b"lora:1", list(range(4))) != first
