"""Pipeline stages (layers/groups.py, pipeline/stage_model.py, pipeline/hop.py), in one process.

- get_pp_indices splits the layers by vLLM's rule (its own examples), and refuses more
  stages than layers, naming both;
- stages 0..pp-1 of every family's tiny model, tied and untied, chained through real
  PPGroups over an in-process transport (a queue per stage), give the whole model's
  logits to the bit, prefill then paged decode, at pp=2 and pp=3;
- a stage holds and loads only its own tensors (the others are never read), and the
  missing-weights check covers exactly what the stage holds.
"""
from __future__ import annotations

from collections import deque

import pytest
import torch

from nanopaged.exercises.tiny_model import TINY_FAMILIES, make_tiny_model
from nanopaged.layers.groups import PPGroup, get_pp_indices
from nanopaged.model.model_loader import load_model
from nanopaged.pipeline.hop import IntermediateTensors, recv, send
from nanopaged.pipeline.stage_model import PipelineStageModel, PPMissingLayer

from conftest import paged_logits

TOKENS = torch.randint(1, 320, (23,), generator=torch.Generator().manual_seed(2)).tolist()
NUM_LAYERS = 5          # pp=2: 3 + 2 layers; pp=3: 2 + 2 + 1


def stage_class(family: type) -> type:
    """What Composition.of(config).build(family, "model") builds with pp > 1."""
    return type(family.__name__, (PipelineStageModel, family), {})


class QueueTransport:
    """An in-process stand-in for a ProcessGroup's send/recv: a queue per stage."""

    def __init__(self, size: int) -> None:
        self.queues = [deque() for _ in range(size)]
        self.sent = []                              # (src stage, dst stage, shape)

    def send(self, tensors, dst, tag):
        self.queues[dst].append(tensors[0].clone())
        self.sent.append((dst - 1, dst, tuple(tensors[0].shape)))
        return _Done()

    def recv(self, tensors, src, tag):
        message = self.queues[src + 1].popleft()
        tensors[0].copy_(message)
        return _Done()


class _Done:
    def wait(self):
        return True


class Chain:
    """The stages as one model with the whole model's interface (for paged_logits): each
    stage runs its layers on its slice of the KV cache, and hands its
    IntermediateTensors to the next through its PPGroup."""

    def __init__(self, stages: list[PipelineStageModel]) -> None:
        self.stages, self.config = stages, stages[0].config
        self.dtype = torch.float32
        self.num_local_kv_heads = stages[0].num_local_kv_heads

    def __call__(self, input_ids, positions, kv_caches, meta):
        received = None
        for stage in self.stages:
            if not stage.pp.is_first_rank:
                received = recv(stage.pp, len(input_ids), self.config.hidden_size, self.dtype)
            out = stage(input_ids, positions, kv_caches[stage.start_layer:stage.end_layer], meta, received)
            if not stage.pp.is_last_rank:
                assert isinstance(out, IntermediateTensors)
                send(stage.pp, out)
        return out

    def compute_logits(self, hidden):
        return self.stages[-1].compute_logits(hidden)


@pytest.fixture(scope="module")
def five_layer(tmp_path_factory):
    """five_layer(architecture, tie) -> folder of a 5-layer tiny checkpoint of that family."""
    made = {}

    def get(arch, tie):
        if (arch, tie) not in made:
            made[arch, tie] = folder = tmp_path_factory.mktemp(f"pp-{arch}-{tie}")
            make_tiny_model(folder, arch, tie=tie, num_hidden_layers=NUM_LAYERS)
        return made[arch, tie]
    return get


def load_stages(folder, pp_size: int, transport=None) -> list[PipelineStageModel]:
    transport = transport or QueueTransport(pp_size)
    return [load_model(folder, torch.float32, torch.device("cpu"), 64, pp=PPGroup(r, pp_size, transport),
                       model_class=stage_class) for r in range(pp_size)]


@pytest.mark.parametrize("num_layers, pp_size, sizes", [
    (22, 4, [5, 6, 6, 5]), (5, 3, [2, 2, 1]), (4, 3, [1, 2, 1]), (30, 2, [15, 15]), (30, 3, [10, 10, 10]),
    (30, 4, [7, 8, 8, 7]), (7, 1, [7]), (3, 3, [1, 1, 1])])
def test_get_pp_indices_splits_as_vllm(num_layers, pp_size, sizes):
    ranges = [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)]
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))       # consecutive, no gap


def test_more_stages_than_layers_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 exceeds the model's num_hidden_layers=2"):
        get_pp_indices(2, 0, 3)
    with pytest.raises(ValueError, match=r"pp_rank=2 must be an integer in \[0, 2\)"):
        get_pp_indices(4, 2, 2)


