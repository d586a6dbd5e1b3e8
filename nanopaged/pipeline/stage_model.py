"""One pipeline stage of a model: its own layers, and only what the stage needs.

Stage pp_rank of pp_size holds layers [start, end) = get_pp_indices(num_hidden_layers,
pp_rank, pp_size) (layers/groups.py). The other layers are `PPMissingLayer`s, empty
placeholders, so a layer keeps its index and its checkpoint name (`model.layers.7...`
is layers[7] on every stage). The first stage also holds the embedding; the last the
final norm and the LM head. With tied embeddings the head *is* the embedding matrix:
the last stage loads `embed_tokens.weight` as its head, and the first stage, which
holds the embedding, has no head.

forward takes the tokens on the first stage, and the previous stage's
IntermediateTensors on the others; it returns IntermediateTensors to send on, or, on the
last stage, the final hidden states, exactly as the whole model's forward does.

`PipelineStageModel` is a mixin: Composition.build (features.py) puts it in front of the family's
class (Llama, Qwen2, ...; the "model" part, entry "pipeline_parallel"), so a family's
layers and loading stay its own.

vLLM: `vllm/model_executor/models/utils.py` (PPMissingLayer, make_layers) and the
`get_pp_group().is_first_rank / is_last_rank` branches of `models/llama.py`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import AttentionMetadata
from ..layers.groups import PPGroup, get_pp_indices
from ..layers.parallel import VocabParallelEmbedding
from ..model.config import ModelConfig
from ..model.llama import LlamaForCausalLM
from .hop import IntermediateTensors


class PPMissingLayer(nn.Identity):
    """A placeholder for a layer (or the embedding, norm, head) held by another stage:
    no parameters, nothing to load (vLLM's name)."""


class PipelineStageModel(LlamaForCausalLM):
    """A family's model, stage pp.rank of pp.size.

    Args:
        config, tp: as LlamaForCausalLM's.
        pp: this rank's PPGroup (only rank and size are read here; None: one stage).

    Attributes:
        start_layer, end_layer: the layers [start, end) this stage holds.

    forward(input_ids [n] int64 (read on the first stage only), positions [n] int64,
            kv_caches [end - start, 2, num_blocks, block_size, kv_heads, head_size]
            (this stage's layers only), meta,
            intermediate_tensors: the previous stage's (None on the first stage))
        -> IntermediateTensors ([n, hidden_size] each) on a stage before the last;
           hidden states [n, hidden_size] (after the final norm) on the last.

    Raises:
        ValueError: pp.size > num_hidden_layers (get_pp_indices).
    """

    def __init__(self, config: ModelConfig, tp=None, pp: PPGroup | None = None) -> None:
        super().__init__(config, tp, pp)
        self.pp = pp = pp or PPGroup()
        self.start_layer, self.end_layer = get_pp_indices(config.num_hidden_layers, pp.rank, pp.size)
        for i in range(config.num_hidden_layers):
            if not self.start_layer <= i < self.end_layer:
                self.layers[i] = PPMissingLayer()
        if not pp.is_first_rank:
            self.embed_tokens = PPMissingLayer()
        if not pp.is_last_rank:
            self.norm = self.lm_head = PPMissingLayer()
        elif config.tie_word_embeddings and not pp.is_first_rank:
            # the tied head: the embedding matrix, loaded from embed_tokens.weight
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[self.start_layer].self_attn.num_kv_heads

    @property
    def num_kv_cache_layers(self) -> int:
        return self.end_layer - self.start_layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, intermediate_tensors: IntermediateTensors | None = None):
        if self.pp.is_first_rank:
            x, residual = self.embed_tokens(input_ids), None         # [num_tokens, hidden]
        else:
            if intermediate_tensors is None:
                raise ValueError(f"stage {self.pp.rank} of {self.pp.size} needs the previous stage's "
                                 "intermediate_tensors")
            x, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        rope = (self.rope_cos, self.rope_sin)
        for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer], kv_caches):
            x, residual = layer(x, residual, positions, rope, kv_cache, meta)
        if not self.pp.is_last_rank:
            return IntermediateTensors(x, residual)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LlamaForCausalLM.compute_logits, on the last stage only.

        Raises:
            RuntimeError: this stage is not the last (it holds no head)."""
        if not self.pp.is_last_rank:
            raise RuntimeError(f"stage {self.pp.rank} of {self.pp.size} holds no LM head: only the last computes logits")
        return super().compute_logits(hidden)

    def _load_one(self, name: str, src, file) -> str | None:
        """LlamaForCausalLM._load_one for the tensors this stage holds; the others are
        skipped unread (a safetensors slice reads nothing until indexed)."""
        kind, _, rest = name.removeprefix("model.").partition(".")
        pp, tied = self.pp, self.config.tie_word_embeddings
        if kind == "layers":
            if not self.start_layer <= int(rest.partition(".")[0]) < self.end_layer:
                return None
        elif kind == "embed_tokens":
            if tied and pp.is_last_rank and not pp.is_first_rank:
                try:
                    self.lm_head.load(src, name)                     # the tied head
                except ValueError as e:
                    raise ValueError(f"{str(file)!r}: {e}") from None
                return "lm_head.weight"
            if not pp.is_first_rank:
                return None
        elif kind == "norm" and not pp.is_last_rank:
            return None
        elif kind == "lm_head" and (tied or not pp.is_last_rank):
            return None                                              # tied: transformers ignores it too
        return super()._load_one(name, src, file)
