"""Quantized linear weights: a layer's `quant_method` (layers/parallel.py, `_linear`) holds
the weight in its stored format and runs its matmul. vLLM:
`vllm/model_executor/layers/quantization/`. gguf.py and gguf_loader.py (GGUF blocks read
packed), gguf_a8.py (int8 activations on them), int8.py (int8 weights quantized at load)."""
