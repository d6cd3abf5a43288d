"""Typed parse errors of the role parsers (METHOD.md §1: parse strictly, report every failure as a typed error)."""

from __future__ import annotations

from envace_core import EnvaceError


# --------------------------------------------------------------------------------------------- errors
class ParseError(EnvaceError):
    """A model output that does not follow its role's format (METHOD.md §1). `.raw` holds the text."""

    def __init__(self, message: str, raw: str = ""):
        super().__init__(message)
        self.raw = raw


class EmptyOutput(ParseError):
    """The output is empty or whitespace only."""


class MalformedToolCall(ParseError):
    """Bad JSON inside the tags (also nesting deeper than `roles.strict_json.MAX_JSON_DEPTH`, or a key
    repeated in the call object itself), an unclosed or stray tag, JSON that is not an object, no "name"."""


class ForeignToolCallFormat(MalformedToolCall):
    """A tool call written in another model family's tool format instead of ours (`<tool_call>{..}</tool_call>`).

    A `MalformedToolCall` (a handler of malformed calls sees these too). `.format` names the recognised format (one of `roles.foreign.FOREIGN_FORMATS`, e.g. `llama3_json`,
    `mistral`, `pythonic`); raised by the strict parsers, which never read such text as a message.
    """

    def __init__(self, message: str, raw: str = "", format: str = ""):
        super().__init__(message, raw)
        self.format = format


class UnknownTool(ParseError):
    """The called name is not among the task's tools."""


class InvalidArguments(ParseError):
    """`arguments` is not a JSON object (whatever the tool name: tau2's `ToolCall.arguments` is a dict), repeats
    a key, is nested deeper than `roles.strict_json.MAX_JSON_DEPTH`, or does not validate against the tool's
    JSON schema. Only the last is a tool error under ``parse_act(..., schema_errors=True)``."""


class TextOutsideToolCall(ParseError):
    """Prose before or after the `<tool_call>` tags (strict mode only)."""


class MultipleToolCalls(ParseError):
    """More than one tool call in one ACT turn (one call is executed per turn)."""


class InvalidRehearsal(ParseError):
    """A REHEARSE output that is not a single JSON value (`roles.strict_json`: also a repeated key or nesting
    deeper than `MAX_JSON_DEPTH`)."""


class InvalidUserTurn(ParseError):
    """A USER-REHEARSE output that is not one plain user message (a tool call, text after a stop token)."""


def format_error(err: ParseError) -> str:
    """`"ClassName: message"`, for logs and `Generation.parse_error`."""
    return f"{type(err).__name__}: {err}"
