"""Exercise 17 (chapter 17): the tensor-parallel layers whose ranks exchange results."""
from __future__ import annotations

import threading

NUMBER = 17
CHAPTER = "17-tensor-parallelism.md"
TITLE = "RowParallelLinear and the LM head: the all-reduce and the all-gather"
TARGETS = ["nanopaged.layers.parallel:RowParallelLinear.load",
           "nanopaged.layers.parallel:RowParallelLinear.forward",
           "nanopaged.layers.parallel:VocabParallelEmbedding.logits"]
TASK = """
Write the tensor-parallel pieces where ranks exchange results (Megatron-LM §3).
RowParallelLinear: `load` keeps this rank's slice of the checkpoint matrix's input
columns, and `forward` multiplies this rank's slice of x by it and sums the partial
products over the ranks (self.tp.all_reduce). VocabParallelEmbedding.logits, the LM
head: each rank holds a range of the vocabulary's rows and computes the logits of its
range; an all-gather (self.tp.all_gather) puts the full rows together on every rank,
and the last range's padding (columns past vocab_size) is cut off. The checks run 1 to 4 ranks as
threads in this process (TPGroup over a stand-in for the gloo group), compare every
rank's result with the unsharded layer, then run the whole tiny Llama at tp=2 that way,
and the engine at tp=1.
"""
HINT = """
load: n = self.weight.shape[1] columns per rank; rank r holds columns
[r * n, (r + 1) * n) of src (src[:, a:b] reads only those from a safetensors slice).
Check the shape first: _check_shape(name, src, (self.output_size, self.input_size)).
forward: _linear(self, x) (the module's helper: self.ops.linear with the weight in the
layout the backend wants) is the rank's partial [num_tokens, output_size]; return
self.tp.all_reduce(...) of it.
logits: _linear(self, hidden, out_dtype=torch.float32) gives this rank's
[num_tokens, per_rank] columns, summed and returned in float32 whatever the weights'
dtype; self.tp.all_gather joins them in rank order into [num_tokens, tp * per_rank];
keep the first self.vocab_size columns.
"""


class _Collectives:
    """What the ranks of one simulated group share: a barrier and a slot per rank."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: list = [None] * size


class _Done:
    def wait(self) -> None:
        pass


class _ThreadGroup:
    """A stand-in for a torch.distributed ProcessGroup (what TPGroup calls) over ranks
    that are threads of this process: allreduce sums in place, allgather collects."""

    def __init__(self, shared: _Collectives, rank: int) -> None:
        self.shared, self.rank = shared, rank

    def _exchange(self, x):
        s = self.shared
        s.slots[self.rank] = x.clone()
        s.barrier.wait()
        parts = list(s.slots)
        s.barrier.wait()                 # everyone has read before anyone writes again
        return parts

    def allreduce(self, tensors):
        (x,) = tensors
        parts = self._exchange(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        x.copy_(total)
        return _Done()

    def allgather(self, outputs, inputs):
        (parts,), (x,) = outputs, inputs
        for dst, src in zip(parts, self._exchange(x)):
            dst.copy_(src)
        return _Done()


def _on_ranks(size: int, work) -> list:
    """Run work(TPGroup of rank r) for r in 0..size-1, each rank a thread; return the
    results in rank order. A rank's exception is raised here (the others then fail at
    their next collective rather than wait for it)."""
    from nanopaged.layers.parallel import TPGroup

    shared, results, errors = _Collectives(size), [None] * size, [None] * size

    def run(rank):
        try:
            results[rank] = work(TPGroup(rank, size, _ThreadGroup(shared, rank)) if size > 1 else TPGroup())
        except BaseException as e:
            errors[rank] = e
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if isinstance(first, threading.BrokenBarrierError):
        raise AssertionError("the ranks did not all call the same collectives: one waited in an all_reduce "
                             "the others never made")
    if first is not None:
        raise first
    return results


def check_row_parallel_linear():
    """RowParallelLinear over 1, 2 and 4 ranks: each loads its columns of W, and every rank's forward gives the whole x @ W^T"""
    import torch

    from nanopaged.layers.parallel import RowParallelLinear

    torch.manual_seed(0)
    weight, x = torch.randn(6, 8), torch.randn(3, 8)               # W: [out 6, in 8], x: [3 tokens, 8]
    want = x @ weight.T
    for size in (1, 2, 4):
        def rank_work(tp):
            layer = RowParallelLinear(8, 6, tp)
            layer.load(weight, "o_proj.weight")
            n = 8 // size                                          # columns per rank
            held = layer.weight.detach().clone()
            return held, layer(x[:, tp.rank * n:(tp.rank + 1) * n].clone())
        results, n = _on_ranks(size, rank_work), 8 // size
        for rank, (held, _) in enumerate(results):
            assert torch.equal(held, weight[:, rank * n:(rank + 1) * n]), (
                f"tp={size}, rank {rank}: load kept a weight (shape {list(held.shape)}) that is not "
                f"columns {rank * n}..{(rank + 1) * n - 1} of the checkpoint's [6, 8] matrix")
        for rank, (_, y) in enumerate(results):
            assert y.shape == want.shape, \
                f"tp={size}, rank {rank}: forward gave a result of shape {list(y.shape)}, not {list(want.shape)}"
            assert torch.allclose(y, want, atol=1e-5), (
                f"tp={size}, rank {rank}: forward gave {[round(v, 4) for v in y[0, :3].tolist()]}... for "
                f"token 0, the whole layer gives {[round(v, 4) for v in want[0, :3].tolist()]}... "
                "(is each rank's partial product summed over the ranks?)")


