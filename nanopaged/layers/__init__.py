"""What a model is built from, below the model: attention over the paged KV cache (the
PyTorch reference and its metadata), the kernels' Python side (backends.py: one object
per implementation of the layer ops), Megatron's column/row-parallel linear layers
(parallel.py) and the tp x pp grid of ranks (groups.py). Imports only the vocabulary at
the package root (chapters 04, 05, 12, 17, 20).
"""
