"""Exercise 22 (chapter 22): Punica's BGMV, the batched LoRA matmul, graded against peft."""
from __future__ import annotations

import functools

NUMBER = 22
CHAPTER = "22-lora.md"
TITLE = "bgmv_shrink and bgmv_expand: each row of a batch with its own LoRA adapter"
TARGETS = ["nanopaged.lora.punica:bgmv_shrink", "nanopaged.lora.punica:bgmv_expand"]
TASK = """
Write the two halves of the batched LoRA matmul that lets one step serve rows of
different adapters. The adapters sit stacked in slots: a [num_slots, r, in] holds each
slot's A, b [num_slots, out, r] its B, scales [num_slots] float32 its lora_alpha / r.
Row i uses slot s = slots[i], or none when s is -1.

  bgmv_shrink(out, x, a, slots): out[i] = x[i] @ a[s]^T, a [r] row of float32 (widen x and
      a to float32 first); zeros where s is -1. out [n, r] float32 is written in place.
  bgmv_expand(y, t, b, slots, scales): y[i] = (y[i] + (t[i] @ b[s]^T) * scales[s]), summed
      in float32 and rounded once to y's dtype, in place; a row whose s is -1 keeps its
      bits. y [n, out] may be a column slice of a wider output (the q part of qkv).

Read slots as a tensor, never with .item() or .tolist(): the engine replays decode steps
as a recorded graph that cannot read a tensor into Python. The checks compare each row's
delta with peft's LoRA layer for that row's adapter, then run the tiny model with three
adapters through the PyTorch reference backend (which calls your functions for every
projection) and compare its greedy tokens with the engine's own.
"""
HINT = """
Loop over the slots, not the rows: for s in range(a.shape[0]), compute x.float() @
a[s].float().T for every row (a [n, r] matrix) and keep it where slots == s, with
torch.where((slots == s).unsqueeze(1), that, result), starting from zeros. The expand is
the same over b, times scales[s]; then y.copy_(torch.where((slots >= 0).unsqueeze(1),
(y.float() + delta).to(y.dtype), y)) leaves the -1 rows as they were. Writing into y
with copy_ keeps a column slice's columns where they are.
"""

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _delta_bound(x, a, b, scale, y):
    """A bound on |ours - peft's| per output element, float32: both sides sum the same
    products in different orders, so each is within (len + 1) * eps of the exact value
    times the sum of the magnitudes (Higham's gamma_n); shrink sums `in` products, expand
    `r`, and the add one more rounding. Twice that bounds their difference."""
    eps = 2.0 ** -24
    k, r = x.shape[1], a.shape[0]
    magnitude = (x.abs() @ a.abs().T) @ b.abs().T * abs(scale)
    return 2 * eps * ((k + r + 2) * magnitude + y.abs()) + 1e-30


def _peft_layers(in_features: int, out_features: int, ranks: list[int], seed: int):
    """A base nn.Linear and, per rank, a peft LoRA layer around a copy of it with random A
    and B (init_lora_weights=False: peft's default B is zero, which would hide any slip)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(in_features, out_features, bias=False))
    layers = []
    for i, r in enumerate(ranks):
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r + i, target_modules=["proj"],
                                                               init_lora_weights=False))
        layers.append(model.base_model.model.proj)
    return base.proj, layers


def check_a_hand_made_batch():
    """slots [1, -1, 0]: row 0 gets slot 1's delta, row 1 is left alone, row 2 slot 0's"""
    import torch

    from nanopaged.lora.punica import bgmv_expand, bgmv_shrink

    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    a = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])              # slot 0 reads x[:, 0], slot 1 x[:, 1]
    b = torch.tensor([[[1.0], [10.0]], [[2.0], [20.0]]])        # [2 slots, out 2, r 1]
    scales = torch.tensor([0.5, 1.0])
    slots = torch.tensor([1, -1, 0])
    t = torch.full((3, 1), float("nan"))
    bgmv_shrink(t, x, a, slots)
    assert torch.equal(t, torch.tensor([[2.0], [0.0], [5.0]])), (
        f"shrink of rows [1, 2], [3, 4], [5, 6] with slots [1, -1, 0] should be [[2], [0], [5]] "
        f"(row 0: x[0] @ a[1]^T = 2; row 1: no adapter, 0; row 2: x[2] @ a[0]^T = 5), got {t.tolist()}")
    y = torch.zeros(3, 2)
    bgmv_expand(y, t, b, slots, scales)
    want = torch.tensor([[4.0, 40.0], [0.0, 0.0], [2.5, 25.0]])
    assert torch.equal(y, want), (f"expand should give {want.tolist()} (row 0: 2 * [2, 20] * 1.0; row 2: "
                                  f"5 * [1, 10] * 0.5), got {y.tolist()}")


def check_rows_match_peft():
    """48 rows over 3 adapters of ranks 4, 8, 16 and none: each row's delta is peft's for its adapter, within float32's bound"""
    import torch

    from nanopaged.lora.punica import bgmv_expand, bgmv_shrink

    in_f, out_f, ranks = 96, 80, [4, 8, 16]
    base, layers = _peft_layers(in_f, out_f, ranks, seed=22)
    max_r = max(ranks)
    a = torch.zeros(len(ranks), max_r, in_f)                  # ranks padded with zeros, as the engine's slots
    b = torch.zeros(len(ranks), out_f, max_r)
    scales = torch.zeros(len(ranks))
    for s, (layer, r) in enumerate(zip(layers, ranks)):
        a[s, :r] = layer.lora_A["default"].weight.detach()
        b[s, :, :r] = layer.lora_B["default"].weight.detach()
        scales[s] = layer.scaling["default"]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, in_f, generator=g)
    slots = torch.tensor([(i % 4) - 1 for i in range(48)])    # -1, 0, 1, 2, -1, ...
    with torch.no_grad():
        y0 = base(x)
        t = torch.empty(48, max_r)
        y = y0.clone()
        bgmv_shrink(t, x, a, slots)
        bgmv_expand(y, t, b, slots, scales)
        for i in range(48):
            s = int(slots[i])
            if s < 0:
                assert torch.equal(y[i], y0[i]), f"row {i} has no adapter (slot -1), but its values changed"
                continue
            want = layers[s](x[i:i + 1])[0]
            bound = _delta_bound(x[i:i + 1], a[s], b[s], float(scales[s]), y0[i:i + 1])[0]
            err = (y[i] - want).abs()
            assert bool((err <= bound).all()), (
                f"row {i} (slot {s}, rank {ranks[s]}): your output differs from peft's by up to {err.max().item():.3g}, "
                f"more than float32 rounding allows ({bound[err.argmax()].item():.3g} there). Is scales[s] applied, "
                f"and is each row using its own slot's A and B?")


