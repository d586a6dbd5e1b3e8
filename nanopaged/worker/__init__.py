"""The execution layer: the model runner (its own per-sequence state, inputs,
forward, sampling) and the executor with its workers. It makes no decisions and
never sees a live request object (chapters 04, 06, 14, 17).
"""
