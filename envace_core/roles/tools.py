"""Tool schemas for prompts: compacting JSON schemas, rendering them as text, the `<tool_call>` format and argument validation (METHOD.md §1)."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema

from envace_core import EnvaceError
from envace_core.roles.errors import InvalidArguments
from envace_core.roles.strict_json import MAX_JSON_DEPTH, value_depth
from envace_core.types import ToolCall, ToolSpec

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


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


def one_line(text: Any) -> str:
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
            line += f": {one_line(p['description'])}"
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
    head = tool.name + (f": {one_line(tool.description)}" if tool.description.strip() else "")
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


_validators: dict[str, Any] = {}


def _validator(schema: dict[str, Any]):
    key = json.dumps(schema, sort_keys=True, default=str)
    v = _validators.get(key)
    if v is None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        v = _validators[key] = cls(schema)
    return v


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type: object, array, string, number, boolean or null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for t, name in ((dict, "object"), (list, "array"), (str, "string"), ((int, float), "number")):
        if isinstance(value, t):
            return name
    return type(value).__name__


def check_arguments_shape(arguments: Any, tool_name: str, raw: str = "") -> None:
    """Raise `InvalidArguments` unless `arguments` is a JSON object (a dict: tau2's
    `ToolCall.arguments` is a ``dict`` field) nested at most `strict_json.MAX_JSON_DEPTH` deep. Needs no
    tool schema, so it applies to a call of any name, known or not."""
    if not isinstance(arguments, dict):
        raise InvalidArguments(f"arguments of {tool_name} must be a JSON object, got {json_type(arguments)}", raw)
    depth = value_depth(arguments)
    if depth > MAX_JSON_DEPTH:
        raise InvalidArguments(f"arguments of {tool_name} are nested too deeply: {depth} levels of "
                               f"arrays/objects, at most {MAX_JSON_DEPTH}", raw)


def validate_arguments(arguments: Any, tool: ToolSpec, raw: str = "") -> None:
    """Raise `InvalidArguments` unless `arguments` is an object valid under `tool.parameters`.

    Validation uses the tool's full schema (not the compacted display copy), so a catch-all `anyOf`
    branch (pydantic's `Model | dict`) still accepts any object there.

    Beyond JSON schema: an argument name that the schema does not list is rejected when the schema
    lists `properties` and does not allow extra ones explicitly (`additionalProperties`), since the
    tool's function would fail on it.

    Also `InvalidArguments`: not an object or nested deeper than `strict_json.MAX_JSON_DEPTH`
    (`check_arguments_shape`), or too deep for a recursive schema's validation to finish within the
    interpreter's recursion limit (jsonschema validates recursively). Raises `EnvaceError` (not a
    parse error) when the tool's own schema is invalid.
    """
    check_arguments_shape(arguments, tool.name, raw)
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
    except RecursionError:  # a recursive schema ($ref to itself) followed down deeply nested arguments
        raise InvalidArguments(f"arguments of {tool.name} are nested too deeply to validate against its "
                               "schema", raw) from None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "arguments"
        raise InvalidArguments(f"{tool.name}: {where}: {error.message}", raw)
