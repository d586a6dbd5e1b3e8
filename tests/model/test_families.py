"""The model families (model/registry.py) against transformers' own classes, float32:
random tiny checkpoints of Llama, Mistral, Qwen2 and Qwen3, tied and untied, built with
transformers and saved as HF folders (no weights can be downloaded here).

- logits through the real paged path (prefill, then decodes) at block sizes 16, 4, 1;
- the registry: an unknown architecture is named, with the supported ones;
- Mistral's sliding window: kept out of reach (max_model_len capped to it), exact inside;
- sharded safetensors; a checkpoint loaded as the wrong family fails naming the tensor.
Engine-level checks per family are in tests/engine/test_families_engine.py.
"""
import json

import pytest
import torch

from nanopaged import LLM
from nanopaged.exercises.tiny_model import TINY_FAMILIES, make_tiny_model
from nanopaged.model.config import ModelConfig
from nanopaged.model.model_loader import load_model
from nanopaged.model.registry import MODELS, get_model_class

from conftest import paged_logits
from error_bounds import assert_within
from logit_bounds import logits_bound

pytestmark = pytest.mark.exactness

TOKENS = torch.randint(1, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", TINY_FAMILIES)
def test_logits_match_transformers(tiny_family, arch, tie):
    folder, hf = tiny_family(arch, tie)
    ours = load_model(folder, torch.float32, torch.device("cpu"), max_positions=256)
    assert type(ours).__name__ == arch and ModelConfig.from_pretrained(folder).architecture == arch
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    # both fp32, summed in other orders: logit_bounds' 2 (K + 1) u sum |h||W|, K = 128 (the
    # MLP's width); measured at most 0.30 of the element's bound (Llama, 6e-5), Qwen3 0.06
    bound = logits_bound(hf, TOKENS)
    for block_size in (16, 4, 1):
        got = paged_logits(ours, TOKENS, block_size, prefill=21)
        assert_within(got, ref, bound, f"{arch} block_size={block_size}")


def test_registry_names_every_family_and_refuses_others(tmp_path):
    assert sorted(MODELS) == sorted(TINY_FAMILIES)
    assert {get_model_class(a).__name__ for a in MODELS} == set(MODELS)
    make_tiny_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; supported: \['LlamaForCausalLM', "
                                         r"'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM'\]"):
        LLM(str(tmp_path))
    # no `architectures`: the model_type says it
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="qwen2")))
    assert ModelConfig.from_pretrained(tmp_path).architecture == "Qwen2ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
    with pytest.raises(ValueError, match=r"no 'architectures', and model_type='gpt2' is not one of \['llama', "):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("arch, words", [
    ("Qwen2ForCausalLM", r"unexpected tensor 'model.layers.0.self_attn.[qkv]_proj.bias' \(this layer has no bias\)"),
    ("Qwen3ForCausalLM", r"unexpected tensor 'model.layers.0.self_attn.[kq]_norm.weight' for LlamaForCausalLM"),
])
def test_a_checkpoint_read_as_llama_fails_naming_the_tensor(tiny_family, tmp_path, arch, words):
    """The family's extra tensors are really read: dressed up as a Llama, the checkpoint
    is refused by the first tensor Llama has no place for."""
    folder, _ = tiny_family(arch)
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match=words):
        load_model(tmp_path, torch.float32, torch.device("cpu"), 64)


def test_qwen3_head_dim_is_its_own(tiny_family):
    """Qwen3 sets head_dim apart from hidden_size / heads (the tiny one: 32 vs 64 / 4)."""
    folder, _ = tiny_family("Qwen3ForCausalLM")
    config = ModelConfig.from_pretrained(folder)
    assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads


def test_sharded_safetensors_load_like_one_file(tiny_family, tmp_path):
    folder, hf = tiny_family("Qwen2ForCausalLM", False)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    for f in folder.glob("tokenizer*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    a = load_model(folder, torch.float32, torch.device("cpu"), 64)
    b = load_model(tmp_path, torch.float32, torch.device("cpu"), 64)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


# -- Mistral's sliding window ---------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral-window")
    return folder, make_tiny_model(folder, "MistralForCausalLM", sliding_window=40)


def test_sliding_window_caps_max_model_len_and_is_exact_inside(mistral_window, caplog):
    """A window of 40 tokens on a model of 256 positions: max_model_len defaults to 40
    (with a log line), and 40 tokens of prompt + output equal transformers', whose
    window masks nothing there."""
    from nanopaged import SamplingParams
    folder, hf = mistral_window
    with caplog.at_level("INFO", logger="nanopaged"):       # whatever level an earlier test left it at
        llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks=64)
    assert llm.engine.config.max_model_len == 40 and "sliding_window=40" in caplog.text
    prompt = TOKENS[:28]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, 28:].tolist()
    assert out[0].outputs[0].token_ids == ref


def test_sliding_window_refuses_a_longer_max_model_len(mistral_window):
    folder, _ = mistral_window
    with pytest.raises(ValueError, match="max_model_len=64 exceeds the model's sliding_window=40: "
                                         "sliding-window attention is not implemented"):
        LLM(str(folder), max_model_len=64)
    with pytest.raises(ValueError, match="sliding_window=40"):
        load_model(folder, torch.float32, torch.device("cpu"), max_positions=64)


def test_qwen_sliding_window_is_off_unless_used(tmp_path):
    """Qwen2/Qwen3 configs carry sliding_window, used only with use_sliding_window."""
    make_tiny_model(tmp_path, "Qwen2ForCausalLM")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, sliding_window=32, use_sliding_window=False)))
    assert ModelConfig.from_pretrained(tmp_path).sliding_window is None
    # transformers 5's layer_types decide when present (all "full_attention" here)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, sliding_window=32, use_sliding_window=True)))
    assert ModelConfig.from_pretrained(tmp_path).sliding_window is None
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, sliding_window=32, use_sliding_window=True)))
    assert ModelConfig.from_pretrained(tmp_path).sliding_window == 32
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, sliding_window=32, use_sliding_window=True)))
    assert ModelConfig.from_pretrained(tmp_path).sliding_window == 32


def test_an_unsupported_rope_type_names_the_file_and_field(tmp_path):
    make_tiny_model(tmp_path, "Qwen2ForCausalLM")
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: rope_parameters.rope_type='yarn' is not supported"):
        LLM(str(tmp_path))
