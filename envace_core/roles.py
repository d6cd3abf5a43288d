"""Prompt rendering and strict parsing for the roles of the one shared policy (METHOD.md §1, §4).

Formats (METHOD.md §1):
  - ACT emits either ONE tool call, exactly
        <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>
    or a plain message to the user (any text without a `<tool_call` tag).
  - REHEARSE emits ONLY the JSON value the tool would return; a tool error is {"error": "<message>"}.
  - USER (USER-REHEARSE) emits the user's next message as plain text; it may end the conversation with
    one of tau2's stop tokens (`###STOP###`, `###TRANSFER###`, `###OUT-OF-SCOPE###`) at its end.

Tools reach the prompt in one of two ways. If the tokenizer's chat template supports tools natively
(Qwen-style: the template text mentions `tools`), the (compacted) OpenAI schemas go to
`apply_chat_template(tools=...)` and the template writes its own `<tool_call>` instructions. Otherwise
(SmolLM2: plain ChatML) each tool is rendered into the system message as short text (`render_tool`:
one line per argument with its type, enum, optional-ness and description, from `compact_schema`, which
drops JSON-schema `title`s, inlines `$ref`s and removes catch-all `anyOf` branches), followed by the
exact `<tool_call>` form.

Why not transformers' `tokenizer.parse_response` / `transformers.utils.chat_parsing`: it needs a
`response_template` that SmolLM2's tokenizer does not have; it is lenient where we must be strict
(it coerces argument strings to the schema's types, e.g. "7" -> 7, and does not reject prose around
the call or a second call), and it reports failures as bare `ValueError`s. We need every failure as a
typed error (they end a trajectory and are logged per class), so the parser below is our own, small,
and validates arguments with `jsonschema`.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from envace_core import EnvaceError
from envace_core.types import Message, Observation, TaskContext, ToolCall, ToolSpec

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


# --------------------------------------------------------------------------------------------- errors
class ParseError(EnvaceError):
    """A model output that does not follow its role's format (METHOD.md §1). `.raw` holds the text."""

    def __init__(self, message: str, raw: str = ""):
        super().__init__(message)
        self.raw = raw


class EmptyOutput(ParseError):
    """The output is empty or whitespace only."""


class MalformedToolCall(ParseError):
    """Bad JSON inside the tags, an unclosed or stray tag, JSON that is not an object, no "name"."""


class UnknownTool(ParseError):
    """The called name is not among the task's tools."""


class InvalidArguments(ParseError):
    """`arguments` is not an object, or does not validate against the tool's JSON schema."""


class TextOutsideToolCall(ParseError):
    """Prose before or after the `<tool_call>` tags (strict mode only)."""


class MultipleToolCalls(ParseError):
    """More than one tool call in one ACT turn (one call is executed per turn)."""


class InvalidRehearsal(ParseError):
    """A REHEARSE output that is not a single JSON value."""


class InvalidUserTurn(ParseError):
    """A USER-REHEARSE output that is not one plain user message (a tool call, text after a stop token)."""


def format_error(err: ParseError) -> str:
    """`"ClassName: message"`, for logs and `Generation.parse_error`."""
    return f"{type(err).__name__}: {err}"


# ------------------------------------------------------------------------------------ tool schemas
def _resolve_ref(ref: str, defs: dict[str, Any]) -> dict[str, Any] | None:
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix) and ref[len(prefix):] in defs:
            return defs[ref[len(prefix):]]
    return None


def _is_catch_all(s: Any) -> bool:
    """`{}` or `{"type": "object", "additionalProperties": true}` (pydantic's `dict` fallback branch)."""
    if not isinstance(s, dict):
        return False
    rest = {k: v for k, v in s.items() if k not in ("title", "description")}
    return rest in ({}, {"type": "object"}, {"type": "object", "additionalProperties": True})


