"""The base engine runs alone (DESIGN.md "The base engine and its features").

In a subprocess whose import system refuses every feature package (every package beside
the base folders, read from the tree), the engine serves greedy and seeded sampling, n > 1, prefix-cache hits,
chunked prefill, and preemption by swap and by recompute; the same script in a plain
subprocess (the full engine) gives the same ids.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pathlib import Path

from nanopaged.model.registry import MODELS

pytestmark = [pytest.mark.timeout(300), pytest.mark.exactness]

PACKAGE = Path(__file__).resolve().parents[2] / "nanopaged"
BASE = {"core", "worker", "engine", "model", "layers", "utils", "entrypoints", "trace", "exercises"}
# every later feature's package, from the tree
FEATURES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name not in BASE)
# Module names (and their submodules) the base engine must never import: every feature
# package, and the grammar library
BLOCKED = [f"nanopaged.{name}" for name in FEATURES] + ["llguidance"]

SCRIPT = r'''
import importlib.abc, json, sys
BLOCKED, model, block = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "block"

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} is a feature: blocked in this test")
        return None

if block:
    sys.meta_path.insert(0, Refuse())
from nanopaged import LLM, SamplingParams
from nanopaged import features

# the feature table names classes in packages that this test blocks
for feature in features.FEATURES:
    for part in feature.parts:
        module = features.qualname(feature, part).partition(":")[0]
        assert any(module == b or module.startswith(b + ".") for b in BLOCKED), module

def run(**kw):
    llm = LLM(model, attention_backend="torch", block_size=4, seed=0, dtype="float32", **kw)
    return llm

result, stats = {}, {}
prompts = [list(range(1, 12)), list(range(20, 27)), list(range(40, 61))]
greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
fork = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)

llm = run(num_gpu_blocks=64, max_num_batched_tokens=8, max_num_seqs=4)   # chunked prefill: 21 tokens in 8s
outs = llm.generate(prompts, [greedy, seeded, fork], use_tqdm=False)
result["plain"] = [[c.token_ids for c in o.outputs] for o in outs]
shared = list(range(100, 125))                                     # 25 tokens: 6 full blocks shared
outs = [llm.generate([shared + [i]], greedy, use_tqdm=False)[0] for i in (1, 2)]
result["prefix"] = [o.outputs[0].token_ids for o in outs]
stats["prefix"] = llm.engine.get_stats()
llm.shutdown()

for mode in ("swap", "recompute"):
    llm = run(num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode=mode)
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True) for i in range(4)]
    outs = llm.generate([list(range(10 * i + 1, 10 * i + 10)) for i in range(4)], params, use_tqdm=False)
    result[mode] = [[c.token_ids for c in o.outputs] for o in outs]
    stats[mode] = llm.engine.get_stats()
    llm.shutdown()

# the default model runs in float32 on the CPU, dtype auto included, whether or not the
# quantization feature imports; with it, from its GGUF file; without it, from its
# converted folder: the same bits (engine/arg_utils.py, default_model_weights)
from nanopaged.config import EngineConfig
from nanopaged.engine.arg_utils import default_model_weights
stats["default_weights"] = [[c.quant_config.quantization, str(c.torch_dtype)] for c in
                            (default_model_weights(EngineConfig(dtype=d, device="cpu")) for d in ("float32", "auto"))]

# AsyncLLM: the core in a process of its own, the same ids
import asyncio
from nanopaged.engine.async_llm import AsyncLLM

async def streamed():
    engine = AsyncLLM(model=model, attention_backend="torch", block_size=4, seed=0, dtype="float32",
                      num_gpu_blocks=64)
    try:
        out = None
        async for out in engine.generate(prompts[0], greedy, request_id="a"):
            pass
        return list(out.outputs[0].token_ids)
    finally:
        engine.shutdown()

result["async"] = asyncio.run(streamed())

loaded = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
base = sorted(m for m in sys.modules if m.split(".")[:2][-1] in ("core", "worker", "engine", "model", "layers")
              and m.startswith("nanopaged."))
print(json.dumps({"result": result, "stats": stats, "loaded": loaded, "base": base}))
'''


def _run(model_dir, block: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(BLOCKED), str(model_dir),
                           "block" if block else "full"],
                          capture_output=True, text=True, timeout=240, env=None)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_base_engine_serves_alone_and_gives_the_full_engines_ids(tiny_model_dir):
    import importlib.util
    assert all(importlib.util.find_spec(m) is not None for m in BLOCKED), "a listed module does not exist"
    base = _run(tiny_model_dir, block=True)
    assert base["loaded"] == []
    stats = base["stats"]
    assert stats["prefix"]["prefix_cache_hits"] > 0
    assert stats["swap"]["num_preemptions_swap"] > 0 and stats["recompute"]["num_preemptions_recompute"] > 0
    full = _run(tiny_model_dir, block=False)
    assert base["result"] == full["result"]
    assert base["result"]["async"] == base["result"]["plain"][0][0]
    # every module of the base folders is part of the base run (the other model families
    # load only for their own checkpoints)
    families = {f"nanopaged.model.{module}" for module, _ in MODELS.values()} - {"nanopaged.model.llama"}
    every = {".".join(("nanopaged",) + p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
             for folder in ("core", "worker", "engine", "model", "layers") for p in (PACKAGE / folder).rglob("*.py")}
    assert sorted(every - families - set(base["base"])) == []
    assert base["stats"]["default_weights"] == [[None, "torch.float32"]] * 2
    assert full["stats"]["default_weights"] == [["gguf", "torch.float32"]] * 2


def test_the_block_can_see_a_feature(tiny_model_dir):
    """The refusal works: blocked, a beam search (a feature) cannot run."""
    script = SCRIPT.split("from nanopaged import features")[0] + (
        "from nanopaged.entrypoints.llm import LLM\n"
        "from nanopaged.sampling_params import BeamSearchParams\n"
        "llm = LLM(model, attention_backend='torch', block_size=4)\n"
        "llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3))\n")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(BLOCKED), str(tiny_model_dir), "block"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "beam" in proc.stderr.lower()


ONE_SCRIPT = r'''
import importlib.abc, json, sys
blocked, model = sys.argv[1], sys.argv[2]

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == blocked or name.startswith(blocked + "."):
            raise ImportError(f"{name} is a feature: blocked in this test")
        return None

sys.meta_path.insert(0, Refuse())
from nanopaged import LLM, SamplingParams
llm = LLM(model, block_size=4, seed=0, dtype="float32", num_gpu_blocks=64)
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outs = llm.generate([list(range(1, 12)), list(range(20, 27))], greedy, use_tqdm=False)
print(json.dumps({"ids": [o.outputs[0].token_ids for o in outs], "features": llm.engine.composition.features}))
'''


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_blocked_in_turn_leaves_an_engine_that_serves(tiny_model_dir, feature):
    """One feature package unimportable at a time (the list is the tree's): the engine
    serves with the default config (the kernels' attention, CPU graphs on), gives the ids
    of the same engine with every package, and its composition names no feature of the
    blocked package."""
    def run(blocked):
        proc = subprocess.run([sys.executable, "-c", ONE_SCRIPT, blocked, str(tiny_model_dir)],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    from nanopaged import features
    alone, full = run(f"nanopaged.{feature}"), _full_run(tiny_model_dir, run)
    assert alone["ids"] == full["ids"]
    assert not {f.name for f in features.FEATURES if f.package == feature} & set(alone["features"])


_FULL: dict = {}


def _full_run(model_dir, run) -> dict:
    if "full" not in _FULL:
        _FULL["full"] = run("nanopaged.no_such_package")
    return _FULL["full"]
