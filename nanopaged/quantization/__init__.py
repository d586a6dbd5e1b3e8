"""Quantized linear weights: a layer's `quant_method` (layers/parallel.py, `_linear`) holds
the weight in its stored format and runs its matmul. vLLM:
`vllm/model_executor/layers/quantization/`. gguf.py and gguf_loader.py (GGUF blocks read
packed), gguf_a8.py (int8 activations on them), int8.py (int8 weights quantized at load),
kernels.py (their compiled matmuls: kernels/cpu/quant/, an extension of their own).

How it joins the base (features.py): each row puts a mixin in front of the model's family
class ("int8 activations": Int8ActivationsModel, "GGUF weights": GGUFQuantizedModel, "int8
weights": Int8QuantizedModel) that gives its layers their `quant_method`; "GGUF weights"
also finds the model's folder (gguf_loader.resolve_gguf_model). The GGUF and int8
weights' models override `set_ops` too: given the CPU kernels, they join kernels.py's
extension to them at load (kernels.join_quant_kernels). Chapter 21."""
