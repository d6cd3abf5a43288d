"""Whether a partly generated REHEARSE output can still become one JSON value (an early stop that
changes no outcome).

`roles.rehearse.parse_rehearse` accepts exactly: optional whitespace, optionally one ```/```json fence,
one JSON value (RFC 8259, as `roles.strict_json` reads it: NaN/Infinity, a key repeated in one object
and nesting deeper than `strict_json.MAX_JSON_DEPTH` arrays/objects rejected) — or the
head of one followed by the cut marker ``…[tool result truncated: k of n tokens shown]`` (how results
over their budget are shown and taught, `roles.bounds.bound_text`) — optional whitespace, the closing
fence if one was opened. `viable` answers, for a prefix of such an output,
whether *some* continuation would parse. When it says no, every continuation is a parse error, so
decoding can stop there with the same verdict (`NotJsonStop`): on the bundled 135M model most base-model
rehearsals are prose that ran to the token budget (benchmarks/RESULTS.md, rehearser fidelity), hundreds
of tokens decoded only to be rejected.

`viable` is exact for the grammar above; it runs in O(len(text)) per call.
"""

from __future__ import annotations

import json
import re
import sys

from envace_core.roles.bounds import TRUNCATION_MARKER
from envace_core.roles.strict_json import MAX_JSON_DEPTH

_FENCE_OPEN = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n")
_FENCE_HEAD = re.compile(r"`{0,3}\Z|```[A-Za-z0-9_-]*[ \t]*\Z")  # an opening fence not yet complete
_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[0-9eE+.-]+")


_CUT_AT_END = re.compile(re.escape(TRUNCATION_MARKER.format(what="tool result", shown="@", total="@"))
                         .replace("@", r"\d+") + r"\Z")


class _End(Exception):
    """The input ended inside a value: a continuation may still complete it."""


class _Bad(Exception):
    """No continuation can make this a JSON value."""


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string(s: str, i: int) -> int:
    i += 1  # the opening quote
    while True:
        if i >= len(s):
            raise _End
        c = s[i]
        if c == '"':
            return i + 1
        if c == "\\":
            if i + 1 >= len(s):
                raise _End
            e = s[i + 1]
            if e in '"\\/bfnrt':
                i += 2
            elif e == "u":
                hexes = s[i + 2:i + 6]
                if not all(h in "0123456789abcdefABCDEF" for h in hexes):
                    raise _Bad
                if len(hexes) < 4:
                    raise _End
                i += 6
            else:
                raise _Bad
        elif ord(c) < 0x20:  # json.loads(strict=True) rejects raw control characters in strings
            raise _Bad
        else:
            i += 1


def _too_many_digits(token: str) -> bool:
    """An integer `json.loads` refuses: more digits than Python converts (``sys.get_int_max_str_digits``,
    4300 by default; 0 = no limit). Fractions and exponents are floats, without that limit."""
    limit = sys.get_int_max_str_digits()
    return bool(limit) and not any(c in token for c in ".eE") and len(token.lstrip("-")) > limit


def _value(s: str, i: int, depth: int) -> int:
    """End of the value at s[i:] (after whitespace); `depth` = arrays/objects around it."""
    i = _ws(s, i)
    if i >= len(s):
        raise _End
    c = s[i]
    if c in "[{" and depth + 1 > MAX_JSON_DEPTH:  # strict_json refuses it (check_depth)
        raise _Bad
    if c == "{":
        i = _ws(s, i + 1)
        if i >= len(s):
            raise _End
        if s[i] == "}":
            return i + 1
        keys: set[str] = set()
        while True:
            if s[i] != '"':
                raise _Bad
            end = _string(s, i)
            key = json.loads(s[i:end])  # a complete string token, checked by _string
            if key in keys:  # strict_json refuses a repeated key
                raise _Bad
            keys.add(key)
            i = _ws(s, end)
            if i >= len(s):
                raise _End
            if s[i] != ":":
                raise _Bad
            i = _ws(s, _value(s, i + 1, depth + 1))
            if i >= len(s):
                raise _End
            if s[i] == "}":
                return i + 1
            if s[i] != ",":
                raise _Bad
            i = _ws(s, i + 1)
            if i >= len(s):
                raise _End
    if c == "[":
        i = _ws(s, i + 1)
        if i >= len(s):
            raise _End
        if s[i] == "]":
            return i + 1
        while True:
            i = _ws(s, _value(s, i, depth + 1))
            if i >= len(s):
                raise _End
            if s[i] == "]":
                return i + 1
            if s[i] != ",":
                raise _Bad
            i += 1
    if c == '"':
        return _string(s, i)
    for word in ("true", "false", "null"):
        if c == word[0]:
            part = s[i:i + len(word)]
            if not word.startswith(part):
                raise _Bad
            if len(part) < len(word):
                raise _End
            return i + len(word)
    if c == "-" or c.isdigit():
        m = _NUMBER_CHARS.match(s, i)
        token, end = m.group(0), m.end()
        if _too_many_digits(token):  # refused even at the end, where a "." could still make it a float
            raise _Bad
        if end == len(s):  # a number may always go on ("1" -> "12", "1." -> "1.5", "-" -> "-1")
            if any(_NUMBER.fullmatch(token + tail) for tail in ("", "0", "1")):
                raise _End
            raise _Bad
        if not _NUMBER.fullmatch(token):
            raise _Bad
        return end
    raise _Bad


