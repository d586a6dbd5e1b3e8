"""The GGUF model families the converter knows: tensor names and Q/K layout per family.

A GGUF says which family it holds in ``general.architecture``; this table says what
llama.cpp's ``convert_hf_to_gguf.py`` did to that family's Hugging Face tensors, so
``gguf_convert.py`` can undo it:

  * every family renames (``model.layers.3.self_attn.q_proj.weight`` ->
    ``blk.3.attn_q.weight``, gguf-py's ``TensorNameMap``);
  * only ``llama`` reorders the rows of Q and K (weights and biases): ``LlamaModel``
    sets ``undo_permute = True`` (``conversion/llama.py``) because llama.cpp runs it
    with ``LLAMA_ROPE_TYPE_NORM``, which rotates adjacent pairs ``(2i, 2i+1)``, while HF
    Llama rotates halves ``(i, i + head_size/2)``;
  * ``Qwen2Model`` and ``Qwen3Model(Qwen2Model)`` (``conversion/qwen.py``) only rename:
    llama.cpp runs them with ``LLAMA_ROPE_TYPE_NEOX``, which rotates halves as HF does,
    so their rows are stored in HF order. transformers agrees: only ``llama`` has a
    ``TENSOR_PROCESSORS`` entry that reverses a permutation
    (``modeling_gguf_pytorch_utils.py``, ``LlamaTensorProcessor``).

Qwen2 adds biases on q/k/v (``attn_q.bias`` ...); Qwen3 adds a per-head RMSNorm on q
and k (``attn_q_norm.weight`` -> ``self_attn.q_norm.weight``).

Reference: https://github.com/ggml-org/llama.cpp/tree/master/conversion (llama.py, qwen.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GGUFFamily", "GGUF_FAMILIES", "gguf_family"]

# llama.cpp tensor part -> HF module path inside ``model.layers.N``; shared by all families.
_COMMON_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


@dataclass(frozen=True)
class GGUFFamily:
    """One model family as llama.cpp writes it and transformers reads it.

    Attributes:
        gguf_arch: ``general.architecture`` in the GGUF (also the metadata key prefix).
        model_type: transformers' ``model_type`` in config.json.
        hf_architecture: config.json's ``architectures[0]``, the class the engine's
            model registry looks up.
        permute_qk: llama.cpp reordered the rows of Q and K (see the module docstring).
        block_names: llama.cpp tensor part -> HF module path inside ``model.layers.N``.
        required_block_tensors: ``part.kind`` entries every layer must have, beyond
            the weights of ``block_names`` (e.g. Qwen2's q/k/v biases).
    """

    gguf_arch: str
    model_type: str
    hf_architecture: str
    permute_qk: bool
    block_names: dict[str, str]
    required_block_tensors: tuple[str, ...] = ()

    def required_tensor_names(self, n_layers: int) -> list[str]:
        """The GGUF tensors a complete file of this family holds (``output.weight``
        is optional: without it the embeddings are tied)."""
        parts = [f"{part}.weight" for part in self.block_names] + list(self.required_block_tensors)
        return ["token_embd.weight", "output_norm.weight"] + [f"blk.{i}.{p}" for i in range(n_layers) for p in parts]


GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", "llama", "LlamaForCausalLM", True, _COMMON_BLOCK_NAMES),
    "qwen2": GGUFFamily("qwen2", "qwen2", "Qwen2ForCausalLM", False, _COMMON_BLOCK_NAMES, _QKV_BIASES),
    "qwen3": GGUFFamily("qwen3", "qwen3", "Qwen3ForCausalLM", False, _COMMON_BLOCK_NAMES | _QK_NORM_NAMES),
}


def gguf_family(arch: object, source: object = "GGUF") -> GGUFFamily:
    """The family of a GGUF's ``general.architecture`` value.

    Raises:
        ValueError: an architecture the converter does not know, naming it and the
            supported ones.
    """
    family = GGUF_FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise ValueError(
            f"{source}: general.architecture is {arch!r}; supported architectures: {sorted(GGUF_FAMILIES)}"
        )
    return family
