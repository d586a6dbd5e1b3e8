"""Integer arithmetic the engine does in several places (vLLM keeps the same helper in
`vllm/utils/math_utils.py`)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division, ceil(a / b) for b > 0, in integers: how many blocks of b hold
    a tokens (`cdiv(17, 16) == 2`, `cdiv(0, 16) == 0`). Exact for any size of int, where
    `math.ceil(a / b)` goes through a float. Works on tensors too."""
    return -(a // -b)
