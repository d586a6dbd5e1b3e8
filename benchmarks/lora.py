"""lora: many LoRA adapters in one batch (chapters/22-lora.md) vs the base model alone,
and vs transformers + peft serving them one adapter at a time.

The workload (fixed seed): 32 requests of the throughput workload (prompts of U[32, 256]
random token ids, outputs of U[32, --max-output] tokens, greedy, ignore_eos), spread
round-robin over 1, 4 or 16 adapters of rank 8 or 64 targeting all seven projections
(q, k, v, o, gate, up, down). The adapters are made here by peft on the model's own
shapes with random A and B (`init_lora_weights=False`), so they change the output.

nanopaged gets all 32 at once, with max_loras = the number of adapters (every adapter
has a slot: the step mixes them all); transformers + peft loads every adapter on one
PeftModel and serves one adapter's requests at a time (`set_adapter`, then static
batches of 16, as the throughput section). Only the requested output tokens count.
Same model folder, dtype and threads, same process.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .common import run_transformers, workload

NUM_REQUESTS = 32
ADAPTER_COUNTS = (1, 4, 16)
RANKS = (8, 64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_folder: str, rank: int, count: int, out: Path) -> list[Path]:
    """`count` PEFT adapter folders of rank `rank` for the model in model_folder, random A
    and B (seeded), saved under out; the base weights are not needed (peft saves only the
    adapter), so a randomly initialised model of the same config stands in."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_folder)
    folders = []
    for i in range(count):
        torch.manual_seed(1000 * rank + i)
        base = AutoModelForCausalLM.from_config(config)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                     init_lora_weights=False))
        folder = out / f"r{rank}-{i}"
        peft_model.save_pretrained(folder)
        folders.append(folder)
    return folders


def run_lora(llm, prompts, out_lens, requests) -> tuple[float, int]:
    """Seconds and output tokens of one generate over every request, each with its
    LoRARequest (None: the base model)."""
    from nanopaged import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens)
    return elapsed, tokens


def run_peft(model_folder: str, dtype, folders: list[Path], prompts, out_lens) -> tuple[float, int]:
    """transformers + peft, one adapter at a time: every adapter loaded on one PeftModel
    (before the clock starts), then for each adapter `set_adapter` and its requests in
    static batches of 16."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=dtype)
    model = PeftModel.from_pretrained(base, folders[0], adapter_name="a0")
    for i, folder in enumerate(folders[1:], 1):
        model.load_adapter(folder, adapter_name=f"a{i}")
    model.eval()
    seconds = tokens = 0
    for i in range(len(folders)):
        mine = list(range(i, len(prompts), len(folders)))
        model.set_adapter(f"a{i}")
        s, n = run_transformers(model, [prompts[j] for j in mine], [out_lens[j] for j in mine])
        seconds, tokens = seconds + s, tokens + n
    return seconds, tokens


def bench_lora(model: str, args) -> None:
    """The table: per setting, nanopaged's tokens/s, transformers + peft's, and the ratio;
    the base model alone first (no adapter on either side)."""
    import torch

    from transformers import AutoConfig

    from nanopaged import LLM, LoRARequest

    dtype, folder = getattr(torch, args.dtype), str(model)       # the driver gives a folder
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    prompts, out_lens = workload(NUM_REQUESTS, vocab, max_output=args.max_output)
    print(f"lora: {NUM_REQUESTS} requests, adapters on all 7 projections, dtype {args.dtype}")
    print(f"{'setting':<22} {'nanopaged tok/s':>16} {'peft tok/s':>11} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(folder, dtype=args.dtype, attention_backend=args.attention_backend, enable_prefix_caching=False)
        run_lora(llm, prompts[:4], [4] * 4, None)                                   # warm-up
        s, n = run_lora(llm, prompts, out_lens, None)
        ours = n / s
        theirs = None
        if not args.skip_transformers:
            from transformers import AutoModelForCausalLM
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
            s, n = run_transformers(hf, prompts, out_lens)
            theirs = n / s
            del hf
        _row("base model alone", ours, theirs)
        llm.shutdown()
        del llm
        for rank in RANKS:
            folders = make_adapters(folder, rank, max(ADAPTER_COUNTS), Path(tmp))
            for count in ADAPTER_COUNTS:
                llm = LLM(folder, dtype=args.dtype, attention_backend=args.attention_backend,
                          enable_prefix_caching=False, enable_lora=True, max_loras=count, max_lora_rank=rank)
                requests = [LoRARequest(f"r{rank}-{i % count}", 1 + i % count, str(folders[i % count]))
                            for i in range(NUM_REQUESTS)]
                run_lora(llm, prompts[:4], [4] * 4, requests[:4])                   # warm-up: loads adapters
                s, n = run_lora(llm, prompts, out_lens, requests)
                ours = n / s
                llm.shutdown()
                del llm
                theirs = None
                if not args.skip_transformers:
                    s, n = run_peft(folder, dtype, folders[:count], prompts, out_lens)
                    theirs = n / s
                _row(f"{count:>2} adapters, rank {rank:<2}", ours, theirs)


def _row(name: str, ours: float, theirs: float | None) -> None:
    ratio = f"{ours / theirs:6.2f}x" if theirs else "     -"
    print(f"{name:<22} {ours:16.1f} {theirs or 0:11.1f} {ratio:>7}")
