"""Strict JSON decoding shared by the role parsers: NaN/Infinity constants, trailing text, duplicate object
keys and nesting deeper than `MAX_JSON_DEPTH` are rejected.

The depth limit is checked on the text before `json` decodes it, so a model output of thousands of `[`
costs one linear scan and never reaches `json`'s recursive scanner (which raises RecursionError, not
ValueError, near the interpreter's recursion limit, a limit that also depends on how deep the caller's
stack already is).
"""

from __future__ import annotations

import json
import re
from typing import Any

# Arrays/objects nested inside one another, at most (`"[1]"` has depth 1, `{"a": [1]}` depth 2). serde_json's
# default recursion limit (serde_json::Deserializer, 128): far above any tool call or tool result (tau2's
# airline/retail ones are under 10 deep), and low enough that every recursive walk of a decoded value
# (json.dumps, jsonschema, pydantic) stays far below Python's recursion limit of 1000 frames.
MAX_JSON_DEPTH = 128

# A string token (an unterminated one runs to the end of the text) or one bracket.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)


class JsonTooDeep(ValueError):
    """The text nests arrays/objects deeper than `MAX_JSON_DEPTH`."""


class DuplicateKey(ValueError):
    """An object holds the same key twice. `.key` is that key, `.path` where the object is in the value:
    the keys and list indices from the top (``()`` for the top-level object)."""

    def __init__(self, key: str, path: tuple[str | int, ...]):
        where = "/".join(map(str, path)) or "the top-level object"
        super().__init__(f"duplicate key {json.dumps(key, ensure_ascii=False)} in {where}")
        self.key, self.path = key, path


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def check_depth(text: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise `JsonTooDeep` when `text` opens more than `limit` arrays/objects inside one another (brackets in
    strings do not count). One regex pass, O(len(text)); an unbalanced `]`/`}` never lowers the count below 0,
    so the count is at least the depth `json` would reach on any prefix it accepts."""
    depth = 0
    for m in _TOKEN.finditer(text):
        c = m.group()[0]
        if c in "[{":
            depth += 1
            if depth > limit:
                raise JsonTooDeep(f"JSON nested too deeply: more than {limit} levels of arrays/objects "
                                  f"(at char {m.start()})")
        elif c in "]}":
            depth = max(depth - 1, 0)


def value_depth(value: Any) -> int:
    """Arrays/objects nested inside one another in a decoded value (`check_depth`'s count: 0 for a scalar,
    1 for ``[1]``); iterative, so any depth is measured."""
    best, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            best = max(best, d + 1)
            stack.extend((sub, d + 1) for sub in (v.values() if isinstance(v, dict) else v))
    return best


class _Pairs(dict):
    """A decoded object whose text held a key twice; `.dup` is the first repeated key (last value kept)."""

    dup: str


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) == len(pairs):
        return d
    seen: set[str] = set()
    marked = _Pairs(d)
    marked.dup = next(k for k, _ in pairs if k in seen or seen.add(k))
    return marked


def _first_duplicate(value: Any) -> DuplicateKey | None:
    """The `DuplicateKey` of the first marked object in `value`, pre-order (iterative: depth is bounded but
    the value may be wide)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, _Pairs):
            return DuplicateKey(v.dup, path)
        if isinstance(v, dict):
            stack.extend((sub, path + (k,)) for k, sub in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((sub, path + (i,)) for i, sub in reversed(list(enumerate(v))))
    return None


def _plain(value: Any) -> Any:
    """`value` with every `_Pairs` turned back into a plain dict."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def decode_json(text: str) -> tuple[Any, DuplicateKey | None]:
    """(value, duplicate): `text` decoded as exactly one JSON value (RFC 8259; `json.loads`) with NaN /
    Infinity rejected and nesting checked first (`check_depth`), and the first duplicate object key found
    (None when there is none; the value then keeps the last of the repeated key's values, as `json.loads`
    does). For callers that decide by where the duplicate is (`DuplicateKey.path`).

    Raises `JsonTooDeep` (nesting over `MAX_JSON_DEPTH`) or ValueError (anything else that is not one JSON
    value)."""
    check_depth(text)
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_pairs_hook)
    except RecursionError:  # not expected under MAX_JSON_DEPTH; kept so it can never escape as one
        raise JsonTooDeep("JSON nested too deeply") from None
    dup = _first_duplicate(value)
    return (value, None) if dup is None else (_plain(value), dup)


def strict_json(text: str) -> Any:
    """`text` as one JSON value: `json.loads` that also rejects NaN / Infinity, a key repeated in one object
    (RFC 8259 §4: names SHOULD be unique, and parsers differ on which value wins) and nesting deeper than
    `MAX_JSON_DEPTH`. Raises ValueError for all of these: `DuplicateKey` and `JsonTooDeep` are subclasses,
    naming the key and where it is / the limit."""
    value, dup = decode_json(text)
    if dup is not None:
        raise dup
    return value