def cut_head(text: str) -> str:
    """`text` before the cut marker it ends with (all of `text` when it ends with none)."""
    cut = _CUT_AT_END.search(text.rstrip(_WS))
    return text if cut is None else text[:cut.start()]


def json_head_viable(text: str) -> bool:
    """True when some continuation of `text` is one JSON value (leading whitespace allowed)."""
    ok, end = _json_then(text, 0)
    return ok and (end is None or not text[end:].strip(_WS))  # a complete value: only whitespace after


def _json_then(text: str, i: int, depth: int = 0) -> tuple[bool, int | None]:
    """(viable, end): whether text[i:] can still become one JSON value, and where a complete one ends.
    `depth`: arrays/objects already open around it (the `MAX_JSON_DEPTH` limit counts them)."""
    try:
        return True, _value(text, i, depth)
    except _End:
        return True, None
    except _Bad:
        return False, None


def value_end(text: str, i: int = 0, depth: int = 0) -> tuple[bool, int | None]:
    """Whether ``text[i:]`` (leading whitespace allowed) can still become one JSON value as
    `roles.strict_json` reads it (no repeated key in an object, at most `MAX_JSON_DEPTH` nested
    arrays/objects counting the `depth` already open), and the index just past that value when it is
    complete (None while it is not). What follows a complete value is not looked at. O(len(text))."""
    return _json_then(text, i, depth)


# The cut marker `roles.bounds.bound_text` appends to a result over its budget (parse_rehearse accepts
# a JSON head followed by it): literal parts and the two token counts between them.
_MARKER_PARTS = TRUNCATION_MARKER.format(what="tool result", shown="\0", total="\0").split("\0")


def _marker_prefix(rest: str) -> bool:
    """True when `rest` is a prefix of some ``…[tool result truncated: <k> of <n> tokens shown]``
    (trailing whitespace allowed once it is complete)."""
    i = 0
    for n, lit in enumerate(_MARKER_PARTS):
        part = rest[i:i + len(lit)]
        if not lit.startswith(part):
            return False
        if len(part) < len(lit):
            return True
        i += len(lit)
        if n < len(_MARKER_PARTS) - 1:
            j = i
            while j < len(rest) and rest[j].isdigit():
                j += 1
            if j == len(rest):
                return True
            if j == i:
                return False
            i = j
    return not rest[i:].strip(_WS)


def _complete(body: str) -> bool:
    """`body` (what a fence would hold) is one JSON value, or a JSON head + the whole cut marker;
    whitespace around allowed."""
    ok, end = _json_then(body, 0)
    if ok and end is not None and not body[end:].strip(_WS):
        return True
    cut = _CUT_AT_END.search(body.rstrip(_WS))
    return cut is not None and json_head_viable(body[:cut.start()])


def _open(body: str) -> bool:
    """`body` can still be continued into `_complete` form."""
    ok, end = _json_then(body, 0)
    if ok and (end is None or not body[end:].strip(_WS)):
        return True
    pos = body.find(_MARKER_PARTS[0][0])  # a JSON head cut by the marker: try every "…" it can end at
    while pos >= 0:
        if json_head_viable(body[:pos]) and _marker_prefix(body[pos:]):
            return True
        pos = body.find(_MARKER_PARTS[0][0], pos + 1)
    return False


def viable(text: str) -> bool:
    """True when some continuation of `text` is an output `parse_rehearse` accepts (module docstring):
    [fence] a JSON value [closing fence], or [fence] a JSON value's head + the cut marker [closing fence]."""
    i = _ws(text, 0)
    if not text.startswith("`", i):
        return _open(text[i:])
    m = _FENCE_OPEN.match(text, i)
    if m is None:
        return bool(_FENCE_HEAD.match(text[i:]))
    body = text[m.end():]
    if _open(body):
        return True
    tail = body.rstrip(_WS)
    for n in (3, 2, 1):  # a closing fence (or its start) after a complete body
        if tail.endswith("`" * n) and _complete(tail[:-n]):
            return True
    return False


class NotJsonStop:
    """A stop predicate for generation: ``stop(token_ids)`` is True once the decoded text (special
    tokens skipped, as the rollout decodes it) can no longer become a JSON value (`viable`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_ids: list[int]) -> bool:
        return not viable(self.tokenizer.decode(token_ids, skip_special_tokens=True))