def _compact(node: Any, defs: dict[str, Any], stack: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_compact(x, defs, stack) for x in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node and isinstance(node["$ref"], str):
        target = _resolve_ref(node["$ref"], defs)
        if target is not None and node["$ref"] not in stack:  # inline; a recursive ref stays a $ref
            merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
            return _compact(merged, defs, stack + (node["$ref"],))
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs", "definitions"):
            continue
        if key == "additionalProperties" and value is True:
            continue  # the default
        if key == "properties" and isinstance(value, dict):  # property names are data, not keywords
            out[key] = {name: _compact(sub, defs, stack) for name, sub in value.items()}
            continue
        if key in ("anyOf", "oneOf") and isinstance(value, list):
            branches = [b for b in value if not _is_catch_all(b)] or value
            branches = [_compact(b, defs, stack) for b in branches]
            if len(branches) == 1 and isinstance(branches[0], dict):
                for k, v in branches[0].items():  # collapse a single branch into the parent
                    out.setdefault(k, v)
            else:
                out[key] = branches
            continue
        out[key] = _compact(value, defs, stack)
    return out


def compact_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """A smaller, display-only copy of a JSON schema (validation always uses the original).

    Drops `title` keys and `additionalProperties: true`; inlines `$ref`s into `$defs` (recursive ones
    stay as `$ref` with their `$defs` kept); removes catch-all `anyOf` branches (`{}` or a free object,
    pydantic's fallback) and collapses a single remaining branch. Keeps types, enums, descriptions,
    defaults and `required`.
    """
    defs = dict(parameters.get("$defs") or {}) | dict(parameters.get("definitions") or {})
    out = _compact(copy.deepcopy(parameters), defs, ())
    if "$ref" in json.dumps(out):  # a recursive definition was left as a reference: keep its targets
        out["$defs"] = {k: _compact(v, defs, ()) for k, v in defs.items()}
    return out


_EXTRA_KEYS = ("format", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
               "minLength", "maxLength", "minItems", "maxItems", "uniqueItems", "default")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _type_str(s: Any) -> str:
    """A short type expression for a (compacted) schema node: `string`, `"a"|"b"`, `array of object`..."""
    if not isinstance(s, dict) or not s:
        return "any"
    if "enum" in s:
        return "|".join(json.dumps(e, ensure_ascii=False) for e in s["enum"])
    if "const" in s:
        return json.dumps(s["const"], ensure_ascii=False)
    if "$ref" in s:
        return str(s["$ref"]).rsplit("/", 1)[-1]
    for union in ("anyOf", "oneOf"):
        if isinstance(s.get(union), list):
            return " or ".join(_type_str(b) for b in s[union])
    t = s.get("type")
    if isinstance(t, list):
        return "|".join(map(str, t))
    if t == "array" or (t is None and "items" in s):
        items = s.get("items")
        return f"array of {_type_str(items)}" if isinstance(items, dict) and items else "array"
    if (t == "object" or t is None) and isinstance(s.get("additionalProperties"), dict) \
            and not s.get("properties"):
        return f"object of {_type_str(s['additionalProperties'])}"
    return str(t) if t else "any"


def _param_lines(s: dict[str, Any], indent: str, out: list[str]) -> None:
    props = s.get("properties")
    if not isinstance(props, dict):
        return
    required = set(s.get("required") or [])
    for name, p in props.items():
        p = p if isinstance(p, dict) else {}
        notes = [_type_str(p)]
        if name not in required:
            notes.append("optional")
        notes += [f"{k}={json.dumps(p[k], ensure_ascii=False)}" for k in _EXTRA_KEYS if k in p]
        line = f"{indent}{name} ({', '.join(notes)})"
        if p.get("description"):
            line += f": {_one_line(p['description'])}"
        out.append(line)
        sub = p.get("items") if isinstance(p.get("items"), dict) else p
        if isinstance(sub.get("properties"), dict) and sub["properties"]:
            _param_lines(sub, indent + "  ", out)


def render_tool(tool: ToolSpec) -> str:
    """A tool as compact text: `name: description`, then one line per argument (nested ones indented).

    Argument lines read `name (type[, optional][, default=..]): description`, built from
    `compact_schema(tool.parameters)`: names, types, enums (`"a"|"b"`), required-ness, descriptions and
    simple constraints are kept. This is about 40% of the tokens of the compacted JSON schema
    (airline's 14 tools: ~1.36k vs ~2.2k SmolLM2 tokens). Validation always uses the full schema.
    """
    s = compact_schema(tool.parameters or {})
    head = tool.name + (f": {_one_line(tool.description)}" if tool.description.strip() else "")
    out = [head]
    _param_lines(s, "  ", out)
    if "$defs" in s:  # recursive definitions could not be inlined: show them as JSON
        out.append("  definitions: " + json.dumps(s["$defs"], ensure_ascii=False, separators=(",", ":")))
    return "\n".join(out)


def compact_openai_schema(tool: ToolSpec) -> dict[str, Any]:
    """`tool.openai_schema()` with its parameters compacted (for native templates' `tools=`)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": compact_schema(tool.parameters or {})}}


def template_supports_tools(tokenizer) -> bool:
    """True when the tokenizer's chat template renders a `tools` list itself (Qwen-style)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = " ".join(str(v) for v in tpl.values())
    return isinstance(tpl, str) and re.search(r"\btools\b", tpl) is not None


# --------------------------------------------------------------------------------------- rendering
def format_tool_call(call: ToolCall) -> str:
    """The exact text ACT emits for `call` (METHOD.md §1): `<tool_call>{"name":..,"arguments":..}</tool_call>`."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def render_history(history: list[Message]) -> list[dict]:
    """Chat dicts (`role`, `content`) for `history`, in order.

    An assistant message with a `tool_call` becomes the `<tool_call>` text of `format_tool_call`
    (preceded by its `content` on its own line if that is not empty); tool results keep role "tool"
    and their JSON content unchanged. Message `error` flags are not rendered: the content says it.
    """
    out = []
    for m in history:
        content = m.content
        if m.role == "assistant" and m.tool_call is not None:
            call = format_tool_call(m.tool_call)
            content = f"{content.strip()}\n{call}" if content.strip() else call
        out.append({"role": m.role, "content": content})
    return out


_CALL_FORMAT = (
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
        parts.append(f"# Tools\n{tools}\n\n{_CALL_FORMAT}")
    if memory and memory.strip():
        parts.append(f"# Notes from rehearsal\n{memory.strip()}")
    return "\n\n".join(parts)


def _with_first_user(ctx: TaskContext, history: list[Message]) -> list[Message]:
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
            *render_history(_with_first_user(ctx, history))]


def _ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    kw = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False, **kw)
    return [int(i) for i in ids]


def act_prompt_ids(tokenizer, ctx: TaskContext, history: list[Message], memory: str | None = None) -> list[int]:
    """Token ids of the ACT prompt (`act_messages`), ending with the assistant generation prompt.

    Uses the template's native tool rendering when `template_supports_tools(tokenizer)`.
    """
    native = template_supports_tools(tokenizer)
    tools = [compact_openai_schema(t) for t in ctx.tools] if native else None
    return _ids(tokenizer, act_messages(ctx, history, memory, native_tools=native), tools)


def _transcript(history: list[Message]) -> str:
    lines = []
    for m in history:
        if m.role == "system":
            continue
        if m.role == "assistant" and m.tool_call is not None:
            text = json.dumps({"name": m.tool_call.name, "arguments": m.tool_call.arguments}, ensure_ascii=False)
            lines.append(f"agent called: {text}")
        elif m.role == "assistant":
            lines.append(f"agent: {m.content.strip()}")
        elif m.role == "tool":
            lines.append(f"tool returned: {m.content.strip()}")
        else:
            lines.append(f"user: {m.content.strip()}")
    return "\n".join(lines)


def rehearse_messages(ctx: TaskContext, history: list[Message], call: ToolCall,
                      examples: Sequence[tuple[ToolCall, Observation]] = ()) -> list[dict]:
    """REHEARSE's chat messages (METHOD.md §1): the policy plays the environment.

    Shows only `ctx.policy`, the called tool's schema (or a note that no such tool exists), the
    conversation `history` as a transcript, optional grounding `examples` (real (call, result) pairs
    from *other* tasks) and `call`. Nothing else of the task reaches it (TaskContext holds no gold).
    A trailing assistant message in `history` that is this very call is not repeated.
    """
    if history and history[-1].role == "assistant" and history[-1].tool_call is not None \
            and history[-1].tool_call.name == call.name and history[-1].tool_call.arguments == call.arguments:
        history = history[:-1]
    spec = next((t for t in ctx.tools if t.name == call.name), None)
    tool = render_tool(spec) if spec is not None else (
        f"No tool named {json.dumps(call.name)} exists in this environment: the call fails.")
    system = (
        f"You simulate the {ctx.domain} environment's tools. Given the documentation, the conversation "
        "and a tool call, reply with ONLY the JSON value the tool returns, consistent with earlier results. "
        'If the call fails (not found, invalid arguments, against the rules), reply {"error": "<message>"}.'
        f"\n\n# Documentation\n{ctx.policy.strip()}\n\n# Tool\n{tool}"
    )
    parts = []
    if examples:
        ex = "\n".join(f"call: {json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}\n"
                       f"result: {o.content.strip()}" for c, o in examples)
        parts.append(f"# Examples from other conversations\n{ex}")
    transcript = _transcript(_with_first_user(ctx, history))
    call_text = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    parts.append(f"# Conversation\n{transcript}\n\n# Call\n{call_text}\n\nReply with the tool's JSON output only.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def rehearse_prompt_ids(tokenizer, ctx: TaskContext, history: list[Message], call: ToolCall,
                        examples: Sequence[tuple[ToolCall, Observation]] = ()) -> list[int]:
    """Token ids of the REHEARSE prompt (`rehearse_messages`), ending with the generation prompt.

    `examples` (optional, METHOD.md §1 "grounding examples") must come from other tasks and be
    budgeted by the caller.
    """
    return _ids(tokenizer, rehearse_messages(ctx, history, call, examples))


# ---------------------------------------------------------------------------------- USER-REHEARSE
# tau2's own user-simulator constants (tau2.user.base / tau2.orchestrator.orchestrator); copied so that
# importing roles does not import tau2, and checked against tau2 in tests/test_roles.py.
USER_STOP_TOKENS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")
AGENT_GREETING = "Hi! How can I help you today?"


def user_instructions(user_scenario: str) -> str:
    """The user's instructions as tau2's user simulator shows them: ``str(tau2 UserScenario)`` of the
    task's `user_scenario` JSON (persona, reason for call, known / unknown info, task instructions).

    Raises `EnvaceError` naming `Task.user_scenario` when it is not a tau2 user-scenario JSON.
    """
    from tau2.data_model.tasks import UserScenario

    try:
        return str(UserScenario.model_validate(json.loads(user_scenario)))
    except Exception as e:  # noqa: BLE001 - json and pydantic errors alike: not a tau2 scenario
        raise EnvaceError(f"Task.user_scenario is not a tau2 user-scenario JSON ({type(e).__name__}: "
                          f"{str(e)[:120]}); load tau2 tasks with envs.tau2.load_tasks") from None


@functools.cache
def _user_system(instructions: str) -> str:
    """tau2's user-simulator system prompt, built by tau2's own template and guidelines file."""
    from tau2.user.user_simulator import SYSTEM_PROMPT, get_global_user_sim_guidelines

    return SYSTEM_PROMPT.format(global_user_sim_guidelines=get_global_user_sim_guidelines(use_tools=False),
                                instructions=instructions)


def user_messages(instructions: str, history: list[Message]) -> list[dict]:
    """USER-REHEARSE's chat messages (METHOD.md §1, multi-agent rehearsal): the policy plays the user.

    The same prompt tau2's `UserSimulator` builds, so a policy trained in this role can serve as the
    evaluation user simulator (`evaluation.tau2.EnvaceUserSimulator`): a system message with tau2's
    global simulation guidelines (no-tools variant) and ``<scenario>{instructions}</scenario>``
    (`instructions` from `user_instructions`), then the conversation with roles flipped as in tau2's
    ``UserState.flip_roles``: tau2's agent greeting and the agent's text messages become "user"
    messages, the user's own messages "assistant" ones. The agent's tool calls and tool results are
    not shown: a real user does not see them.
    """
    out = [{"role": "system", "content": _user_system(instructions)},
           {"role": "user", "content": AGENT_GREETING}]
    for m in history:
        if m.role == "user":
            out.append({"role": "assistant", "content": m.content})
        elif m.role == "assistant" and m.tool_call is None:
            out.append({"role": "user", "content": m.content})
    return out


def user_prompt_ids(tokenizer, instructions: str, history: list[Message]) -> list[int]:
    """Token ids of the USER-REHEARSE prompt (`user_messages`), ending with the generation prompt."""
    return _ids(tokenizer, user_messages(instructions, history))


# ----------------------------------------------------------------------------------------- parsing
@dataclass
class ActOutput:
    """ACT's parsed output: exactly one of `tool_call` / `message` is set (message is "" for a call)."""

    tool_call: ToolCall | None
    message: str


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _strict_json(text: str) -> Any:
    """`json.loads` that also rejects NaN / Infinity."""
    return json.loads(text, parse_constant=_reject_constant)


_validators: dict[str, Any] = {}


def _validator(schema: dict[str, Any]):
    key = json.dumps(schema, sort_keys=True, default=str)
    v = _validators.get(key)
    if v is None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        v = _validators[key] = cls(schema)
    return v


def validate_arguments(arguments: Any, tool: ToolSpec, raw: str = "") -> None:
    """Raise `InvalidArguments` unless `arguments` is an object valid under `tool.parameters`.

    Validation uses the tool's full schema (not the compacted display copy), so a catch-all `anyOf`
    branch (pydantic's `Model | dict`) still accepts any object there.

    Beyond JSON schema: an argument name that the schema does not list is rejected when the schema
    lists `properties` and does not allow extra ones explicitly (`additionalProperties`), since the
    tool's function would fail on it.
    """
    if not isinstance(arguments, dict):
        raise InvalidArguments(f"arguments of {tool.name} must be a JSON object, got {type(arguments).__name__}",
                               raw)
    schema = tool.parameters or {}
    props = schema.get("properties")
    if isinstance(props, dict) and "additionalProperties" not in schema and "patternProperties" not in schema:
        extra = sorted(set(arguments) - set(props))
        if extra:
            raise InvalidArguments(f"{tool.name} has no argument(s) {extra}; allowed: {sorted(props)}", raw)
    try:
        error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(arguments))
    except jsonschema.exceptions.SchemaError as e:  # the tool's own schema is broken: not the model's fault
        raise EnvaceError(f"tool {tool.name} has an invalid JSON schema: {e.message}") from e
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "arguments"
        raise InvalidArguments(f"{tool.name}: {where}: {error.message}", raw)


