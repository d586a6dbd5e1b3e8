"""Quantized linear weights: a layer's `quant_method` (layers/parallel.py, `_linear`) holds
the weight in its stored format and runs its matmul. vLLM:
`vllm/model_executor/layers/quantization/`. gguf.py: GGUF's block formats.
"""
