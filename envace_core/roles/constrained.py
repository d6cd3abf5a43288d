"""Constrained decoding for ACT and REHEARSE: which outputs a role may still produce, token by token.

Structured outputs as vLLM (``StructuredOutputsParams``, backed by xgrammar or llguidance) and
llama.cpp's grammars offer them: the sampler draws only tokens that keep the output inside the role's
format (`engines.base.SamplingParams.constraints`), so a rollout no longer ends in a format error
(METHOD.md §2, format) because one unlikely token was drawn at temperature T. A constraint is asked
``allows(token_ids, ends)``: may the sample be `token_ids` (the generated ids so far, the drawn
candidate last), and, with ``ends`` (the candidate is a stop token), end there. Texts are decoded as the
rollout decodes them (special tokens skipped).

ACT (`ActConstraint`) keeps to the strict format `roles.act.parse_act` reads (METHOD.md §1):
- a call: optional whitespace, ``<tool_call>``, a JSON object whose first key is "name" holding one of
  the task's tool names, then either ``}`` or ``, "arguments": {...}}``, then ``</tool_call>`` and
  whitespace only; it may end only after the closing tag. The arguments are checked as JSON (no key
  repeated in one object, the `MAX_JSON_DEPTH` limit), not against the tool's schema: an argument the
  schema refuses is the environment's to answer (tau2's ``Environment.get_response``; the rollout's
  ``schema_errors`` setting).
- a message: text holding no ``<tool_call`` and no tag `parse_act` would see; it may end anywhere once
  not empty. A call written in another model family's format inside a message is not prevented: it
  stays a `ForeignToolCallFormat` parse error, as is a call cut by the token budget.
- no tag inside the call's JSON strings either (`parse_act` finds tags anywhere in the text).

Both refuse, whatever the text, a special token that is not a stop and an id past the tokenizer's
vocabulary: decoding skips them, so the text would not show them. Known gaps, all refusing outputs
the parsers would accept (never the reverse): Unicode whitespace other than JSON's around the call or
the rehearsal; "name" not the first key; a number directly followed by a closing code fence.

REHEARSE (`RehearseConstraint`): a prefix some continuation of which `roles.rehearse.parse_rehearse`
accepts (`roles.json_prefix.viable`); it may end only where `parse_rehearse` accepts it.

Each check decodes the sample's ids and scans the text: O(generated tokens) per drawn token.
"""

from __future__ import annotations

import json

import regex

from envace_core.roles.errors import ParseError
from envace_core.roles.json_prefix import value_end, viable
from envace_core.roles.rehearse import parse_rehearse
from envace_core.roles.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_WS = " \t\n\r"  # JSON's whitespace (RFC 8259 §2)
_TAG = regex.compile(r"</?tool_call\b")  # what `parse_act` takes for a tag (its `_TAG` before the ">")


def _tags_ok(text: str, final: bool) -> bool:
    """No tag `parse_act` would see in `text`; unless `final`, one at the very end may still become a
    word ("</tool_call" -> "</tool_calls")."""
    return all(not final and m.end() == len(text) for m in _TAG.finditer(text))


def _message(s: str, final: bool) -> bool:
    """`s` is (the start of) a message: `parse_act` reads text without a tag as a message unless it holds
    "<tool_call" or "</tool_call>" anywhere (a malformed tag)."""
    return "<tool_call" not in s and TOOL_CALL_CLOSE not in s and _tags_ok(s, final)


