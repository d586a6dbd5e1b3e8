"""Our Llama against transformers' LlamaForCausalLM on a tiny random model, fp32.

The model runs through the real paged path (KV written by slot_mapping, read through
block tables), so these tests also pin the attention op for prefill and decode.
"""
import pytest
import torch

from nanopaged.model.config import ModelConfig

from nanopaged.model.llama import rope_inv_freq

from nanopaged.model.model_loader import load_model

from conftest import make_tiny_llama, paged_logits
from error_bounds import assert_within
from logit_bounds import logits_bound

pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers(tmp_path, block_size, tie):
    hf = make_tiny_llama(tmp_path, tie=tie)
    ours = load_model(tmp_path, torch.float32, torch.device("cpu"), max_positions=256)
    tokens = torch.randint(1, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = paged_logits(ours, tokens, block_size, prefill=21)
    # both fp32, summed in other orders: logit_bounds' 2 (K + 1) u sum |h||W| (K = 128,
    # the MLP's width); measured: 6e-5 apart at most, 0.30 of the element's bound
    assert_within(got, ref, logits_bound(hf, tokens))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    hf = make_tiny_llama(tmp_path, rope_parameters={"rope_theta": 10000.0, **scaling})
    ours = load_model(tmp_path, torch.float32, torch.device("cpu"), max_positions=256)
    tokens = list(range(5, 205, 2))                 # long enough to reach the scaled band
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = paged_logits(ours, tokens, 16, prefill=90)
    # logit_bounds' 2 (K + 1) u sum |h||W|, K = 128 (the MLP's width; the 100 keys are
    # fewer); measured: 2.4e-5 apart at most, 0.13 of the element's bound
    assert_within(got, ref, logits_bound(hf, tokens))


def test_unknown_rope_type_is_rejected_by_name(tmp_path):
    make_tiny_llama(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    config.rope_scaling = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(config)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    make_tiny_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), 256)


def test_corrupt_safetensors_names_the_path(tmp_path):
    make_tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), 256)


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_tiny_llama(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = load_model(tmp_path / "one", torch.float32, torch.device("cpu"), 64)
    b = load_model(tmp_path / "sharded", torch.float32, torch.device("cpu"), 64)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
