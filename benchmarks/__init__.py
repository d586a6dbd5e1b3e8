"""nanopaged's benchmarks, one module per section of `python bench.py --sections ...`.

    driver.py       the flags, the --help text (every section described), the dispatch
    results.py      --results-entry: the run printed as an entry of RESULTS.md
    common.py       the throughput workload, running it on nanopaged and on transformers,
                    the CPU flags, the decode-attention inputs and timer (kernels, chapter 12)
    throughput.py   nanopaged vs transformers `generate`, the matmul roofline, --profile
    chat.py         batch-1 time per output token
    prefix.py, sharing.py, pressure.py, memory.py
                    prefix caching on vs off; block sharing (n=4, beam search); preemption
                    modes under a small KV pool; paged vs contiguous KV reservation
    sampling.py, structured.py, overlap.py
                    full sampling vs greedy; JSON-schema constrained vs free; async
                    scheduling off vs on
    spec.py         speculative decoding (n-gram, layer draft) vs off, copy-heavy and
                    plain chat, batch 1 and 8 (not default)
    kernels.py      the compiled paged-attention kernel vs the PyTorch reference
    serve.py        the OpenAI server vs `transformers serve`, Poisson arrivals (not default)
    tp.py           tensor parallelism vs one rank (not default)
    lora.py         many LoRA adapters in one batch vs the base alone vs transformers + peft
                    one adapter at a time (not default)
    vllm.py         vLLM's CPU backend, in a child process of its own venv (not default)
    quant.py, quant_accuracy.py, llama_server.py
                    GGUF weights as shipped vs the fp32 folder vs llama.cpp (its Python API
                    and its llama-server), int8 activations' accuracy table (not default)

Not part of the installed package (setup.py finds nanopaged* only): run from a checkout.
"""
