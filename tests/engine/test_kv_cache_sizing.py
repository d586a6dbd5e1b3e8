"""The KV pool is sized by the workers after their weights are on the device (vLLM v1's
EngineCore._initialize_kv_caches): each worker loads its shard, then reports the memory
left (Worker.determine_available_memory); the core takes the smallest number of blocks
over the ranks, tells every worker (initialize_kv_cache) and builds the block manager
with that count. An explicit num_gpu_blocks skips the measurement."""
from types import SimpleNamespace

import pytest
import torch

from nanopaged import EngineConfig, LLMEngine
from nanopaged.engine.engine_core import EngineCore
from nanopaged.model.config import ModelConfig
from nanopaged.worker import worker as worker_module
from nanopaged.worker.model_runner import ModelRunner

MiB = 1 << 20


def engine(tiny_model_dir, **kw) -> LLMEngine:
    kw = {"block_size": 4, "num_cpu_blocks": 0, "device": "cpu", "preemption_mode": "recompute", **kw}
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **kw))


def bytes_per_block(tiny_model_dir, block_size=4) -> int:
    return ModelRunner.kv_cache_bytes_per_block(ModelConfig.from_pretrained(tiny_model_dir), block_size,
                                                torch.float32)


def test_pool_is_sized_from_the_memory_left_after_the_weights_load(tiny_model_dir, monkeypatch):
    """A fake host with 40 MiB available, of which loading the weights takes 20 MiB: the
    pool is 25% of the 20 MiB left, not of the 40 MiB there were before."""
    host, events, load_model = {"free": 40 * MiB}, [], worker_module.load_model

    def loading(*args, **kwargs):
        model = load_model(*args, **kwargs)
        host["free"] -= 20 * MiB
        events.append("load weights")
        return model

    def measuring():
        events.append("measure memory")
        return host["free"]

    monkeypatch.setattr(worker_module, "load_model", loading)
    monkeypatch.setattr(worker_module, "_free_host_memory", measuring)
    eng = engine(tiny_model_dir, dtype="float32")
    expected = (20 * MiB // 4) // bytes_per_block(tiny_model_dir)
    assert events == ["load weights", "measure memory"]
    assert eng.block_manager.num_gpu_blocks == expected
    assert eng.model_runner.kv_cache.shape[2] == expected
    assert eng.config.cache_config.num_gpu_blocks is None              # the config is not written to


def test_kv_cache_memory_bytes_is_the_budget(tiny_model_dir):
    per_block = bytes_per_block(tiny_model_dir)
    eng = engine(tiny_model_dir, dtype="float32", kv_cache_memory_bytes=10 * per_block + per_block // 2)
    assert eng.block_manager.num_gpu_blocks == 10 == eng.model_runner.kv_cache.shape[2]
    with pytest.raises(ValueError, match="smaller than one KV block"):
        engine(tiny_model_dir, dtype="float32", kv_cache_memory_bytes=per_block - 1)


def test_explicit_num_gpu_blocks_skips_the_measurement(tiny_model_dir, monkeypatch):
    def fail(self):
        raise AssertionError("measured the memory although num_gpu_blocks was given")

    monkeypatch.setattr(worker_module.Worker, "determine_available_memory", fail)
    eng = engine(tiny_model_dir, num_gpu_blocks=12)
    assert eng.block_manager.num_gpu_blocks == 12 == eng.model_runner.kv_cache.shape[2]


class FakeExecutor:
    """Two ranks whose memory differs; records what initialize_kv_cache was told."""

    def __init__(self, available, per_block):
        self.available, self.per_block, self.initialized = available, per_block, None

    def collective_rpc(self, method, args=()):
        assert method == "kv_cache_bytes_per_block"
        return self.per_block

    def determine_available_memory(self):
        return self.available

    def initialize_kv_cache(self, num_gpu_blocks, num_cpu_blocks):
        self.initialized = (num_gpu_blocks, num_cpu_blocks)


TORCH = SimpleNamespace(name="torch")          # the attention backend, for the log line


def test_the_core_takes_the_smallest_pool_over_the_ranks():
    executor = FakeExecutor(available=[1000, 700], per_block=[100, 100])
    core = SimpleNamespace(config=EngineConfig(num_cpu_blocks=3), executor=executor, attn_backend=TORCH)
    assert EngineCore._initialize_kv_caches(core) == (7, 3)
    assert executor.initialized == (7, 3)
    executor = FakeExecutor(available=[1000, 700], per_block=[100, 100])
    core = SimpleNamespace(config=EngineConfig(swap_space=1 / 1024), executor=executor, attn_backend=TORCH)  # 1 MiB
    assert EngineCore._initialize_kv_caches(core) == (7, MiB // 100) == executor.initialized


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_free_memory_is_measured_with_the_weights_on_the_device(tiny_model_dir, monkeypatch):
    allocated_when_measured, mem_get_info = [], torch.cuda.mem_get_info

    def spy(device=None):
        allocated_when_measured.append(torch.cuda.memory_allocated(device))
        return mem_get_info(device)

    monkeypatch.setattr(torch.cuda, "mem_get_info", spy)
    eng = engine(tiny_model_dir, device="cuda", attention_backend="torch")
    model = eng.model_runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert allocated_when_measured and allocated_when_measured[0] >= weights
