"""The pipeline stages' runners (pipeline/model_runner.py) and their transport.

- In one process: stage runners fed the same SchedulerOutputs as one whole-model
  ModelRunner, their IntermediateTensors passed through real PPGroups over an
  in-process queue, sample the same tokens with the same logprobs and prompt logprobs
  (seeded and greedy), and each caches only its own layers; a stage before the last
  answers empty. Their preemption-cost measurement sends nothing.
- A stage's Worker: its KV block counts its own layers; its counters; a grid that
  does not match the world size is refused.
- Over real gloo: three stages (threads, a FileStore group in tmp_path) pass their
  IntermediateTensors on, in order, counting hops and bytes.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from nanopaged import SamplingParams
from nanopaged.features import Composition
from nanopaged.config import EngineConfig
from nanopaged.exercises.tiny_model import make_tiny_model
from nanopaged.layers.groups import PPGroup
from nanopaged.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from nanopaged.model.model_loader import load_model
from nanopaged.pipeline.hop import IntermediateTensors, recv, send, wait_sent
from nanopaged.pipeline.stage_model import PipelineStageModel
from nanopaged.worker.model_runner import ModelRunner
from nanopaged.pipeline.model_runner import PipelineModelRunner
from nanopaged.structured_output.model_runner import StructuredOutputModelRunner

from test_pipeline_stage import QueueTransport, stage_class

pytestmark = pytest.mark.timeout(300)

BLOCK = 4


@pytest.fixture(scope="module")
def three_layer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp-runner-qwen2")
    make_tiny_model(folder, "Qwen2ForCausalLM", tie=True, num_hidden_layers=3)
    return folder


def runners(folder, pp_size: int):
    """(whole-model ModelRunner, [stage runners]) with the same config and pools."""
    config = EngineConfig(block_size=BLOCK, seed=3)
    load = lambda **kw: load_model(folder, torch.float32, torch.device("cpu"), 64, **kw)   # noqa: E731
    whole = ModelRunner(config, load(), num_gpu_blocks=24, num_cpu_blocks=4)
    transport = QueueTransport(pp_size)
    stages = [PipelineModelRunner(config, load(pp=PPGroup(r, pp_size, transport), model_class=stage_class),
                                  num_gpu_blocks=24, num_cpu_blocks=4) for r in range(pp_size)]
    return whole, stages, transport


def steps(run):
    """Drive `run(SchedulerOutput) -> ModelRunnerOutput` as a scheduler would: two
    prompts prefilled (one with prompt logprobs), then 5 decodes fed their samples."""
    greedy = SamplingParams(temperature=0, logprobs=2, prompt_logprobs=1, max_tokens=8)
    seeded = SamplingParams(temperature=0.8, seed=11, logprobs=1, max_tokens=8)
    prompts = {0: list(range(5, 14)), 1: list(range(40, 46))}
    tables = {0: [7, 2, 9], 1: [4, 11]}
    new = [NewRequestData(0, 0, prompts[0], [], greedy, tables[0], 0),
           NewRequestData(1, 0, prompts[1], [], seeded, tables[1], 0)]
    outs = [run(SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens={0: 9, 1: 6},
                                total_num_scheduled_tokens=15))]
    lengths = {0: 9, 1: 6}
    free = iter([13, 1, 20])
    for _ in range(5):
        sampled = outs[-1].sampled_token_ids
        new_blocks = []
        for i in (0, 1):
            grow = lengths[i] % BLOCK == 0            # the sampled token starts a new block
            new_blocks.append([next(free)] if grow else [])
        cached = CachedRequestData([0, 1], [[sampled[0]], [sampled[1]]], new_blocks, [False, False],
                                   [lengths[0], lengths[1]])
        outs.append(run(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={0: 1, 1: 1},
                                        total_num_scheduled_tokens=2)))
        lengths = {i: n + 1 for i, n in lengths.items()}
    return outs


@pytest.mark.parametrize("pp_size", [2, 3])
def test_stage_runners_sample_what_the_whole_model_samples(three_layer, pp_size):
    whole, stages, transport = runners(three_layer, pp_size)
    expected = steps(lambda so: whole.execute_model(copy.deepcopy(so)))

    def run_stages(so):
        answers = [stage.execute_model(copy.deepcopy(so)) for stage in stages]   # stage order: as the sends flow
        assert all(a == ModelRunnerOutput() for a in answers[:-1])               # only the last stage answers
        return answers[-1]

    got = steps(run_stages)
    assert [o.sampled_token_ids for o in got] == [o.sampled_token_ids for o in expected]
    assert [o.logprobs for o in got] == [o.logprobs for o in expected]
    assert got[0].prompt_logprobs == expected[0].prompt_logprobs and got[0].prompt_logprobs
    # each stage caches its own layers: 3 layers as 2 + 1, or 1 + 1 + 1
    assert [s.kv_cache.shape[0] for s in stages] == ([2, 1] if pp_size == 2 else [1, 1, 1])
    assert torch.equal(torch.cat([s.kv_cache for s in stages]), whole.kv_cache)
    assert [s.model.pp.num_hops for s in stages] == [6] * (pp_size - 1) + [0]
    assert all(not q for q in transport.queues)


def test_stage_preemption_costs_send_nothing(three_layer):
    _, stages, transport = runners(three_layer, 2)
    for stage in stages:
        costs = stage.measure_preemption_costs()
        assert costs.seconds_per_token_recompute > 0 and 0 < costs.seconds_per_block_swap < float("inf")
        assert not stage.kv_cache.any()                     # back to the zero state
    assert transport.sent == [] and [s.model.pp.num_hops for s in stages] == [0, 0]


def test_the_pipeline_runner_class_comes_from_the_composition():
    cls = Composition.of(EngineConfig(pipeline_parallel_size=2)).build(ModelRunner, "model_runner")
    assert cls.__name__ == "PipelineStructuredOutputModelRunner"
    assert cls.__mro__[1:4] == (PipelineModelRunner, StructuredOutputModelRunner, ModelRunner)


def test_the_ends_of_a_pipeline_refuse_to_send_or_receive_past_them():
    first, last = PPGroup(0, 2, QueueTransport(2)), PPGroup(1, 2, QueueTransport(2))
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="stage 1 of 2 is the last"):
        send(last, IntermediateTensors(x, x))
    with pytest.raises(RuntimeError, match="stage 0 of 2 is the first"):
        recv(first, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="PPGroup of size 2 needs a process_group"):
        PPGroup(0, 2)


def test_stages_over_real_gloo_pass_their_tensors_on_in_order(tmp_path):
    """pp=3 over a gloo ProcessGroup (made from a FileStore in tmp_path; the ranks are
    threads, so no process start): stage 0 sends, stage 1 receives, adds and sends on,
    stage 2 receives; two hops of different sizes, in order. (Worker processes over the
    tp x pp grid, with make_parallel_groups' new_group path: tests/pipeline/test_pipeline_parallel.py.)"""
    from datetime import timedelta

    import torch.distributed as dist

    from nanopaged.layers.groups import make_parallel_groups

    got, errors = {}, []

    def stage_main(rank):
        try:
            group = dist.ProcessGroupGloo(dist.FileStore(str(tmp_path / "store"), 3), rank, 3,
                                          timedelta(seconds=60))
            _, pp = make_parallel_groups(rank, 1, 3, group)
            for n in (3, 5):
                if pp.is_first_rank:
                    send(pp, IntermediateTensors(torch.full((n, 8), float(n)), torch.full((n, 8), -float(n))))
                    continue
                t = recv(pp, n, 8, torch.float32)
                if not pp.is_last_rank:
                    send(pp, IntermediateTensors(t.hidden_states + 100, t.residual))
                else:
                    got[n] = (t.hidden_states.unique().tolist(), t.residual.unique().tolist(),
                              list(t.hidden_states.shape))
            wait_sent(pp)       # a send returns before it completes: done before the group goes
            got[rank] = (pp.num_hops, pp.bytes_sent, pp.prev_rank, pp.next_rank)
        except Exception as e:          # noqa: BLE001 - reported by the test
            errors.append((rank, e))

    threads = [threading.Thread(target=stage_main, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert got[3] == ([103.0], [-3.0], [3, 8]) and got[5] == ([105.0], [-5.0], [5, 8])
    hop_bytes = 2 * (3 + 5) * 8 * 4                       # [2, n, 8] fp32, n = 3 then 5
    assert [got[r] for r in range(3)] == [(2, hop_bytes, None, 1), (2, hop_bytes, 0, 2), (0, 0, 1, None)]


def test_a_stage_worker_holds_and_counts_its_own_layers(three_layer):
    from nanopaged.layers.backends import TorchOps
    from nanopaged.model.config import ModelConfig
    from nanopaged.worker.worker import Worker

    model_config = ModelConfig.from_pretrained(three_layer)

    def worker(pp_size, rank, world_size=None):
        config = EngineConfig(model=str(three_layer), block_size=BLOCK, max_model_len=64, dtype="float32",
                              pipeline_parallel_size=pp_size)
        group = QueueTransport(pp_size) if pp_size > 1 else None      # the world group of a 1 x pp grid
        return Worker(config, three_layer, model_config, ops=TorchOps(), rank=rank,
                      world_size=pp_size if world_size is None else world_size, process_group=group)

    whole, first, last = worker(1, 0), worker(2, 0), worker(2, 1)
    # 3 layers as 2 + 1: a stage's block holds its layers only, so pp=2 fits more blocks per rank
    per_layer = whole.kv_cache_bytes_per_block() // 3
    assert [first.kv_cache_bytes_per_block(), last.kv_cache_bytes_per_block()] == [2 * per_layer, per_layer]
    assert (first.pp.rank, last.pp.rank, first.tp.size) == (0, 1, 1)
    assert isinstance(last.model, PipelineStageModel) and not isinstance(whole.model, PipelineStageModel)
    assert set(last.get_comm_stats()) == {"comm_seconds", "num_collectives", "pp_send_seconds", "pp_recv_seconds",
                                          "pp_bytes_sent", "pp_num_hops"}
    with pytest.raises(ValueError, match=r"world_size=3 but tensor_parallel_size=1 x pipeline_parallel_size=2 = 2"):
        worker(2, 0, world_size=3)
