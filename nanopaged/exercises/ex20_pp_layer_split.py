"""Exercise 20 (chapter 20): the pipeline's layer split, vLLM's get_pp_indices."""
from __future__ import annotations

import atexit
import functools
import queue
import shutil
import tempfile

# imported now, before a check swaps your get_pp_indices in: the stage model imports it
# by name, and the swap (runner.swapped_in) replaces it there too, and puts it back after
from ..pipeline import stage_model as pipeline_stage  # noqa: F401

NUMBER = 20
CHAPTER = "20-pipeline-parallelism.md"
TITLE = "get_pp_indices: which layers each pipeline stage holds"
TARGETS = ["nanopaged.layers.groups:get_pp_indices"]
TASK = """
Write get_pp_indices(num_layers, pp_rank, pp_size) -> (start, end): the layers
[start, end) that stage pp_rank of a pipeline of pp_size stages holds, by vLLM's rule
(vllm/distributed/utils.py). Every stage gets num_layers // pp_size layers; the
remainder is spread one layer each over the second-to-last stage, then the one before
it, and so on, never the last stage (it also runs the final norm, the LM head and the
sampler). The stages are consecutive and cover every layer once. A pipeline with more
stages than layers is a ValueError naming both numbers. The checks compare your split
with vLLM's on a table, then build the tiny Llama's stages with your split
(pipeline/stage_model.py), chain them in this process (each stage's IntermediateTensors
sent to the next by pipeline/hop.py, over a queue standing in for gloo) and ask for the
whole model's logits, to the bit.
"""
HINT = """
Make the list of layer counts first: partitions = [num_layers // pp_size] * pp_size,
then add 1 to partitions[-2], partitions[-3], ... (num_layers % pp_size of them).
Stage pp_rank starts after the layers of the stages before it: start =
sum(partitions[:pp_rank]), end = start + partitions[pp_rank]. For 5 layers over 3
stages that is [1, 1, 1] -> [2, 2, 1]: (0, 2), (2, 4), (4, 5). Check pp_size >
num_layers before anything else, and raise ValueError(f"... pipeline_parallel_size=
{pp_size} ... num_hidden_layers={num_layers} ...").
"""


def _vllm_rule(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """vLLM's split, every stage's (start, end): the checker's own copy of the rule."""
    counts = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        counts[-2 - i] += 1
    starts = [sum(counts[:r]) for r in range(pp_size)]
    return [(s, s + c) for s, c in zip(starts, counts)]


def check_vllm_examples():
    """vLLM's own examples: 22 layers over 4 stages -> 5, 6, 6, 5; 5 over 3 -> 2, 2, 1; 4 over 3 -> 1, 2, 1"""
    from nanopaged.layers.groups import get_pp_indices

    for num_layers, pp_size, counts in [(22, 4, [5, 6, 6, 5]), (5, 3, [2, 2, 1]), (4, 3, [1, 2, 1])]:
        got = [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)]
        want = _vllm_rule(num_layers, pp_size)
        assert [e - s for s, e in want] == counts            # the checker's rule is vLLM's
        assert got == want, (f"{num_layers} layers over {pp_size} stages: your stages hold {got}, vLLM's "
                             f"{want} ({counts} layers)")


def check_every_split_up_to_40_layers():
    """every split of 1 to 40 layers over 1 to 8 stages is vLLM's: consecutive, each layer once, the remainder never on the last stage"""
    from nanopaged.layers.groups import get_pp_indices

    for num_layers in range(1, 41):
        for pp_size in range(1, min(8, num_layers) + 1):
            got = [tuple(get_pp_indices(num_layers, r, pp_size)) for r in range(pp_size)]
            want = _vllm_rule(num_layers, pp_size)
            if got == want:
                continue
            held = [layer for s, e in got for layer in range(s, e)]
            assert held == list(range(num_layers)), (
                f"{num_layers} layers over {pp_size} stages: your stages hold {got}, which is not every layer "
                "once, in order (stage r+1 must start where stage r ends)")
            raise AssertionError(f"{num_layers} layers over {pp_size} stages: your stages hold {got} "
                                 f"({[e - s for s, e in got]} layers), vLLM's {want} "
                                 f"({[e - s for s, e in want]}): the remainder goes to the stages "
                                 "before the last, starting with the second-to-last")


def check_more_stages_than_layers():
    """more stages than layers is a ValueError that names both numbers"""
    from nanopaged.layers.groups import get_pp_indices

    for num_layers, pp_size in [(2, 3), (30, 31)]:
        try:
            got = get_pp_indices(num_layers, 0, pp_size)
        except ValueError as e:
            assert str(num_layers) in str(e) and str(pp_size) in str(e), \
                f"the ValueError for {num_layers} layers over {pp_size} stages does not name both numbers: {e}"
            continue
        raise AssertionError(f"{num_layers} layers over {pp_size} stages gave stage 0 {got}, not a ValueError "
                             "(a stage would hold no layer)")


class _Sent:
    def wait(self) -> None:
        pass


