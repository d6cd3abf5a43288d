"""The ACT role (METHOD.md §1): history → prompt messages/ids, and the strict parser of its output (a tool call or a message)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS, bound_history
from envace_core.roles.chat import chat_ids, render_history
from envace_core.roles.errors import (
    EmptyOutput,
    ForeignToolCallFormat,
    InvalidArguments,
    MalformedToolCall,
    MultipleToolCalls,
    ParseError,
    TextOutsideToolCall,
    UnknownTool,
)
from envace_core.roles.foreign import ForeignCall, describe, find_foreign_call
from envace_core.roles.strict_json import decode_json
from envace_core.roles.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    check_arguments_shape,
    compact_openai_schema,
    render_tool,
    template_supports_tools,
    validate_arguments,
)
from envace_core.types import Message, TaskContext, ToolCall, ToolSpec

CALL_FORMAT = (
    "To call a tool, reply with only this, nothing before or after it:\n"
    '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
    "Arguments are required unless marked optional. Make at most one tool call per reply; "
    "the tool's result comes in the next message. "
    "Otherwise reply with plain text to the user."
)


def _act_system(ctx: TaskContext, memory: str | None, native_tools: bool) -> str:
    parts = [f"You are a customer service agent in the {ctx.domain} domain. Follow the policy.",
             f"# Policy\n{ctx.policy.strip()}"]
    if not native_tools:
        tools = "\n".join(render_tool(t) for t in ctx.tools)
        parts.append(f"# Tools\n{tools}\n\n{CALL_FORMAT}")
    if memory and memory.strip():
        parts.append(f"# Notes from rehearsal\n{memory.strip()}")
    return "\n\n".join(parts)


def with_first_user(ctx: TaskContext, history: list[Message]) -> list[Message]:
    return history if history else [Message(role="user", content=ctx.first_user_message)]


def act_messages(ctx: TaskContext, history: list[Message], memory: str | None = None,
                 native_tools: bool = False) -> list[dict]:
    """ACT's chat messages (METHOD.md §1): a system message, then `render_history(history)`.

    The system message holds the domain policy (`ctx.policy`), the tools rendered compactly with the
    exact `<tool_call>` form (unless `native_tools`: then the chat template renders the tools) and the
    rehearsal memory `memory` (METHOD.md §4, Committed Execution) when given. `history` starts with the
    user's first message; an empty history is replaced by `ctx.first_user_message`.
    """
    return [{"role": "system", "content": _act_system(ctx, memory, native_tools)},
            *render_history(with_first_user(ctx, history))]


def act_prompt_ids(tokenizer, ctx: TaskContext, history: list[Message], memory: str | None = None,
                   max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS) -> list[int]:
    """Token ids of the ACT prompt (`act_messages`), ending with the assistant generation prompt.

    Every tool result of `history` is cut to `max_observation_tokens` tokens with a visible marker
    (`roles.bounds.bound_text`; None = uncut). Uses the template's native tool rendering when
    `template_supports_tools(tokenizer)`.
    """
    native = template_supports_tools(tokenizer)
    tools = [compact_openai_schema(t) for t in ctx.tools] if native else None
    history = bound_history(history, tokenizer, max_observation_tokens)
    return chat_ids(tokenizer, act_messages(ctx, history, memory, native_tools=native), tools)


# ----------------------------------------------------------------------------------------- parsing
@dataclass
class ActOutput:
    """ACT's parsed output: exactly one of `tool_call` / `message` is set (message is "" for a call).

    `schema_error`: only with ``parse_act(..., schema_errors=True)``: the `UnknownTool` or
    `InvalidArguments` error of a well-formed call (`tool_call` is then that call, its arguments an
    object but not checked against a schema), which the environment answers with an error observation
    instead of ending the turn.
    """

    tool_call: ToolCall | None
    message: str
    schema_error: ParseError | None = None


_TAG = re.compile(r"</?tool_call\b[^>]*>?")


def _foreign_output(call: ForeignCall, text: str, tools: list[ToolSpec], strict: bool, lenient: bool,
                    schema_errors: bool = False) -> ActOutput:
    """A foreign-format call: `ForeignToolCallFormat`, or (lenient) the one call it holds, checked as ours."""
    if not lenient or not call.calls:
        what = "recognised but not decodable" if lenient else "write it as " + TOOL_CALL_OPEN + \
            '{"name": .., "arguments": {..}}' + TOOL_CALL_CLOSE
        raise ForeignToolCallFormat(f"tool call in another format: {describe(call)}; {what}", text, call.format)
    if len(call.calls) > 1:
        raise MultipleToolCalls(f"{len(call.calls)} tool calls in one turn ({call.format}); make exactly one", text)
    if strict and call.outside:
        raise TextOutsideToolCall(f"text outside the tool call: {call.outside[:80]!r}", text)
    return _checked_call(*call.calls[0], text, tools, schema_errors)


def _foreign_in_tags(body: str, names: list[str]) -> ForeignCall | None:
    """A foreign call inside our tags; a bare JSON call there is our own format gone wrong, not foreign."""
    foreign = find_foreign_call(body, names)
    return None if foreign is None or foreign.format == "json_call" else foreign


def _checked_call(name: Any, arguments: Any, text: str, tools: list[ToolSpec], schema_errors: bool = False) -> ActOutput:
    """The call `name(arguments)` checked in this order: a "name" string (else `MalformedToolCall`), arguments
    a JSON object at most `MAX_JSON_DEPTH` deep (else `InvalidArguments`, whatever the name, even with
    `schema_errors`), then the name among `tools` (`UnknownTool`) and the arguments valid under its schema
    (`InvalidArguments`): these two are returned as `ActOutput.schema_error` when `schema_errors`."""
    if not isinstance(name, str) or not name:
        raise MalformedToolCall('tool call has no "name" string', text)
    check_arguments_shape(arguments, name, text)
    spec = next((t for t in tools if t.name == name), None)
    try:
        if spec is None:
            raise UnknownTool(f"unknown tool {name!r}; tools: {sorted(t.name for t in tools)}", text)
        validate_arguments(arguments, spec, text)
    except (UnknownTool, InvalidArguments) as e:
        if not schema_errors:
            raise
        return ActOutput(tool_call=ToolCall(name=name, arguments=arguments), message="", schema_error=e)
    return ActOutput(tool_call=ToolCall(name=name, arguments=arguments), message="")


def parse_act(text: str, tools: list[ToolSpec], strict: bool = True, lenient: bool = False,
              schema_errors: bool = False) -> ActOutput:
    """Parse one ACT output (format: METHOD.md §1, module docstring).

    It must hold exactly one `<tool_call>{"name": .., "arguments": {..}}</tool_call>` whose name is one of
    `tools` and whose arguments validate against that tool's schema; with `strict`, only whitespace may
    surround it (without `strict`, text outside is ignored). An omitted "arguments" means `{}`. Text with
    no tool call in any format is a message to the user (stripped).

    A call in another model family's format (`roles.foreign.FOREIGN_FORMATS`: Llama's `<|python_tag|>`,
    Mistral's `[TOOL_CALLS]`, `<function=f>`, Python call syntax of a known tool, a bare JSON call, ...;
    also inside our tags) is never a message: it raises `ForeignToolCallFormat` naming the format, unless
    `lenient` (off by default; an explicit choice, e.g. to evaluate a model prompted in its own format),
    where a decodable one is taken as the call and checked like ours (`strict` then applies to the text
    around it).

    The JSON inside the tags is read by `roles.strict_json.decode_json`: NaN/Infinity, trailing text and
    nesting deeper than `strict_json.MAX_JSON_DEPTH` (128) arrays/objects are bad JSON, checked on the
    text before decoding, so no nesting depth can raise RecursionError here. A key repeated in one
    object is refused (RFC 8259 §4: names SHOULD be unique; `json.loads` would silently keep the last).

    Raises (all `ParseError`): `EmptyOutput` (empty/whitespace); `MalformedToolCall` (unclosed, stray
    or misspelt tag, bad or too deeply nested JSON, not an object, a repeated top-level key, "name"
    missing or not a string, keys other than "name"/"arguments"), or its subclass
    `ForeignToolCallFormat`; `MultipleToolCalls`; `TextOutsideToolCall` (strict only); `UnknownTool`;
    `InvalidArguments` (arguments not a JSON object, e.g. a list or null; a key repeated inside the
    arguments, named in the message; arguments of a lenient foreign call nested deeper than
    `MAX_JSON_DEPTH`; arguments that fail the tool's schema).

    `schema_errors` (off by default): a well-formed call whose name is unknown or whose argument
    object fails the tool's schema is returned with `ActOutput.schema_error` set instead of raising
    `UnknownTool` / `InvalidArguments` — tau2-bench's environment answers such a call with an
    ``"Error: ..."`` tool message and the conversation goes on (``Environment.get_response``), so it is
    a tool error, not a format error. A call is well-formed only when its arguments are one JSON
    object (tau2's ``ToolCall.arguments`` is a ``dict`` field; tau2 could not even represent the call
    otherwise) without repeated keys: arguments that are not an object, or repeat a key, raise
    `InvalidArguments` whatever the tool name — an unknown name is only reported for a well-formed
    call.
    """
    if not isinstance(text, str) or not text.strip():
        raise EmptyOutput("empty output", text if isinstance(text, str) else "")
    names = [t.name for t in tools]
    if not _TAG.search(text):
        foreign = find_foreign_call(text, names)
        if foreign is not None:
            return _foreign_output(foreign, text, tools, strict, lenient, schema_errors)
        if "<tool_call" in text or TOOL_CALL_CLOSE in text:
            raise MalformedToolCall(f"malformed tag: expected {TOOL_CALL_OPEN} ... {TOOL_CALL_CLOSE}", text)
        return ActOutput(tool_call=None, message=text.strip())

    # Tags must be exactly <tool_call> / </tool_call>, alternating open/close, starting with an open.
    bodies: list[str] = []
    outside: list[str] = []
    pos, open_at = 0, None
    for m in _TAG.finditer(text):
        tag = m.group(0)
        if tag not in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
            raise MalformedToolCall(f"malformed tag {tag!r}: expected {TOOL_CALL_OPEN} ... {TOOL_CALL_CLOSE}", text)
        if tag == TOOL_CALL_OPEN:
            if open_at is not None:
                raise MalformedToolCall(f"{TOOL_CALL_OPEN} opened again before {TOOL_CALL_CLOSE}", text)
            outside.append(text[pos:m.start()])
            open_at = m.end()
        else:
            if open_at is None:
                raise MalformedToolCall(f"{TOOL_CALL_CLOSE} without an opening {TOOL_CALL_OPEN}", text)
            bodies.append(text[open_at:m.start()])
            open_at, pos = None, m.end()
    if open_at is not None:
        raise MalformedToolCall(f"unclosed {TOOL_CALL_OPEN}: no {TOOL_CALL_CLOSE}", text)
    outside.append(text[pos:])
    if len(bodies) > 1:
        raise MultipleToolCalls(f"{len(bodies)} tool calls in one turn; make exactly one", text)
    if strict and any(s.strip() for s in outside):
        snippet = " ".join(s.strip() for s in outside if s.strip())[:80]
        raise TextOutsideToolCall(f"text outside the tool call: {snippet!r}", text)

    body = bodies[0].strip()
    try:
        obj, dup = decode_json(body)  # at most MAX_JSON_DEPTH deep, checked before decoding
    except ValueError as e:
        foreign = _foreign_in_tags(body, names)  # e.g. Qwen3-Coder's <function=f> or GLM's <arg_key> in our tags
        if foreign is not None:
            return _foreign_output(foreign, text, tools, False, lenient, schema_errors)
        raise MalformedToolCall(f"tool call is not valid JSON: {e}", text) from None
    if not isinstance(obj, dict):
        raise MalformedToolCall(f"tool call must be a JSON object, got {type(obj).__name__}", text)
    if dup is not None and not dup.path:
        raise MalformedToolCall(f"tool call JSON has a {dup}; give each key once", text)
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        foreign = _foreign_in_tags(body, names)  # e.g. {"name": .., "parameters": ..} (Llama's keys)
        if foreign is not None:
            return _foreign_output(foreign, text, tools, False, lenient, schema_errors)
        if not isinstance(obj.get("name"), str) or not obj.get("name"):
            raise MalformedToolCall('tool call has no "name" string', text)
        raise MalformedToolCall(f'tool call has keys {extra}; only "name" and "arguments" are allowed', text)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall('tool call has no "name" string', text)
    if dup is not None:  # below the top level with only "name" (a string) and "arguments": in the arguments
        where = "/".join(map(str, dup.path))
        raise InvalidArguments(f"arguments of {name} hold the key {json.dumps(dup.key, ensure_ascii=False)} twice "
                               f"(in {where}); give each key once", text)
    return _checked_call(name, obj.get("arguments", {}), text, tools, schema_errors)
