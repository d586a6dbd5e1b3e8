"""Adapters on quantized weights (QLoRA serving): a LoRALinear adds to whatever its base
projection is, so the default model's GGUF Q4_1 blocks and int8 weights quantized at
load serve adapters as they are; a batch of rows with and without one equals each row
alone, bit for bit. Tensor parallelism is refused by name."""
from __future__ import annotations

import pytest
import torch

from nanopaged import LLM, EngineConfig, LoRARequest, SamplingParams
from peft_adapters import lora_adapters, make_adapter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.exactness
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batch_equals_rows_alone(llm, prompts, lora) -> list:
    """The completions of `prompts` with and without `lora`, batched; asserted equal to
    each row run alone. Returns [(ids without, ids with)] per prompt."""
    rows = [(p, r) for p in prompts for r in (None, lora)]
    batch = llm.generate([p for p, _ in rows], GREEDY, use_tqdm=False, lora_request=[r for _, r in rows])
    for (prompt, r), out in zip(rows, batch):
        alone = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0]
        assert (alone.token_ids, alone.logprobs) == (out.outputs[0].token_ids, out.outputs[0].logprobs)
    ids = [o.outputs[0].token_ids for o in batch]
    return list(zip(ids[::2], ids[1::2]))


@pytest.mark.slow
def test_the_default_models_q4_1_weights_serve_an_adapter(tmp_path):
    """An adapter made by peft for SmolLM2-135M's shapes (hidden 576, 9 heads over 3 KV
    heads of 64, intermediate 1536, 30 layers) on a same-shape random Llama: the engine
    runs it on the Q4_1 file, and it changes the output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=16)      # the vocabulary is not adapted
    make_adapter(tmp_path, LlamaForCausalLM(config), r=8, lora_alpha=16, target_modules=EVERY)
    llm = LLM(enable_lora=True, num_gpu_blocks=64, dtype="float32")
    assert llm.engine.config.quant_config.quantization == "gguf"
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer("Hello, my name is").input_ids, tokenizer("The capital of France is").input_ids]
    pairs = batch_equals_rows_alone(llm, prompts, LoRARequest("smol", 1, str(tmp_path)))
    assert all(base != adapted for base, adapted in pairs)
    llm.shutdown()


def test_int8_weights_serve_an_adapter(tiny_model_dir, lora_adapters):
    llm = LLM(str(tiny_model_dir), quantization="int8", enable_lora=True, block_size=4, num_gpu_blocks=64)
    assert llm.engine.config.torch_dtype == torch.float32
    pairs = batch_equals_rows_alone(llm, [list(range(3, 20)), list(range(50, 57))], lora_adapters["all"])
    assert all(base != adapted for base, adapted in pairs)
    llm.shutdown()


def test_tensor_parallelism_is_refused_by_name():
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor_parallel_size=2"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
