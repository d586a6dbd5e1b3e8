"""A Scheduler driven by hand, with no model (issue 23): the test plays the runner.

`Harness` holds what check_block_invariants (tests/invariants.py) looks at on an engine:
`scheduler`, `block_manager` and `model_runner`. The last is `RunnerRecord`, the model
runner's record of each sequence rebuilt from the SchedulerOutput messages alone, as
ModelRunner._update_states does; from it, `samplers` says which sequences a real runner
would sample in a step (ModelRunner.prepare_inputs' rule). `finish` refuses a hand-made
ModelRunnerOutput that samples for any other set, so the tests can only feed the
scheduler what an engine would.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from invariants import EventReplay, check_block_invariants
from nanopaged.core.block_manager import BlockManager
from nanopaged.config import EngineConfig
from nanopaged.core.scheduler import Scheduler
from nanopaged.events import Preempted
from nanopaged.messages import (EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput,
                                       SchedulerOutput)
from nanopaged.sampling_params import SamplingParams


@dataclass
class SeqRecord:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class RunnerRecord:
    """What the runner knows of each sequence, from the messages only."""

    def __init__(self) -> None:
        self.seqs: dict[int, SeqRecord] = {}
        # where check_runner_state reads a ModelRunner's records (its InputBatch's seqs)
        self.input_batch = SimpleNamespace(seqs=self.seqs)

    def update(self, so: SchedulerOutput) -> None:
        for seq_id in so.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in so.scheduled_new_reqs:
            self.seqs[new.seq_id] = SeqRecord(new.prompt_token_ids, list(new.output_token_ids),
                                              list(new.block_ids), new.num_computed_tokens)
        c = so.scheduled_cached_reqs
        for seq_id, tokens, blocks, replaced, computed in zip(c.seq_ids, c.new_token_ids, c.new_block_ids,
                                                              c.block_ids_replaced, c.num_computed_tokens):
            state = self.seqs[seq_id]
            state.output_token_ids.extend(tokens)
            state.block_ids = list(blocks) if replaced else state.block_ids + list(blocks)
            state.num_computed_tokens = computed

    def samplers(self, so: SchedulerOutput) -> list[int]:
        """The rows a real runner samples, in its order (ModelRunner.prepare_inputs):
        each sequence whose last token is computed this step, then the forks that
        sample from its row; decodes before prefills."""
        rows = [(i, n) for i, n in so.num_scheduled_tokens.items() if n]
        rows.sort(key=lambda r: not (r[1] == 1 and self.seqs[r[0]].num_computed_tokens
                                     >= len(self.seqs[r[0]].prompt_token_ids)))
        forks = {}
        for fork, parent in so.sample_from.items():
            forks.setdefault(parent, []).append(fork)
        return [j for i, n in rows if self.seqs[i].num_computed_tokens + n == self.seqs[i].num_tokens
                for j in (i, *forks.get(i, []))]


class Harness:
    """Scheduler + BlockManager (block size 4 by default) + RunnerRecord, with the
    block-accounting invariants and the event replay checked after every step.

    Attributes:
        preempted: (request_id, mode) of each preemption made by the last schedule().
    """

    def __init__(self, num_gpu_blocks: int, budget: int = 64, max_num_seqs: int = 8, block_size: int = 4,
                 chunked: bool = True, prefix_caching: bool = True, preemption_mode: str = "recompute",
                 num_cpu_blocks: int = 0, max_model_len: int = 256) -> None:
        self.block_manager = BlockManager(num_gpu_blocks, block_size, prefix_caching, num_cpu_blocks)
        config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                              max_model_len=max_model_len, enable_chunked_prefill=chunked,
                              preemption_mode=preemption_mode)
        self.scheduler = Scheduler(config, self.block_manager)
        self.model_runner = RunnerRecord()
        self.preempted: list[tuple[str, str]] = []
        self._names: dict[int, str] = {}
        self._clock = 0.0
        self.replay = EventReplay(self)           # rebuilds the books from the events alone

    # what EventReplay asks of an engine
    @property
    def requests(self):
        return self.scheduler.requests

    def add_observer(self, observer) -> None:
        self.block_manager.observers.append(observer)

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, n: int = 1, **sampling) -> None:
        """A request arriving now (later than every earlier one); `sampling`: more
        SamplingParams fields (stop_token_ids, ...)."""
        self._clock += 1.0
        params = SamplingParams(n=n, max_tokens=max_tokens, **sampling)
        self.scheduler.add_request(EngineCoreRequest(request_id, prompt, params, frozenset(), self._clock))
        for seq in self.scheduler.requests[request_id].seqs:
            self._names[seq.seq_id] = request_id if seq.index == 0 else f"{request_id}/{seq.index}"

    def seq(self, request_id: str, index: int = 0):
        return self.scheduler.requests[request_id].seqs[index]

    def sid(self, request_id: str, index: int = 0) -> int:
        return self.seq(request_id, index).seq_id

    def schedule(self) -> SchedulerOutput:
        """schedule(), which the runner's record takes in; notes its preemptions."""
        events = []
        self.add_observer(events.append)
        try:
            so = self.scheduler.schedule()
        finally:
            self.block_manager.observers.remove(events.append)
        self.preempted = [(e.request_id, e.mode) for e in events if isinstance(e, Preempted)]
        self.model_runner.update(so)
        return so

    def scheduled(self, so: SchedulerOutput) -> dict[str, int]:
        """Tokens computed per sequence this step, by name: "A", or "A/1" for index 1."""
        return {self._names[i]: n for i, n in so.num_scheduled_tokens.items()}

    def samplers(self, so: SchedulerOutput) -> set[str]:
        """The sequences a real runner samples in this step, by name."""
        return {self._names[i] for i in self.model_runner.samplers(so)}

    def finish(self, so: SchedulerOutput, sampled: dict[str, int]) -> EngineCoreOutputs:
        """Hand the scheduler a ModelRunnerOutput with these tokens, by sequence name
        (exactly the sequences a runner samples), then check the invariants."""
        assert set(sampled) == self.samplers(so), f"a runner samples {self.samplers(so)}, not {set(sampled)}"
        rows = self.model_runner.samplers(so)            # in the runner's order
        runner_output = ModelRunnerOutput(sampled_token_ids={i: sampled[self._names[i]] for i in rows})
        out = self.scheduler.update_from_output(so, runner_output)
        self.check()
        return out

    def step(self, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        """One whole step: schedule, then sample `tokens` (default: token 7 for every
        sequence that samples)."""
        so = self.schedule()
        out = self.finish(so, tokens if tokens is not None else dict.fromkeys(self.samplers(so), 7))
        return so, out

    def check(self) -> None:
        check_block_invariants(self)
        self.replay.check()

    def free_blocks(self) -> int:
        return self.block_manager.get_num_free_gpu_blocks()