class _Tokens:
    """The tokenizer's decoding plus the ids no output may hold: special tokens that are not a stop
    (they would vanish from the decoded text, so no text check could refuse them) and ids past the
    tokenizer's vocabulary (a model's padded embedding rows)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", None) or ())
        try:
            self.size = len(tokenizer)
        except TypeError:
            self.size = None

    def text(self, token_ids: list[int], ends: bool) -> str | None:
        """The decoded text, or None when the candidate (the last id) is never allowed."""
        last = token_ids[-1] if token_ids else None
        if last is not None and not ends and (last in self.special or (self.size is not None and last >= self.size)):
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _head(names: list[str]) -> regex.Pattern:
    """The call's head: ``{"name": "<one of names>"`` then ``}`` (no arguments) or ``, "arguments": {``."""
    forms = {json.dumps(n, ensure_ascii=a)[1:-1] for n in names for a in (True, False)}  # é or \u00e9
    alts = "|".join(regex.escape(f) for f in sorted(forms, key=len, reverse=True))
    ws = "[ \\t\\n\\r]*"
    return regex.compile(f'{ws}\\{{{ws}"name"{ws}:{ws}"(?:{alts})"{ws}(?:(?P<close>\\}})|,{ws}"arguments"{ws}:{ws}\\{{)')


def _closing_tag_prefix(rest: str) -> tuple[bool, bool]:
    """(viable, complete) for the text after the call's JSON object: whitespace, then a prefix of the
    closing tag, then (once the tag is whole) whitespace only."""
    t = rest.lstrip(_WS)
    if len(t) < len(TOOL_CALL_CLOSE):
        return TOOL_CALL_CLOSE.startswith(t), False
    ok = t.startswith(TOOL_CALL_CLOSE) and not t[len(TOOL_CALL_CLOSE):].strip(_WS)
    return ok, ok


class ActConstraint:
    """ACT's format as a decoding constraint (module docstring). `tool_names`: the task's tools; a
    call may name only these. Raises ValueError for an empty tool list (a call could name nothing,
    so only messages would remain; pass no constraint instead)."""

    def __init__(self, tokenizer, tool_names: list[str]):
        if not tool_names:
            raise ValueError("ActConstraint needs at least one tool name")
        self.tokens = _Tokens(tokenizer)
        self._head = _head(list(tool_names))

    def state(self, text: str) -> tuple[bool, bool]:
        """(viable, may end): whether some continuation of `text` is in ACT's format, and whether
        `text` itself is a whole output of it."""
        s = text.lstrip()
        if not s.startswith(TOOL_CALL_OPEN):
            if TOOL_CALL_OPEN.startswith(s):  # "", "<", "<tool", ...: a call's start or a message's
                return True, bool(s) and _message(s, final=True)
            return _message(s, final=False), _message(s, final=True)
        return self._call(s[len(TOOL_CALL_OPEN):])

    def _call(self, body: str) -> tuple[bool, bool]:
        m = self._head.match(body, partial=True)
        if m is None:
            return False, False
        if m.partial:
            return True, False
        if m.group("close") is not None:
            return _closing_tag_prefix(body[m.end():])
        ok, end = value_end(body, m.end() - 1, depth=1)  # the arguments object, one level inside the call
        if not ok or not _tags_ok(body if end is None else body[:end], final=end is not None):
            return False, False  # a tag inside a string would end the call early for parse_act
        if end is None:
            return True, False
        rest = body[end:].lstrip(_WS)
        if not rest:
            return True, False
        if rest[0] != "}":  # a key after "arguments": parse_act allows only "name" and "arguments"
            return False, False
        return _closing_tag_prefix(rest[1:])

    def allows(self, token_ids: list[int], ends: bool) -> bool:
        """May the output be `token_ids` (ending there when `ends`)? See the module docstring."""
        text = self.tokens.text(token_ids, ends)
        if text is None:
            return False
        ok, complete = self.state(text)
        return complete if ends else ok


class RehearseConstraint:
    """REHEARSE's format as a decoding constraint (module docstring): one JSON value, fenced or not,
    or a JSON head cut by the truncation marker."""

    def __init__(self, tokenizer):
        self.tokens = _Tokens(tokenizer)

    def allows(self, token_ids: list[int], ends: bool) -> bool:
        """May the output be `token_ids` (ending there when `ends`)? See the module docstring."""
        text = self.tokens.text(token_ids, ends)
        if text is None:
            return False
        if not ends:
            return viable(text)
        try:
            parse_rehearse(text)
        except ParseError:
            return False
        return True
