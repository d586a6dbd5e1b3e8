"""bench.py's compute roofline (benchmarks/quant.py, `workload_flops`): the FLOPs a
workload needs at the least, which RESULTS.md and chapter 21 divide by this machine's sgemm
rate to bound the throughput any float32-exact engine could reach."""
from types import SimpleNamespace

from benchmarks.common import workload
from benchmarks.quant import workload_flops
from nanopaged.model.config import ModelConfig
from nanopaged.model.llama import LlamaForCausalLM

# SmolLM2-135M-Instruct's config.json (the default model), the figures the docs use
SMOLLM2 = SimpleNamespace(hidden_size=576, head_dim=64, num_attention_heads=9, num_key_value_heads=3,
                          intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)


def test_a_token_costs_two_flops_per_projection_weight_plus_head_and_attention(tiny_model_dir):
    """One request of one prompt token and one output token: each projection weight of
    the model as built (counted from its parameters, not from the formula) and each head
    weight is one multiply-add, and the token attends to one position (q.k and p.v per
    head per layer)."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    model = LlamaForCausalLM(config)
    projections = sum(module.weight.numel() for name, module in model.named_modules()
                      if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    head = config.vocab_size * config.hidden_size
    attention = config.num_hidden_layers * 2 * config.num_attention_heads * config.head_dim
    assert workload_flops(config, [[5]], [1]) == 2 * (projections + head + attention)
    # a second prompt token: the projections again, and attention over 1 + 2 positions
    assert workload_flops(config, [[5, 6]], [1]) == 2 * (2 * projections + head + 3 * attention)


def test_the_docs_throughput_workload_is_1_74_tflop():
    """The 32-request workload of bench.py (4,681 prompt and 2,582 output tokens) on
    SmolLM2's shape: the 1.74 TFLOP benchmarks/RESULTS.md and chapter 21 quote."""
    prompts, out_lens = workload(32, 49152)
    assert (sum(map(len, prompts)), sum(out_lens)) == (4681, 2582)
    assert round(workload_flops(SMOLLM2, prompts, out_lens) / 1e12, 2) == 1.74
