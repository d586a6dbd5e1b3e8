"""A tiny random model (Llama, or another family of TINY_FAMILIES) for the tests, the
chapters' snippets and the exercises: 2 layers, hidden size 64, a byte-level BPE
tokenizer of 320 ids with a chat template, saved the way Hugging Face saves a model.
The engine runs it in milliseconds; its answers are gibberish, which is fine for watching
the machinery.
"""
from __future__ import annotations

import torch

TINY_VOCAB = 320

# The tiny tokenizer's chat template. Like Qwen3's it takes `enable_thinking`: only
# enable_thinking=False changes it (an empty think block after the generation prompt), so
# the server tests can send chat_template_kwargs to the tiny model.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>"
                      "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                      "{% endif %}")

# A short chat template written the way Qwen3's is (ChatML turns; Qwen/Qwen3-*'s
# tokenizer_config.json), for a tiny model that chats like Qwen3:
# make_tiny_model(folder, "Qwen3ForCausalLM", chat_template=QWEN3_CHAT_TEMPLATE). It honours
# `enable_thinking` as Qwen3's does: unset or true, the assistant turn starts empty and the
# model may think; false, the template writes an empty think block after
# "<|im_start|>assistant\n", so the model answers at once. (Qwen3's tools, reasoning_content
# and the stripping of past turns' <think> blocks are left out.)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}")


def make_tiny_tokenizer(folder):
    """A byte-level BPE tokenizer with TINY_VOCAB ids (id 0 = <eos>), saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The capital of France is Paris.", "Hello, my name is nanopaged.",
            "Paged attention splits the KV cache into blocks."] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


# The families the engine runs (model/registry.py), as transformers names their classes
TINY_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def make_tiny_model(folder, architecture="LlamaForCausalLM", *, tie=True, seed=0, chat_template=None,
                    **overrides):
    """Save a random transformers model of `architecture` (one of TINY_FAMILIES) + the
    tiny tokenizer in `folder`; return the transformers model (float32, eval mode).

    2 layers, hidden size 64, 4 query heads over 2 KV heads (GQA), head_dim 16 (Qwen3:
    32, so head_dim != hidden_size / heads as in real Qwen3), TINY_VOCAB ids.
    initializer_range 0.3 (not 0.02) gives peaked logits, so greedy decoding has clear
    winners and token-for-token comparisons are meaningful. Other families than Llama get
    random norm weights and biases too (not transformers' 1 and 0). `overrides` go to the
    transformers config (e.g. sliding_window, rope_parameters); `chat_template`
    replaces the tokenizer's.

    Raises:
        ValueError: an architecture that is not one of TINY_FAMILIES.
    """
    import transformers

    if architecture not in TINY_FAMILIES:
        raise ValueError(f"architecture={architecture!r}; choose one of {list(TINY_FAMILIES)}")
    torch.manual_seed(seed)
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=tie, initializer_range=0.3, eos_token_id=0,
              bos_token_id=None, pad_token_id=None, head_dim=32 if architecture == "Qwen3ForCausalLM" else 16)
    kw.update(overrides)
    family = architecture.removesuffix("ForCausalLM")
    config = getattr(transformers, f"{family}Config")(**kw)
    model = getattr(transformers, architecture)(config).eval()
    if architecture != "LlamaForCausalLM":
        # transformers starts norm weights at 1 and biases at 0, which would hide a
        # norm or bias that is never loaded (Qwen2's q/k/v bias, Qwen3's q_norm/k_norm).
        # The Llama keeps its init: the tests and chapters were written against it.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p), alpha=0.3)
    model.save_pretrained(folder)
    tokenizer = make_tiny_tokenizer(folder)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(folder)
    return model


def make_tiny_llama(folder, *, tie=True, seed=0, **overrides):
    """Save a random transformers LlamaForCausalLM + tokenizer in `folder`; return the
    model (make_tiny_model with the Llama architecture)."""
    return make_tiny_model(folder, "LlamaForCausalLM", tie=tie, seed=seed, **overrides)
