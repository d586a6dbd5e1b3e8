"""The execution layer: the model runner (its own per-sequence state, inputs,
forward, sampling), attention and the kernels' backends. It makes no decisions
and never sees a live request object (chapters 04, 06, 12).
"""