@pytest.mark.parametrize("pp_size", [2, 3])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_stages_chained_equal_the_whole_model_to_the_bit(five_layer, arch, tie, pp_size):
    folder = five_layer(arch, tie)
    whole = load_model(folder, torch.float32, torch.device("cpu"), 64)
    transport = QueueTransport(pp_size)
    stages = load_stages(folder, pp_size, transport)
    assert [type(s).__name__ for s in stages] == [arch] * pp_size       # the family's class, a stage of it
    chain = Chain(stages)
    assert torch.equal(paged_logits(chain, TOKENS, 4, prefill=15), paged_logits(whole, TOKENS, 4, prefill=15))
    # every step crossed every boundary once: the prefill, then 8 decodes
    assert len(transport.sent) == 9 * (pp_size - 1)
    assert all(q == deque() for q in transport.queues)
    assert [s.pp.num_hops for s in stages] == [9] * (pp_size - 1) + [0]
    hidden = whole.config.hidden_size
    assert stages[0].pp.bytes_sent == (15 + 8) * 2 * hidden * 4          # [2, n, hidden] fp32 per hop


@pytest.mark.parametrize("pp_size", [2, 3])
@pytest.mark.parametrize("arch, tie", [("LlamaForCausalLM", True), ("Qwen3ForCausalLM", False)])
def test_stages_in_bf16_with_the_cpu_kernels_equal_the_whole_model_to_the_bit(five_layer, arch, tie, pp_size):
    from nanopaged.layers.backends import get_ops

    ops = get_ops("cpu", "cpu")          # fused add + RMSNorm in place on the received tensors, bf16 matmuls
    folder = five_layer(arch, tie)
    whole = load_model(folder, torch.bfloat16, torch.device("cpu"), 64)
    stages = [load_model(folder, torch.bfloat16, torch.device("cpu"), 64, pp=PPGroup(r, pp_size, transport),
                         model_class=stage_class) for transport in [QueueTransport(pp_size)] for r in range(pp_size)]
    for model in (whole, *stages):
        model.set_ops(ops)
    chain = Chain(stages)
    chain.dtype = torch.bfloat16
    expected = paged_logits(whole, TOKENS, 4, prefill=15, dtype=torch.bfloat16)
    assert torch.equal(paged_logits(chain, TOKENS, 4, prefill=15, dtype=torch.bfloat16), expected)


def test_a_stage_holds_only_its_part(five_layer):
    folder = five_layer("Qwen3ForCausalLM", True)
    first, middle, last = load_stages(folder, 3)
    for stage, held in zip((first, middle, last), ([0, 1], [2, 3], [4])):
        assert [i for i, layer in enumerate(stage.layers) if not isinstance(layer, PPMissingLayer)] == held
        assert stage.num_kv_cache_layers == len(held)
        names = {n.split(".")[0] for n, _ in stage.named_parameters()}
        assert names == {"embed_tokens", "layers"} if stage is first else \
            {"layers"} if stage is middle else {"layers", "norm", "lm_head"}
    whole = load_model(folder, torch.float32, torch.device("cpu"), 64)
    # tied: the last stage's head is the embedding matrix, read from embed_tokens.weight
    assert torch.equal(last.lm_head.weight, whole.embed_tokens.weight)
    assert sum(p.numel() for s in (first, middle, last) for p in s.parameters()) == \
        sum(p.numel() for p in whole.parameters()) + whole.embed_tokens.weight.numel()
    with pytest.raises(RuntimeError, match="stage 0 of 3 holds no LM head"):
        first.compute_logits(torch.zeros(1, whole.config.hidden_size))


def test_a_stage_reads_only_its_tensors(five_layer, monkeypatch):
    folder = five_layer("LlamaForCausalLM", False)
    from nanopaged.model import llama

    read = []
    original = llama.LlamaForCausalLM._load_one

    def spy(self, name, src, file):
        read.append(name)
        return original(self, name, src, file)

    monkeypatch.setattr(llama.LlamaForCausalLM, "_load_one", spy)
    load_model(folder, torch.float32, torch.device("cpu"), 64, pp=PPGroup(1, 2, QueueTransport(2)),
               model_class=stage_class)
    assert read and all(n.startswith(("model.layers.3.", "model.layers.4.", "model.norm.", "lm_head."))
                        for n in read)


def test_missing_weights_are_checked_per_stage(five_layer, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = five_layer("LlamaForCausalLM", False)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.4.mlp.down_proj.weight"]
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_model(tmp_path, torch.float32, torch.device("cpu"), 64, pp=PPGroup(0, 2, QueueTransport(2)),
               model_class=stage_class)                                 # layer 4 is not stage 0's
    with pytest.raises(ValueError, match=r"lacks weights for \['layers.4.mlp.down_proj.weight'\]"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), 64, pp=PPGroup(1, 2, QueueTransport(2)),
                   model_class=stage_class)