class _QueueGroup:
    """A stand-in for the pipeline's torch.distributed ProcessGroup (what hop.send and
    hop.recv call), for stages run one after the other in this process: a send puts
    the tensor on the queue to its destination stage, a recv takes the next one off
    its own."""

    def __init__(self, inboxes: list[queue.Queue], rank: int) -> None:
        self.inboxes, self.rank = inboxes, rank

    def send(self, tensors, dst: int, tag: int):
        (t,) = tensors
        self.inboxes[dst].put((self.rank, t.clone()))
        return _Sent()

    def recv(self, tensors, src: int, tag: int):
        (t,) = tensors
        sender, sent = self.inboxes[self.rank].get_nowait()
        assert sender == src and sent.shape == t.shape, \
            f"stage {self.rank} expected {list(t.shape)} from stage {src}, got {list(sent.shape)} from {sender}"
        t.copy_(sent)
        return _Sent()


@functools.cache
def _tiny_folder(num_layers: int, tie: bool) -> str:
    """A tiny random Llama of num_layers layers (tiny_model.py), made once per process."""
    from transformers.utils import logging as hf_logging

    from .tiny_model import make_tiny_llama

    hf_logging.disable_progress_bar()
    folder = tempfile.mkdtemp(prefix="nanopaged-exercise-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    make_tiny_llama(folder, tie=tie, num_hidden_layers=num_layers)
    return folder


def _stage_logits(folder: str, pp_size: int):
    """The tiny model's logits for a prefill of 6 tokens, then 3 decodes (paged, block
    size 4), with the model split into pp_size stages chained by hop.send / recv (pp_size
    1: the whole model). Also returns each stage's [start, end)."""
    import torch

    from nanopaged.layers.attention import AttentionMetadata
    from nanopaged.layers.groups import PPGroup
    from nanopaged.model.config import ModelConfig
    from nanopaged.model.llama import LlamaForCausalLM
    from nanopaged.pipeline.hop import recv, send
    from nanopaged.pipeline.stage_model import PipelineStageModel

    config = ModelConfig.from_pretrained(folder)
    inboxes = [queue.Queue() for _ in range(pp_size)]
    stages = []
    for rank in range(pp_size):
        pp = PPGroup(rank, pp_size, _QueueGroup(inboxes, rank)) if pp_size > 1 else None
        with torch.device("meta"):
            model = PipelineStageModel(config, None, pp) if pp else LlamaForCausalLM(config)
        model = model.to_empty(device="cpu").float()
        with torch.no_grad():
            model.load_weights(folder)
        model.init_rope(64)
        stages.append(model)
    block_size, table = 4, [2, 0, 1]                 # the sequence's blocks, scattered
    num_blocks = len(table)
    kv = [torch.zeros(m.num_kv_cache_layers, 2, num_blocks, block_size, m.num_local_kv_heads, config.head_dim)
          for m in stages]
    tokens = [5, 17, 3, 250, 42, 99, 7, 8, 9]
    logits = []
    with torch.inference_mode():
        for start, end in [(0, 6), (6, 7), (7, 8), (8, 9)]:          # the prefill, then decodes
            slots = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots), block_tables=torch.tensor([table]),
                seq_lens=torch.tensor([end]), query_start_loc=torch.tensor([0, end - start]),
                num_decodes=int(end - start == 1), seq_lens_list=[end], query_start_loc_list=[0, end - start])
            ids, positions = torch.tensor(tokens[start:end]), torch.arange(start, end)
            for rank, model in enumerate(stages):
                if pp_size == 1:
                    hidden = model(ids, positions, kv[rank], meta)
                    continue
                previous = None if rank == 0 else recv(model.pp, end - start, config.hidden_size, torch.float32)
                out = model(ids, positions, kv[rank], meta, previous)
                if rank < pp_size - 1:
                    send(model.pp, out)
                else:
                    hidden = out
            logits.append(stages[-1].compute_logits(hidden))
    splits = [(getattr(m, "start_layer", 0), getattr(m, "end_layer", config.num_hidden_layers)) for m in stages]
    return torch.cat(logits), splits


def _check_chained(num_layers: int, pp_size: int, tie: bool = True):
    import torch

    folder = _tiny_folder(num_layers, tie)
    want, _ = _stage_logits(folder, 1)
    got, splits = _stage_logits(folder, pp_size)
    where = f"the tiny Llama ({num_layers} layers{'' if tie else ', untied head'}) over {pp_size} stages {splits}"
    held = [layer for s, e in splits for layer in range(s, e)]
    assert held == list(range(num_layers)), f"{where}: the stages do not hold every layer once, in order"
    if not torch.equal(got, want):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"{where}: the chained stages' logits differ from the whole model's by up to {diff:.3g} "
                             f"(greedy {got.argmax(-1).tolist()} against {want.argmax(-1).tolist()})")


def check_two_stages_give_the_whole_models_logits():
    """the tiny Llama (2 layers) built as 2 stages with your split, chained: the whole model's logits to the bit, prefill and paged decodes"""
    _check_chained(2, 2)


def check_three_stages_of_five_layers():
    """a 5-layer tiny Llama as 3 stages, and as 2 with an untied head: the whole model's logits to the bit"""
    _check_chained(5, 3)
    _check_chained(5, 2, tie=False)


CHECKS = [check_vllm_examples, check_every_split_up_to_40_layers, check_more_stages_than_layers,
          check_two_stages_give_the_whole_models_logits, check_three_stages_of_five_layers]
