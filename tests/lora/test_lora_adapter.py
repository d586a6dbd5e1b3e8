"""Adapter folders the engine cannot serve are refused at add_request, before the core
sees anything, with a ValueError naming the file and the field or tensor (lora/adapter.py);
the engine then serves the next request. Without enable_lora a request with an adapter
is refused by the base Processor."""
from __future__ import annotations

import math

import pytest
import torch

from nanopaged import LLM, BeamSearchParams, LoRARequest, SamplingParams
from nanopaged.lora.adapter import LoRAAdapterError, load_adapter
from nanopaged.model.config import ModelConfig
from peft_adapters import bad_adapter, lora_adapters  # noqa: F401 (fixtures)

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def setting(field, value):
    return lambda config, tensors: config.__setitem__(field, value)


def tensor(name, value):
    return lambda config, tensors: tensors.__setitem__(name, value)


def poison(value):
    def edit(config, tensors):
        tensors[Q_A][1, 2] = value
    return edit


# case -> (edit(config, tensors), after(folder), words the message must hold besides the file)
CASES = {
    "dora": (setting("use_dora", True), None, ["use_dora"]),
    "modules_to_save": (setting("modules_to_save", ["lm_head"]), None, ["modules_to_save"]),
    "embedding": (setting("target_modules", ["q_proj", "embed_tokens"]), None, ["target_modules", "embed_tokens"]),
    "head": (setting("target_modules", ["lm_head"]), None, ["target_modules", "lm_head"]),
    "unknown_target": (setting("target_modules", ["q_proj", "c_attn"]), None, ["target_modules", "c_attn"]),
    "one_layers_path": (setting("target_modules", ["model.layers.0.self_attn.q_proj"]), None,
                        ["target_modules", "model.layers.0.self_attn.q_proj", "layers_to_transform"]),
    "bias": (setting("bias", "all"), None, ["bias"]),
    "lora_bias": (setting("lora_bias", True), None, ["lora_bias"]),
    "rank_pattern": (setting("rank_pattern", {"q_proj": 2}), None, ["rank_pattern"]),
    "alpha_pattern": (setting("alpha_pattern", {"q_proj": 2}), None, ["alpha_pattern"]),
    "layers_pattern": (setting("layers_pattern", "blocks"), None, ["layers_pattern"]),
    "layers_to_transform": (setting("layers_to_transform", [0, 7]), None, ["layers_to_transform"]),
    "rank_too_big": (setting("r", 32), None, ["r=32", "max_lora_rank=16"]),
    "not_lora": (setting("peft_type", "IA3"), None, ["peft_type"]),
    "fan_in_fan_out": (setting("fan_in_fan_out", True), None, ["fan_in_fan_out"]),
    "missing_tensor": (lambda c, t: t.pop(Q_A), None, [Q_A]),
    "wrong_shape": (tensor(Q_A, torch.zeros(4, 32)), None, [Q_A, "(4, 32)", "(4, 64)"]),
    "nan": (poison(math.nan), None, [Q_A, "NaN"]),
    "inf": (poison(math.inf), None, [Q_A, "infinite"]),
    "unexpected_tensor": (tensor("base_model.model.lm_head.weight", torch.zeros(2, 2)), None,
                          ["unexpected tensor", "lm_head"]),
    "no_config": (None, lambda f: (f / "adapter_config.json").unlink(), ["adapter_config.json"]),
    "bad_json": (None, lambda f: (f / "adapter_config.json").write_text("{\"r\": 4,"), ["not valid JSON"]),
    "pickle_only": (None, lambda f: ((f / "adapter_model.safetensors").rename(f / "adapter_model.bin")),
                    ["adapter_model.safetensors", "pickle", "never loaded"]),
    "bad_safetensors": (None, lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x00" * 16),
                        ["adapter_model.safetensors", "safetensors"]),
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=4, dtype="float32", num_gpu_blocks=64, enable_lora=True)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_adapter_is_refused_at_add_request_by_file_and_field(llm, bad_adapter, lora_adapters, case):
    edit, after, words = CASES[case]
    folder = bad_adapter(case, edit, after)
    with pytest.raises(ValueError) as e:
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False, lora_request=LoRARequest(case, 50, folder))
    assert isinstance(e.value, LoRAAdapterError)
    assert folder in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False, lora_request=lora_adapters["attn"])
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_folder_that_does_not_exist_is_refused(llm, tmp_path):
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        llm.generate([[1, 2]], PARAMS, use_tqdm=False, lora_request=LoRARequest("x", 51, str(tmp_path / "nowhere")))


def test_one_lora_int_id_names_one_adapter(llm, lora_adapters):
    attn, mlp = lora_adapters["attn"], lora_adapters["mlp"]
    llm.generate([[1, 2]], PARAMS, use_tqdm=False, lora_request=attn)
    with pytest.raises(ValueError, match=f"lora_int_id={attn.lora_int_id} already names adapter 'attn'"):
        llm.generate([[1, 2]], PARAMS, use_tqdm=False, lora_request=LoRARequest("other", attn.lora_int_id,
                                                                                 mlp.lora_path))


def test_the_wrong_kind_of_request_is_refused(llm, lora_adapters):
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.generate([[1, 2]], PARAMS, use_tqdm=False, lora_request="attn")
    with pytest.raises(ValueError, match="beam search with a lora_request"):
        llm.engine.add_request("beam", [1, 2], BeamSearchParams(beam_width=2, max_tokens=2),
                               lora_request=lora_adapters["attn"])
    with pytest.raises(ValueError, match="2 lora_request entries for 3 prompts"):
        llm.generate([[1], [2], [3]], PARAMS, use_tqdm=False, lora_request=[None, lora_adapters["attn"]])
    for bad in (dict(lora_int_id=0), dict(lora_name=""), dict(lora_path=None), dict(lora_int_id=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LoRARequest(**(dict(lora_name="a", lora_int_id=1, lora_path="/x") | bad))


def test_without_enable_lora_the_base_processor_refuses_an_adapter(tiny_model_dir, lora_adapters):
    llm = LLM(str(tiny_model_dir), block_size=4, dtype="float32", num_gpu_blocks=16)
    with pytest.raises(ValueError, match="needs an engine built with enable_lora=True"):
        llm.generate([[1, 2]], PARAMS, use_tqdm=False, lora_request=lora_adapters["attn"])
    assert len(llm.generate([[1, 2]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 3
    llm.shutdown()


def test_an_adapter_on_some_layers_and_target_names_with_a_prefix(lora_adapters, bad_adapter, tiny_model_dir):
    """layers_to_transform is honoured (its other layers hold no tensor); a target given
    as a dotted suffix ("self_attn.q_proj") names the projection."""
    def edit(config, tensors):
        config["layers_to_transform"] = [1]
        config["target_modules"] = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "o_proj"]
        for name in [n for n in tensors if ".layers.0." in n]:
            del tensors[name]
    adapter = load_adapter(bad_adapter("layer1", edit), ModelConfig.from_pretrained(tiny_model_dir), 16)
    assert sorted(adapter.weights) == [(1, m) for m in ("k_proj", "o_proj", "q_proj", "v_proj")]
    assert adapter.rank == 4 and adapter.scaling == 2.0
