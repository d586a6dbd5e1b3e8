"""DraftModelProposer: a small model with the target's tokenizer proposes the drafts.

A model many times cheaper than the target guesses the next k tokens one at a time; the
target checks them in its next forward (Leviathan et al. 2023, §3; Chen et al. 2023).
The draft is any local folder of a supported family with the target's vocabulary
(checked in engine/arg_utils.py); `make_layer_draft` makes one from the target's first
layers (the tests and chapter 19 use it).

The draft's paged KV cache uses the target's block tables: block b of its cache holds
the draft's K/V of the tokens in block b of the target's, so one allocation serves both,
and swaps and copies move both (`move_blocks`). Each step, after the target sampled:

1. the draft runs over the step's input (same tokens, positions, slots), so it has K/V
   wherever the target has;
2. from each sequence's newest token it decodes k tokens greedily, one batched forward a
   token, writing K/V into the lookahead slots past the sequence's tokens
   (SpeculativeConfig.num_lookahead_tokens), scratch that the next step overwrites or
   the scheduler takes back.

Greedy proposals make q one-hot, so the rejection sampler keeps the target's
distribution exactly. vLLM: `vllm/v1/spec_decode/eagle.py`, `draft_model.py`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..layers.attention import AttentionMetadata
from ..layers.backends import TorchOps
from ..messages import SchedulerOutput
from ..worker.input_batch import SeqState
from ..worker.model_input import ModelInput
from ..worker.model_runner import move_blocks
from .proposer import Proposer


class DraftModelProposer(Proposer):
    """Greedy k-token proposals from a draft model with its own KV cache (module doc).

    Args:
        model: the draft, a loaded model of any registered family (this rank's shard under tensor
            parallelism), on the target's device and dtype.
        num_speculative_tokens: k.
        num_gpu_blocks, block_size, num_cpu_blocks: the target's pools' shape: the draft
            has as many blocks, with its own layers and heads.
        max_model_len: no position at or past it is proposed.
    """

    def __init__(self, model, num_speculative_tokens: int, num_gpu_blocks: int, block_size: int,
                 num_cpu_blocks: int, max_model_len: int, max_logits_rows: int | None = None) -> None:
        c = model.config
        self.model = model
        self.max_logits_rows = max_logits_rows      # logits rows at once (logits_chunks.py); None: all
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        # the final norm's weight: in the activations' dtype and on the device whatever
        # format the draft's matrices are kept in (a GGUF embedding holds no fp weight)
        self.device = model.norm.weight.device
        dtype = model.norm.weight.dtype
        shape = (c.num_hidden_layers, 2, num_gpu_blocks, block_size, model.num_local_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.cpu_kv_cache = torch.empty((shape[0], 2, num_cpu_blocks, *shape[3:]), dtype=dtype,
                                        pin_memory=self.device.type == "cuda")

    def move_blocks(self, ops: TorchOps, so: SchedulerOutput) -> None:
        """The draft's K/V move with the target's (its blocks are the target's)."""
        move_blocks(ops, self.kv_cache, self.cpu_kv_cache, so)

    def propose(self, inp: ModelInput, seqs: list[tuple[SeqState, list[int]]]) -> dict[int, list[int]]:
        """Run the draft over `inp` (the step's input, step 1 of the module doc), then
        propose up to k tokens for each (state, new tokens) pair: the runner's record
        of a sequence that sampled this step, and the tokens the step gave it (not yet
        in the record). A sequence gets fewer than k when its table has fewer slots
        past its tokens, or max_model_len is near. Returns seq_id -> proposals."""
        self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata)
        bs = self.block_size
        # per sequence: its newest token, that token's position, its block ids
        live = [(s.seq_id, new[-1], s.num_tokens + len(new) - 1, s.block_ids) for s, new in seqs]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s, _ in seqs}
        for _ in range(self.k):
            live = [x for x in live if x[2] < min(len(x[3]) * bs, self.max_model_len - 1)]
            if not live:
                break
            tokens = self._decode_step(live)
            live = [(seq_id, t, pos + 1, blocks) for (seq_id, _, pos, blocks), t in zip(live, tokens)]
            for (seq_id, *_), t in zip(live, tokens):
                drafts[seq_id].append(t)
        return drafts

    def _decode_step(self, live: list[tuple[int, int, int, list[int]]]) -> list[int]:
        """One batched greedy decode of the draft: each (seq_id, token, position, block
        ids) writes its token's K/V at its slot and gets the draft's argmax next token."""
        bs = self.block_size
        max_blocks = max(len(b) for *_, b in live)

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        positions = [pos for _, _, pos, _ in live]
        seq_lens = [pos + 1 for pos in positions]
        meta = AttentionMetadata(
            slot_mapping=t([b[p // bs] * bs + p % bs for (*_, p, b) in live]),
            block_tables=t([b + [0] * (max_blocks - len(b)) for *_, b in live]),
            seq_lens=t(seq_lens), query_start_loc=t(list(range(len(live) + 1))), num_decodes=len(live),
            seq_lens_list=seq_lens, query_start_loc_list=list(range(len(live) + 1)))
        hidden = self.model(t([tok for _, tok, _, _ in live]), t(positions), self.kv_cache, meta)
        step = self.max_logits_rows or len(live)
        return [token for a in range(0, len(live), step)
                for token in self.model.compute_logits(hidden[a:a + step]).float().argmax(dim=-1).tolist()]


def make_layer_draft(target_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Write a draft model made of a model folder's first `num_layers` decoder layers
    (plus its embedding, final norm and LM head, and its tokenizer files) to out_dir,
    as a Hugging Face folder any loader reads. Self-speculation from a shallow copy of
    the target (as LayerSkip's early exit, Elhoushi et al. 2024) needs no second
    download; its proposals are weaker than a trained draft's.

    Raises:
        ValueError: num_layers not in 1 .. the target's num_hidden_layers - 1, or a
            folder without safetensors weights (naming it).
    """
    from safetensors.torch import load_file, save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if not any(target_dir.glob("*.safetensors")):
        raise ValueError(f"make_layer_draft copies safetensors weights, and {str(target_dir)!r} has none (a "
                         "GGUF run as shipped keeps its weights in the file: pass a folder of safetensors, "
                         "for the default model its converted folder, model_loader.ensure_default_model())")
    config = json.loads((target_dir / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not (isinstance(num_layers, int) and 1 <= num_layers < total):
        raise ValueError(f"num_layers must be an integer in 1..{total - 1} (the target has {total}), "
                         f"got {num_layers!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        for name, w in load_file(f).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            weights[name] = w.contiguous()
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:             # transformers 5 lists one per layer (Qwen2, Qwen3)
        config["layer_types"] = config["layer_types"][:num_layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in target_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out_dir / f.name)
    return out_dir
