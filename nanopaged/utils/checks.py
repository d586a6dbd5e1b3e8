"""The value checks every layer repeats, written once: is this an integer, a number, a
list of something; and the ValueError that names the field and the value.

Python's bool is a subclass of int (`isinstance(True, int)` is True, `True + 1 == 2`), so a
plain isinstance check would take `max_tokens=True` as 1. Every "integer" and "number"
here refuses bools; a field that wants a bool checks `isinstance(x, bool)` itself.
"""
from __future__ import annotations

import math
from collections.abc import Callable


def is_int(x: object) -> bool:
    """True for an int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object, *, finite: bool = True) -> bool:
    """True for an int or a float that is not a bool; with `finite` (the default), not NaN
    and not infinite either. `finite=False` takes any float, NaN and the infinities too."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    return not finite or math.isfinite(x)


def is_list_of(x: object, ok: Callable[[object], bool]) -> bool:
    """True for a list or tuple whose every element passes `ok` (so also for an empty one)."""
    return isinstance(x, (list, tuple)) and all(ok(v) for v in x)


def invalid(name: str, value: object, rule: str) -> ValueError:
    """The ValueError for a bad value, naming the field, the rule and the value:
    `invalid("top_p", 0, "in (0, 1]")` says "top_p must be in (0, 1], got 0". The caller
    raises it."""
    return ValueError(f"{name} must be {rule}, got {value!r}")


def check_int(name: str, value: object, *, minimum: int | None = None, rule: str | None = None) -> None:
    """Raise `invalid(name, value, rule)` unless value is an int (not a bool) and, when
    `minimum` is given, at least `minimum`. The rule reads "an integer" or "an integer >=
    {minimum}" unless `rule` says it another way ("a positive integer").

    Raises:
        ValueError: "{name} must be {rule}, got {value!r}".
    """
    if not is_int(value) or (minimum is not None and value < minimum):
        if rule is None:
            rule = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise invalid(name, value, rule)