_TAG = re.compile(r"</?tool_call\b[^>]*>?")


def parse_act(text: str, tools: list[ToolSpec], strict: bool = True) -> ActOutput:
    """Parse one ACT output (format: METHOD.md §1, module docstring).

    Text with no `<tool_call` is a message to the user (stripped). Otherwise it must hold exactly one
    `<tool_call>{"name": .., "arguments": {..}}</tool_call>` whose name is one of `tools` and whose
    arguments validate against that tool's schema; with `strict`, only whitespace may surround it
    (without `strict`, text outside is ignored). An omitted "arguments" means `{}`.

    Raises (all `ParseError`): `EmptyOutput` (empty/whitespace); `MalformedToolCall` (unclosed, stray
    or misspelt tag, bad JSON, not an object, "name" missing or not a string, keys other than
    "name"/"arguments"); `MultipleToolCalls`; `TextOutsideToolCall` (strict only); `UnknownTool`;
    `InvalidArguments`.
    """
    if not text or not text.strip():
        raise EmptyOutput("empty output", text or "")
    if "<tool_call" not in text and TOOL_CALL_CLOSE not in text:
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
        obj = _strict_json(body)
    except ValueError as e:
        raise MalformedToolCall(f"tool call is not valid JSON: {e}", text) from None
    if not isinstance(obj, dict):
        raise MalformedToolCall(f"tool call must be a JSON object, got {type(obj).__name__}", text)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall('tool call has no "name" string', text)
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        raise MalformedToolCall(f'tool call has keys {extra}; only "name" and "arguments" are allowed', text)
    spec = next((t for t in tools if t.name == name), None)
    if spec is None:
        raise UnknownTool(f"unknown tool {name!r}; tools: {sorted(t.name for t in tools)}", text)
    arguments = obj.get("arguments", {})
    validate_arguments(arguments, spec, text)
    return ActOutput(tool_call=ToolCall(name=name, arguments=arguments), message="")


