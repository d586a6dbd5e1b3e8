"""The value checks every layer repeats, written once: is this an integer, a number, a
list of something; and the ValueError that names the field and the value. And the two
walks over nested user input (text in lists and dicts, brackets in JSON text): both keep
their own stack and refuse nesting past MAX_NESTING_DEPTH, so no request, however deep,
meets Python's recursion limit (a RecursionError, a 500 in the server).

Python's bool is a subclass of int (`isinstance(True, int)` is True, `True + 1 == 2`), so a
plain isinstance check would take `max_tokens=True` as 1. Every "integer" and "number"
here refuses bools; a field that wants a bool checks `isinstance(x, bool)` itself.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from itertools import accumulate


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


# How deep a user's value may nest (a list in a list in a dict ...: each container is a
# level). serde_json's default limit; real requests nest a few levels (a JSON schema a
# dozen), and past ~1000 Python's own walkers (json, jinja, pydantic) raise RecursionError.
MAX_NESTING_DEPTH = 128


def check_text(name: str, value: object, max_depth: int = MAX_NESTING_DEPTH) -> None:
    """The one rule for text from users (prompts, chat messages, stop strings, bad words,
    structured-output specs, chat template variables): every str in `value` (a str, or
    lists / tuples / dicts of them, keys too) must be valid Unicode, i.e. encodable as
    UTF-8. Python's str can hold a lone surrogate ("\\udfff", which JSON's "\\udfff" escape
    decodes to) that no tokenizer and no UTF-8 file can take; found here, it is one clear
    error wherever it came in. And `value` may nest at most `max_depth` containers deep:
    the walk keeps its own stack (it cannot hit Python's recursion limit however deep the
    value), but everything after it (json.dumps, the chat template, the grammar compiler)
    recurses, so a deeper value is refused here, first.

    Raises:
        ValueError: "{name} is not valid Unicode: a lone surrogate '\\udfff' at index 3",
            with the path into nested values (e.g. "stop[1]", "messages[0].content");
            "{name} nests lists / objects at least 129 levels deep, more than the limit
            of 128".
    """
    stack: list[tuple[str, object, int]] = [(name, value, 0)]   # (path, value, containers above it)
    while stack:
        path, v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{path} is not valid Unicode: a lone surrogate {v[e.start]!r} "
                                 f"at index {e.start}") from None
            continue
        if not isinstance(v, (list, tuple, dict)):
            continue
        if depth >= max_depth:
            raise ValueError(f"{name} nests lists / objects at least {depth + 1} levels deep, more than "
                             f"the limit of {max_depth}")
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                items += [(f"{path} key", k), (f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]", x)]
        else:
            items = [(f"{path}[{i}]", x) for i, x in enumerate(v)]
        stack.extend((p, x, depth + 1) for p, x in reversed(items))   # reversed: the first is checked first


# A JSON string, escapes and all (an unterminated one runs to the end), and the bytes that
# are not brackets: what check_json_nesting throws away before it counts.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|$)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_JSON_TOKEN = re.compile(_JSON_STRING.pattern + rb"|[\[\]{}]", re.S)      # a string or a bracket
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NAMING_BUDGET = 20_000         # tokens read to name the key of a too-deep body (~10 ms)


def check_json_nesting(name: str, text: str | bytes, max_depth: int = MAX_NESTING_DEPTH) -> None:
    """Refuse JSON text that nests arrays / objects more than `max_depth` deep, before
    anything parses it: Python's json module recurses once per level and raises
    RecursionError near 1000 (so a body of 100,000 "[" would be a 500, not a 400). Only
    brackets outside strings count; no parsing, and no Python loop over the text (the
    depth is a running sum over its brackets: ~0.1 s for a 1 MB body of brackets). Text
    that is not JSON at all is left to the parser to refuse.

    Raises:
        ValueError: "{name} nests JSON arrays / objects 900 levels deep (under its key
            "chat_template_kwargs"), more than the limit of 128": the key is the
            top-level key of the object the deep part sits under, if there is one.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= max_depth:     # the common case, at once
        return
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)
    if depth <= max_depth:
        return
    key = _deep_key(data, max_depth)
    if key is not None and len(key) > 80:
        key = key[:77] + b'..."'
    where = "" if key is None else f" (under its key {key.decode('utf-8', 'replace')})"
    raise ValueError(f"{name} nests JSON arrays / objects {depth} levels deep{where}, more than "
                     f"the limit of {max_depth}")


def _deep_key(data: bytes, max_depth: int) -> bytes | None:
    """The top-level key (as JSON text, quotes and all) under which `data` first nests
    past max_depth; None for a top-level array, or when the first _NAMING_BUDGET tokens
    do not say (then the message names no key rather than take longer)."""
    depth, last_key, key = 0, None, None
    for _, m in zip(range(_NAMING_BUDGET), _JSON_TOKEN.finditer(data)):
        token = m.group()
        if token[:1] == b'"':
            if depth == 1:            # in a top-level object the last string before a nested
                last_key = token      # value is that value's key
        elif token in (b"[", b"{"):
            depth += 1
            key = last_key if depth == 2 else key
            if depth > max_depth:
                return key
        else:
            depth -= 1
    return None
