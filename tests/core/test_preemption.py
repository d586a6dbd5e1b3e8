"""Preemption by swap and by recompute, the cost model that picks one, chunked prefill
under preemption, and abort from every queue: tiny random Llama, fast."""
import pytest

from nanopaged import EngineConfig, LLMEngine, SamplingParams
from nanopaged.core.scheduler import PreemptionCosts

from invariants import check_block_invariants, run_checked

pytestmark = pytest.mark.exactness

PROMPTS = [list(range(1 + 7 * i, 12 + 7 * i)) for i in range(6)]
PARAMS = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(6)]


def engine(folder, **kw) -> LLMEngine:
    kw.setdefault("enable_prefix_caching", False)
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(folder), **kw))


def run_all(eng):
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(str(i), p, sp)
    return {k: v.outputs[0].token_ids for k, v in run_checked(eng).items()}


@pytest.fixture(scope="module")
def unconstrained(tiny_model_dir):
    return run_all(engine(tiny_model_dir, num_gpu_blocks=256, block_size=4))


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("budget", [None, 8])
def test_c08_like_outputs_never_depend_on_preemption(tiny_model_dir, unconstrained, mode, budget):
    eng = engine(tiny_model_dir, num_gpu_blocks=14, block_size=4, num_cpu_blocks=64,
                 preemption_mode=mode, max_num_batched_tokens=budget, max_num_seqs=4)
    assert run_all(eng) == unconstrained
    stats = eng.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_preemptions"] == stats["num_preemptions_swap"] + stats["num_preemptions_recompute"]
    if mode == "swap":
        assert stats["num_preemptions_recompute"] == 0
    if mode == "recompute":
        assert stats["num_preemptions_swap"] == 0
    assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"] == 64


def test_swap_falls_back_to_recompute_without_cpu_room(tiny_model_dir, unconstrained):
    eng = engine(tiny_model_dir, num_gpu_blocks=14, block_size=4, num_cpu_blocks=0, preemption_mode="swap")
    assert run_all(eng) == unconstrained
    assert eng.get_stats()["num_preemptions_swap"] == 0 < eng.get_stats()["num_preemptions_recompute"]


@pytest.mark.parametrize("costs,expected", [(PreemptionCosts(1e-9, 1.0), "swap"),
                                            (PreemptionCosts(1.0, 1e-9), "recompute")])
def test_auto_picks_the_cheaper_mode(tiny_model_dir, unconstrained, costs, expected):
    eng = engine(tiny_model_dir, num_gpu_blocks=14, block_size=4, num_cpu_blocks=64, preemption_mode="auto")
    eng.scheduler.costs = costs
    assert run_all(eng) == unconstrained
    other = "recompute" if expected == "swap" else "swap"
    assert eng.get_stats()[f"num_preemptions_{expected}"] > 0 == eng.get_stats()[f"num_preemptions_{other}"]


def test_cost_model_compares_bytes_moved_with_tokens_recomputed():
    costs = PreemptionCosts(seconds_per_block_swap=1e-3, seconds_per_token_recompute=1e-3)
    assert costs.prefer_swap(num_blocks=2, num_tokens=32)          # 4 ms of copies < 32 ms of prefill
    assert not costs.prefer_swap(num_blocks=20, num_tokens=32)


def test_measured_costs_are_positive(tiny_model_dir):
    eng = engine(tiny_model_dir, num_gpu_blocks=16, block_size=4, num_cpu_blocks=16, preemption_mode="auto")
    c = eng.scheduler.costs
    assert 0 < c.seconds_per_block_swap < 1 and 0 < c.seconds_per_token_recompute < 1
    assert not eng.model_runner.kv_cache.any()          # measuring left the pool as it was: zeros


@pytest.mark.parametrize("where", ["waiting", "running", "swapped", "mid-chunk"])
def test_abort_anywhere_frees_both_pools_within_one_step(tiny_model_dir, where):
    eng = engine(tiny_model_dir, num_gpu_blocks=14, block_size=4, num_cpu_blocks=64, preemption_mode="swap",
                 max_num_batched_tokens=8 if where == "mid-chunk" else None, max_num_seqs=4)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(str(i), p * (3 if where == "mid-chunk" else 1), sp)
    victim = None
    for _ in range(200):
        eng.step()
        check_block_invariants(eng)
        s = eng.scheduler
        queue = {"waiting": s.waiting, "running": s.running, "swapped": s.swapped}.get(where)
        if where == "mid-chunk":
            queue = [g for g in s.running if 0 < g.seqs[0].num_computed_tokens < len(g.seqs[0].prompt_token_ids)]
        if queue:
            victim = queue[-1].request_id
            break
    assert victim is not None, f"never saw a request {where}"
    eng.abort_request(victim)
    check_block_invariants(eng)
    assert all(victim != g.request_id for q in (s.waiting, s.running, s.swapped) for g in q)
    outs = run_checked(eng)
    assert victim not in outs