_FENCE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n(.*?)\n?```\Z", re.DOTALL)


def parse_rehearse(text: str) -> Observation:
    """Parse one REHEARSE output (METHOD.md §1): a single JSON value, the imagined tool response.

    Surrounding whitespace and one enclosing ``` / ```json fence are accepted; nothing else.
    An object with a truthy "error" key is a tool error: `Observation(error=True)`. `content` is
    `json.dumps(value, ensure_ascii=False)` of the parsed value (key order kept).

    Raises `EmptyOutput` (empty/whitespace) or `InvalidRehearsal` (anything that is not one JSON value).
    """
    if not text or not text.strip():
        raise EmptyOutput("empty rehearsal", text or "")
    body = text.strip()
    fence = _FENCE.match(body)
    if fence:
        body = fence.group(1).strip()
    try:
        value = _strict_json(body)
    except ValueError as e:
        raise InvalidRehearsal(f"not a single JSON value: {e}", text) from None
    error = isinstance(value, dict) and value.get("error") not in (None, False, "")
    return Observation(content=json.dumps(value, ensure_ascii=False), error=error)


@dataclass
class UserTurn:
    """USER-REHEARSE's parsed output: the user's message and whether it ends the conversation."""

    message: str
    stop: bool


def parse_user(text: str, strict: bool = True) -> UserTurn:
    """Parse one USER-REHEARSE output: the imagined user's next message (plain text).

    `stop` is True when the text holds one of `USER_STOP_TOKENS` (tau2's ``UserSimulator.is_stop``
    rule); with `strict`, nothing but whitespace may follow the first stop token. `message` is the
    stripped text (stop token included, as tau2 keeps it).

    Raises (all `ParseError`): `EmptyOutput`; `InvalidUserTurn` when the text holds a `<tool_call`
    tag (the rehearsed user has no tools) or, with `strict`, text after a stop token.
    """
    if not text or not text.strip():
        raise EmptyOutput("empty user turn", text or "")
    if "<tool_call" in text or TOOL_CALL_CLOSE in text:
        raise InvalidUserTurn("the rehearsed user has no tools: a user turn cannot hold a tool call", text)
    body = text.strip()
    hits = [(body.find(tok), tok) for tok in USER_STOP_TOKENS if tok in body]
    if not hits:
        return UserTurn(message=body, stop=False)
    at, tok = min(hits)
    if strict and body[at + len(tok):].strip():
        raise InvalidUserTurn(f"text after the stop token {tok}: end the message with it", text)
    return UserTurn(message=body, stop=True)


# ------------------------------------------------------------------------------------------ memory
def memory_text(rehearsals: list[str], max_tokens: int, tokenizer) -> str:
    """Rehearsal memory m_x (METHOD.md §4): rehearsal summaries joined under `max_tokens` tokens.

    Rule: summaries are taken newest first (the last in `rehearsals` first: a later sequential
    rehearsal has seen the earlier ones), each under a header `[rehearsal k]` (k = its 1-based position
    in `rehearsals`). Lines are added in order while the running text fits the budget; the first line
    that does not fit ends the memory (truncation at whole lines, never mid-line). Blank lines and lines
    already included from a newer summary are skipped; a header whose summary contributes no line is
    dropped. The budget counts `tokenizer.encode(text, add_special_tokens=False)` of the whole result.
    """
    if max_tokens <= 0:
        return ""

    def n_tokens(s: str) -> int:
        return len(tokenizer.encode(s, add_special_tokens=False))

    kept: list[str] = []
    seen: set[str] = set()
    full = False
    for k in range(len(rehearsals) - 1, -1, -1):
        lines = [ln.rstrip() for ln in (rehearsals[k] or "").splitlines()]
        lines = [ln for ln in lines if ln.strip() and ln.strip() not in seen]
        if not lines:
            continue
        header = f"[rehearsal {k + 1}]"
        block: list[str] = []
        for ln in lines:
            candidate = kept + [header] + block + [ln]
            if n_tokens("\n".join(candidate)) > max_tokens:
                full = True
                break
            block.append(ln)
            seen.add(ln.strip())
        if block:
            kept += [header] + block
        if full:
            break
    return "\n".join(kept)


# --------------------------------------------------------------------------------------- SELF-EVAL
_SELF_EVAL_SYSTEM = (
    "You review a rehearsal: an imagined attempt by a customer service agent in the {domain} domain "
    "to serve a user, with tool responses that were imagined too. Judge it against the policy. "
    "Reply with ONLY a JSON object, nothing before or after it:\n"
    '{{"reached_goal": true or false, "blocker": "<the rule or error that stopped it, or empty>", '
    '"advice": "<what to do instead next time, one sentence>"}}'
    "\n\n# Policy\n{policy}"
)


@dataclass
class SelfEval:
    """A parsed SELF-EVAL output (METHOD.md §4, sequential rehearsal).

    `reached_goal` is None when the output did not say (no JSON object, or no usable value);
    `raw` always keeps the model's text.
    """

    reached_goal: bool | None
    blocker: str
    advice: str
    raw: str

    def as_text(self) -> str:
        """One memory line: `- self-eval: goal reached: yes|no|unknown; blocker: ..; instead: ..`.

        An output with nothing parsed becomes `- self-eval (unparsed): <raw, one line, ≤200 chars>`
        (empty string when `raw` is blank too).
        """
        if self.reached_goal is None and not self.blocker and not self.advice:
            raw = _one_line(self.raw)[:200]
            return f"- self-eval (unparsed): {raw}" if raw else ""
        goal = {True: "yes", False: "no", None: "unknown"}[self.reached_goal]
        parts = [f"goal reached: {goal}"]
        if self.blocker:
            parts.append(f"blocker: {self.blocker}")
        if self.advice:
            parts.append(f"instead: {self.advice}")
        return "- self-eval: " + "; ".join(parts)


def self_eval_messages(ctx: TaskContext, trajectory_summary: str) -> list[dict]:
    """SELF-EVAL's chat messages (METHOD.md §4): the policy grades one of its own rehearsals.

    Shows `ctx.policy`, the user's request (`ctx.first_user_message`) and `trajectory_summary`
    (e.g. `rehearsal.summarise`), and asks for `{"reached_goal", "blocker", "advice"}` as JSON.
    """
    system = _SELF_EVAL_SYSTEM.format(domain=ctx.domain, policy=ctx.policy.strip())
    user = (f"# User's request\n{ctx.first_user_message.strip()}\n\n"
            f"# Rehearsal\n{trajectory_summary.strip()}\n\nReply with the JSON object only.")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def self_eval_prompt_ids(tokenizer, ctx: TaskContext, trajectory_summary: str) -> list[int]:
    """Token ids of the SELF-EVAL prompt (`self_eval_messages`), ending with the generation prompt."""
    return _ids(tokenizer, self_eval_messages(ctx, trajectory_summary))


_BOOL_WORDS = {"true": True, "yes": True, "false": False, "no": False}
_GOAL_RE = re.compile(r'reached[ _]goal"?\s*[:=]\s*"?(true|false|yes|no)\b', re.IGNORECASE)


def _text_field(name: str, text: str) -> str:
    """The value of `"name": "..."` in possibly truncated JSON (up to the closing quote or the end)."""
    m = re.search(rf'"{name}"\s*:\s*"((?:[^"\\]|\\.)*)', text)
    if not m:
        return ""
    try:
        return _one_line(json.loads(f'"{m.group(1)}"'))
    except ValueError:  # a dangling escape at a truncation point
        return _one_line(m.group(1))


def _first_object(text: str) -> dict | None:
    """The first complete JSON object in `text` (prose or fences around it are skipped)."""
    dec = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch == "{":
            try:
                value, _ = dec.raw_decode(text, i)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def _as_bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        return _BOOL_WORDS.get(v.strip().lower())
    return None


def parse_self_eval(text: str) -> SelfEval:
    """Parse a SELF-EVAL output leniently (METHOD.md §4); never raises.

    Order: the first complete JSON object in the text (surrounding prose/fences ignored), whose
    `reached_goal` may be a bool or "true"/"false"/"yes"/"no" and whose `blocker`/`advice` are taken
    as one-line strings; otherwise (truncated or broken JSON, prose) the fields are recovered by
    pattern where present (`"reached_goal": true`, `reached goal: no`, `"blocker": "..`). What cannot
    be recovered stays `None` / "". `raw` is `text` unchanged.
    """
    text = text if isinstance(text, str) else ""
    obj = _first_object(text)
    if obj is not None and any(k in obj for k in ("reached_goal", "blocker", "advice")):
        def field(k: str) -> str:
            v = obj.get(k)
            return "" if v is None else _one_line(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
        return SelfEval(_as_bool(obj.get("reached_goal")), field("blocker"), field("advice"), text)
    m = _GOAL_RE.search(text)
    return SelfEval(_BOOL_WORDS[m.group(1).lower()] if m else None,
                    _text_field("blocker", text), _text_field("advice", text), text)
