"""kernels: (also --kernels) the compiled paged-attention kernel vs the PyTorch
reference: decode attention alone (64 sequences x 1024 tokens of context, fp32 and bf16,
the default model's heads), then the throughput workload end to end with each backend.
On a GPU: KV bytes read per second at 256 x 2048, bf16, as a share of the H200's
~4.8 TB/s, and time vs SDPA on contiguous K/V."""
from __future__ import annotations

import torch

from .common import decode_batch, run_nanopaged, seconds_per_call, workload


def bench_kernels(model, args) -> None:
    """Compiled decode attention vs the reference, then end to end with each backend."""
    from nanopaged.layers.backends import TorchOps, get_ops
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel, ref = get_ops(device, device), TorchOps()
    heads, kv_heads, head = 9, 3, 64                          # SmolLM2-135M
    print(f"decode attention, 64 sequences x 1024 tokens, {heads} heads / {kv_heads} KV heads x {head}, "
          f"block_size 16, {device}, torch threads {torch.get_num_threads()}:")
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, meta = decode_batch(64, 1024, heads, kv_heads, head, 16, dtype, device)
        t_ref = seconds_per_call(lambda: ref.forward(q, kc, vc, meta, head ** -0.5), 5)
        t_ker = seconds_per_call(lambda: kernel.forward(q, kc, vc, meta, head ** -0.5), 5)
        print(f"  {str(dtype)[6:]:<9} reference {1e3 * t_ref:8.2f} ms   {kernel.name} kernel "
              f"{1e3 * t_ker:8.2f} ms   ratio {t_ref / t_ker:5.2f}x")
    if device == "cuda":
        bench_gpu_bandwidth(kernel)
    from nanopaged import LLM
    # Alternating runs, best of two each: on a shared VM one run can be 1.5x slower than
    # the next, and the first engine of a process pays the first touch of its memory.
    rates = {"torch": 0.0, device: 0.0}
    for name in ("torch", device, "torch", device):
        llm = LLM(model, dtype=args.dtype, attention_backend=name, enable_prefix_caching=False)
        prompts, out_lens = workload(args.num_requests, llm.engine.model_config.vocab_size, max_output=args.max_output)
        run_nanopaged(llm, prompts[:4], [4] * 4)                           # warm-up
        secs, tokens = run_nanopaged(llm, prompts, out_lens)
        rates[name] = max(rates[name], tokens / secs)
        print(f"end to end, attention_backend={name!r:<8} {tokens / secs:8.1f} tok/s ({args.dtype})")
        del llm
    print(f"end-to-end ratio {device} kernel / torch reference (best of 2 each): "
          f"{rates[device] / rates['torch']:.2f}x")


def bench_gpu_bandwidth(kernel, num_seqs=256, context=2048, head=128, heads=32, kv_heads=8) -> None:
    """KV bytes read per second vs the H200's HBM bandwidth; time vs SDPA on contiguous K/V."""
    import torch.nn.functional as F
    q, kc, vc, meta = decode_batch(num_seqs, context, heads, kv_heads, head, 16, torch.bfloat16, "cuda")
    t_ker = seconds_per_call(lambda: kernel.forward(q, kc, vc, meta, head ** -0.5), 20)
    kv_bytes = 2 * num_seqs * context * kv_heads * head * 2
    k = kc.view(num_seqs, context, kv_heads, head).transpose(1, 2).contiguous()   # [S, kv_heads, T, D]
    v = vc.view(num_seqs, context, kv_heads, head).transpose(1, 2).contiguous()
    t_sdpa = seconds_per_call(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True), 20)
    print(f"GPU decode, {num_seqs} x {context}, bf16, {heads}/{kv_heads} heads x {head}: kernel "
          f"{1e3 * t_ker:.3f} ms = {kv_bytes / t_ker / 1e12:.2f} TB/s of KV "
          f"({100 * kv_bytes / t_ker / 4.8e12:.0f}% of 4.8 TB/s); SDPA on contiguous K/V "
          f"{1e3 * t_sdpa:.3f} ms; kernel / SDPA time {t_ker / t_sdpa:.2f}x")
