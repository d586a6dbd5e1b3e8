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


def check_text(name: str, value: object) -> None:
    """The one rule for text from users (prompts, chat messages, stop strings, bad words,
    structured-output specs): every str in `value` (a str, or lists / tuples / dicts of
    them, keys too) must be valid Unicode, i.e. encodable as UTF-8. Python's str can hold a
    lone surrogate ("\\udfff", which JSON's "\\udfff" escape decodes to) that no tokenizer
    and no UTF-8 file can take; found here, it is one clear error wherever it came in.

    Raises:
        ValueError: "{name} is not valid Unicode: a lone surrogate '\\udfff' at index 3",
            with the path into nested values (e.g. "stop[1]", "messages[0].content").
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} is not valid Unicode: a lone surrogate {value[e.start]!r} "
                             f"at index {e.start}") from None
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(f"{name}[{i}]", v)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(f"{name} key", k)
            check_text(f"{name}.{k}" if isinstance(k, str) else f"{name}[{k!r}]", v)
