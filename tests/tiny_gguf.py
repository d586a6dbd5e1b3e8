"""Tiny GGUF files, written the way llama.cpp's converter writes them.

``write_tiny_gguf``: a synthetic Llama GGUF, shared by test_gguf_convert.py (conversion
must give back the original tensors bit for bit) and test_model_loader.py (rebuilding
a stale default-model folder). ``write_gguf_from_hf``: the GGUF of a tiny HF checkpoint
of the llama, qwen2 or qwen3 family, for test_gguf_families.py.
"""
from __future__ import annotations

import string
from pathlib import Path

import numpy as np

# Tiny model geometry: 2 layers, 4 query heads sharing 2 KV heads.
HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN, VOCAB, LAYERS = 32, 4, 2, 8, 48, 64, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``, written out independently of the code under test."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    *,
    tied: bool = True,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny Llama GGUF (F32 tensors, tiny byte-level BPE tokenizer).

    Returns the *HF-layout* tensors (before llama.cpp's Q/K permutation) keyed by
    HF name, i.e. what a correct converter must reproduce.
    """
    import gguf

    rng = np.random.default_rng(seed)
    hf: dict[str, np.ndarray] = {}
    gg: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int | None = None) -> None:
        a = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = a
        gg[gguf_name] = llama_cpp_permute(a, permute_heads) if permute_heads else a

    add("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        p, b = f"model.layers.{i}", f"blk.{i}"
        add(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight", (HIDDEN,))
        add(f"{b}.attn_q.weight", f"{p}.self_attn.q_proj.weight", (N_HEAD * HEAD_DIM, HIDDEN), N_HEAD)
        add(f"{b}.attn_k.weight", f"{p}.self_attn.k_proj.weight", (N_KV * HEAD_DIM, HIDDEN), N_KV)
        add(f"{b}.attn_v.weight", f"{p}.self_attn.v_proj.weight", (N_KV * HEAD_DIM, HIDDEN))
        add(f"{b}.attn_output.weight", f"{p}.self_attn.o_proj.weight", (HIDDEN, N_HEAD * HEAD_DIM))
        add(f"{b}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", (HIDDEN,))
        add(f"{b}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", (FFN, HIDDEN))
        add(f"{b}.ffn_up.weight", f"{p}.mlp.up_proj.weight", (FFN, HIDDEN))
        add(f"{b}.ffn_down.weight", f"{p}.mlp.down_proj.weight", (HIDDEN, FFN))
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    if not tied:
        add("output.weight", "lm_head.weight", (VOCAB, HIDDEN))
    gg.update(extra_tensors or {})

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(HEAD_DIM)
    # Byte-level BPE vocab: 3 specials, single characters, then 4 merged tokens.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + ["Ġ", "Ċ"] + list(string.ascii_lowercase) + list(string.ascii_uppercase) + list(".,?")
    pairs = [("h", "i"), ("Ġ", "t"), ("t", "h"), ("Ġ", "a")]
    tokens += [a + b for a, b in pairs]
    assert len(tokens) == VOCAB  # test fixture invariant
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (VOCAB - len(specials)))
    w.add_token_merges([f"{a} {b}" for a, b in pairs])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, arr in gg.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


# --------------------------------------------------------------------------- HF folder -> GGUF

# What llama.cpp's converter calls each HF tensor (gguf-py's TensorNameMap for these families).
_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def hf_to_gguf_tensor_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.bias`` -> ``blk.3.attn_q.bias`` (llama.cpp's names)."""
    stem, kind = name.rsplit(".", 1)
    if stem in _HF_TO_GGUF_GLOBAL:
        return f"{_HF_TO_GGUF_GLOBAL[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[part]}.{kind}"


def write_gguf_from_hf(hf_folder: Path, path: Path, arch: str, *, drop: tuple[str, ...] = (),
                       quant: dict | None = None) -> None:
    """Write the GGUF llama.cpp's ``convert_hf_to_gguf.py`` would make of a float32 HF folder.

    ``arch`` is the GGUF ``general.architecture`` (``llama``, ``qwen2``, ``qwen3``). As in
    llama.cpp, only ``llama`` has its Q/K rows (weights and biases) permuted
    (``LlamaModel.undo_permute = True`` in ``conversion/llama.py``); ``Qwen2Model`` and
    ``Qwen3Model`` (``conversion/qwen.py``) only rename. F32 tensors; the tokenizer is
    the folder's byte-level BPE written as a ``gpt2`` vocabulary with its merges; no
    ``output.weight`` when the checkpoint ties its embeddings. ``drop`` leaves out the
    named GGUF tensors (to make a broken file). ``quant`` maps a tensor's part (``attn_q``,
    ``ffn_down``, ``token_embd``, ``output`` ...) to a ``GGMLQuantizationType``: those weights are written
    quantized in llama.cpp's layout, by ``gguf.quants.quantize`` or, for the K-quants (rows
    of whole 256-weight super-blocks), by tests/gguf_blocks.py.
    """
    import json

    import gguf
    from gguf_blocks import quantize
    from safetensors.numpy import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_key_length(head_dim)  # TextModel.set_gguf_parameters: written when config.json has head_dim
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(config["vocab_size"])

    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))  # test fixture invariant
    specials = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(False)

    for name, arr in sorted(load_file(str(hf_folder / "model.safetensors")).items()):
        if arch == "llama" and ".q_proj." in name:
            arr = llama_cpp_permute(arr, n_head)
        elif arch == "llama" and ".k_proj." in name:
            arr = llama_cpp_permute(arr, n_kv)
        gguf_name = hf_to_gguf_tensor_name(name)
        part = gguf_name.split(".")[2 if gguf_name.startswith("blk.") else 0]
        qtype = (quant or {}).get(part)
        if gguf_name in drop:
            continue
        if qtype is not None and gguf_name.endswith(".weight"):
            q = quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
            w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