def check_row_parallel_load_refuses_bad_shape():
    """RowParallelLinear.load refuses a checkpoint matrix of the wrong shape, naming the tensor"""
    import torch

    from nanopaged.layers.parallel import RowParallelLinear, TPGroup

    layer = RowParallelLinear(8, 6, TPGroup())
    try:
        layer.load(torch.zeros(6, 7), "model.layers.0.mlp.down_proj.weight")
    except ValueError as e:
        assert "down_proj" in str(e), f"the ValueError does not name the tensor: {e}"
        return
    raise AssertionError("load took a [6, 7] matrix for a layer of 8 inputs and 6 outputs without a ValueError")


def check_lm_head_logits():
    """VocabParallelEmbedding.logits over 1, 2 and 3 ranks (10 rows: the last range is padded): every rank gets all 10 logits, in float32"""
    import torch

    from nanopaged.layers.parallel import VocabParallelEmbedding
    from nanopaged.utils.math_utils import cdiv

    torch.manual_seed(0)
    table, hidden = torch.randn(10, 4), torch.randn(3, 4)
    for size in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            want = hidden.to(dtype).float() @ table.to(dtype).float().T          # [3, 10]

            def rank_work(tp):
                head = VocabParallelEmbedding(10, 4, tp).to(dtype)
                head.load(table.to(dtype), "lm_head.weight")               # the engine's own load
                return head.logits(hidden.to(dtype))
            for rank, got in enumerate(_on_ranks(size, rank_work)):
                where = f"tp={size}, rank {rank}, a {str(dtype).removeprefix('torch.')} head"
                assert got.shape == want.shape, (f"{where}: logits of shape {list(got.shape)}, expected "
                                                 f"{list(want.shape)} (every rank, padding cut off)")
                assert got.dtype == torch.float32, f"{where}: logits in {got.dtype}, not float32"
                bad = [j for j in range(10) if not torch.allclose(got[:, j], want[:, j], atol=1e-4)]
                assert not bad, (f"{where}: the logits of tokens {bad} are wrong (this rank holds "
                                 f"rows {rank * cdiv(10, size)} to {min(10, (rank + 1) * cdiv(10, size)) - 1})")


def check_tiny_llama_at_tp2():
    """the tiny Llama split over 2 ranks (loaded from its files with your load): both ranks compute tp=1's logits"""
    import torch

    from nanopaged.model.config import ModelConfig

    from nanopaged.model.llama import LlamaForCausalLM
    from nanopaged.layers.attention import AttentionMetadata
    from nanopaged.utils.math_utils import cdiv

    from . import tiny_model_folder

    folder = tiny_model_folder()
    config = ModelConfig.from_pretrained(folder)
    tokens = torch.tensor([5, 17, 3, 250, 42, 99, 7])
    n, block_size = len(tokens), 4
    num_blocks = cdiv(n, block_size)
    positions = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=positions, block_tables=torch.arange(num_blocks)[None],
                             seq_lens=torch.tensor([n]), query_start_loc=torch.tensor([0, n]), num_decodes=0,
                             seq_lens_list=[n], query_start_loc_list=[0, n])

    def logits(tp):
        with torch.device("meta"):
            model = LlamaForCausalLM(config, tp)
        model = model.to_empty(device="cpu").float()
        with torch.no_grad():
            model.load_weights(folder)
        model.init_rope(64)
        kv = torch.zeros(config.num_hidden_layers, 2, num_blocks, block_size, model.num_local_kv_heads,
                         config.head_dim)
        with torch.inference_mode():
            return model.compute_logits(model(tokens, positions, kv, meta))

    (want,) = _on_ranks(1, logits)
    for rank, got in enumerate(_on_ranks(2, logits)):
        assert got.shape == want.shape, f"rank {rank}: logits of shape {list(got.shape)}, tp=1 gives {list(want.shape)}"
        diff = (got - want).abs().max().item()
        assert diff < 1e-3, (f"rank {rank} of 2: its logits differ from tp=1's by up to {diff:.3g} "
                             f"(greedy tokens {got.argmax(-1).tolist()} against {want.argmax(-1).tolist()})")


def check_engine_runs_on_it():
    """the engine at tp=1 on your layers: the same tokens as its own"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    same_as_engines_own([[1, 2, 3, 4, 5], list(range(20, 33))], params, preemption_mode="recompute",
                        num_cpu_blocks=0)


CHECKS = [check_row_parallel_linear, check_row_parallel_load_refuses_bad_shape, check_lm_head_logits,
          check_tiny_llama_at_tp2, check_engine_runs_on_it]