def check_slot_minus_one_keeps_bits():
    """a row with slot -1 keeps its exact bits (NaN and -0.0 included), in a column slice of a wider output"""
    import torch

    from nanopaged.lora.punica import bgmv_expand, bgmv_shrink

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 12, generator=g)
    wide[1, 5] = float("nan")
    wide[1, 6] = -0.0
    before = wide.clone()
    x, a, b = torch.randn(4, 8, generator=g), torch.randn(2, 3, 8, generator=g), torch.randn(2, 6, 3, generator=g)
    slots, t = torch.tensor([0, -1, 1, -1]), torch.empty(4, 3)
    bgmv_shrink(t, x, a, slots)
    bgmv_expand(wide[:, 4:10], t, b, slots, torch.tensor([1.0, 2.0]))
    for i in (1, 3):
        assert torch.equal(wide[i].view(torch.int32), before[i].view(torch.int32)), (
            f"row {i} has slot -1 but its bits changed: {before[i].tolist()} -> {wide[i].tolist()}")
    outside = torch.cat((wide[:, :4], wide[:, 10:]), dim=1)
    assert torch.equal(outside, torch.cat((before[:, :4], before[:, 10:]), dim=1)), (
        "columns outside the slice y[:, 4:10] changed: write into y in place (y.copy_), not into a new tensor")


@functools.cache
def _tiny_adapters() -> tuple[str, ...]:
    """Three peft adapters for the tiny model (ranks 2, 4, 8; random A and B), saved once."""
    import atexit
    import shutil
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from . import tiny_model_folder

    root = tempfile.mkdtemp(prefix="nanopaged-exercise-lora-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    folders = []
    for i, r in enumerate((2, 4, 8)):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_folder())
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=4 * r, target_modules=TARGET_MODULES,
                                                 init_lora_weights=False))
        folders.append(f"{root}/adapter{i}")
        model.save_pretrained(folders[-1])
    return tuple(folders)


def check_engine_runs_on_it():
    """the tiny model with three adapters and none in one batch (the PyTorch reference backend, your functions in every projection): the engine's own greedy tokens"""
    from nanopaged import LLM, LoRARequest, SamplingParams

    from . import engines_own, tiny_model_folder

    folders = _tiny_adapters()
    prompts = [[1, 2, 3, 4, 5], [40, 41, 42], [7, 8, 9, 10], [100, 101, 102]]
    loras = [LoRARequest(f"a{i}", i + 1, folders[i]) for i in range(3)] + [None]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run():
        llm = LLM(tiny_model_folder(), block_size=4, num_gpu_blocks=64, attention_backend="torch",
                  dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return [list(o.outputs[0].token_ids) for o in outs]

    got = run()
    with engines_own():
        want = run()
    for i, (g, w) in enumerate(zip(got, want)):
        which = f"request {i} ({'no adapter' if loras[i] is None else loras[i].lora_name})"
        assert g == w, f"{which}: with your code the engine produced {g}, with its own {w}"


CHECKS = [check_a_hand_made_batch, check_rows_match_peft, check_slot_minus_one_keeps_bits, check_engine_runs_on_it]
