"""Tool learning (METHOD.md §5): teach a registered policy new tools by rehearsal.

Input: JSON schemas of one or more new tools in OpenAI function format, with their documentation,
optionally a handful of real (call, result) examples and an executable implementation for scoring.
From them a task builder makes rehearsal training tasks that need the new tools, a short role-wise
GRPO run adapts a registered model on those tasks without any real call to the new tools (the
rewards are gold-action matches; no private replay), and the effect is measured on held-out tasks:
real-environment success and REHEARSE fidelity for the new tools, before vs after.

This module's parts:
  - inputs: `load_tools` (-> `NewTool`) and `load_examples` (-> `ToolExample`); bad input raises
    `ToolSchemaError` naming the file and the exact field, e.g.
    ``tools.json: tools[1].function.parameters.properties.amount.type: 'money' is not valid under
    any of the given schemas``. Schemas are checked with the `jsonschema` library: the tool object's
    shape, then ``parameters`` against the JSON Schema Draft 2020-12 metaschema; example arguments
    are validated against their tool's ``parameters``.
  - task builder, adaptation run, measurement: `build_adaptation_tasks`, `adapt`, `measure`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envace_core import EnvaceError
from envace_core.types import ToolCall, ToolSpec

if TYPE_CHECKING:
    pass


# ------------------------------------------------------------------------------------ inputs (A1)

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
IMPLEMENTATION_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"  # "package.module:function"

_PARAMETERS_SHAPE = {  # what a tool's `parameters` must be beyond a valid JSON Schema
    "type": "object",
    "required": ["type", "properties"],
    "properties": {
        "type": {"const": "object"},
        "properties": {"type": "object", "additionalProperties": {"type": "object"}},
        "required": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    },
}
_FUNCTION_FIELDS = {  # the OpenAI function object
    "name": {"type": "string", "pattern": TOOL_NAME_PATTERN},
    "description": {"type": "string", "minLength": 1, "maxLength": 4000},
    "parameters": _PARAMETERS_SHAPE,
    "strict": {"type": "boolean"},
}
_EXTRA_FIELDS = {  # envace's optional per-tool keys
    "documentation": {"type": "string", "maxLength": 16000},
    "implementation": {"type": "string", "pattern": IMPLEMENTATION_PATTERN},
}
_FUNCTION_SHAPE = {"type": "object", "required": ["name", "description", "parameters"],
                   "properties": _FUNCTION_FIELDS, "additionalProperties": False}
_WRAPPED_SHAPE = {"type": "object", "required": ["type", "function"],  # {"type": "function", "function": {...}}
                  "properties": {"type": {"const": "function"}, "function": {"type": "object"}, **_EXTRA_FIELDS},
                  "additionalProperties": False}
_BARE_SHAPE = {**_FUNCTION_SHAPE, "properties": {**_FUNCTION_FIELDS, **_EXTRA_FIELDS}}
_HINTS = {  # appended to jsonschema's message for these fields
    "name": "tool names are 1-64 letters, digits, '_' or '-'",
    "implementation": "write 'package.module:function'",
    # every ACT prompt lists the tools, and the synthesized requests quote the documentation (tau2's longest
    # tool description is 548 characters)
    "description": "a tool's description goes into every prompt: at most 4000 characters",
    "documentation": "at most 16000 characters: keep what the model needs to call the tool",
}


class ToolSchemaError(EnvaceError):
    """A new tool's schema, or an example of its use, is invalid.

    The message has one line per problem, each naming the file (or ``tools`` for in-memory input),
    the line for JSONL examples, and the exact field, e.g.
    ``tools.json: tools[0].function.parameters.required[1]: 'amount' is not in parameters.properties``.
    `errors` holds those lines.
    """

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        shown = self.errors[:20] + ([f"... and {len(self.errors) - 20} more"] if len(self.errors) > 20 else [])
        super().__init__("\n".join(shown))


@dataclass
class NewTool:
    """A tool to learn: its OpenAI-format `spec`, documentation `doc` (the file's "documentation",
    else the description) and optional `implementation` ("package.module:function", checked to import
    when the tools are loaded). For a tool no tau2 domain executes, the implementation is what scores
    held-out tasks built from its examples (`ImplementationEnvironment`); it never runs in training."""

    spec: ToolSpec
    doc: str
    implementation: str | None = None

    def load_implementation(self) -> Callable[..., Any] | None:
        """The implementation as a callable (imported now), or None when there is none.

        Raises:
            ToolSchemaError: the module or function cannot be imported, or is not callable.
        """
        if not self.implementation:
            return None
        module, _, name = self.implementation.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ToolSchemaError([(f"{self.spec.name}.implementation: cannot import "
                                    f"{self.implementation!r}: {type(e).__name__}: {e}")]) from e
        if not callable(fn):
            raise ToolSchemaError([f"{self.spec.name}.implementation: {self.implementation!r} is not callable"])
        return fn


@dataclass
class ToolExample:
    """One real use of a new tool: the `call` (name and arguments) and the tool's JSON `result`."""

    call: ToolCall
    result: Any


def _at(parts: Sequence[str | int]) -> str:
    """A field path as users write it: ``tools[1].function.parameters.properties["a b"].type``."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", p):
            out += f".{p}" if out else p
        else:
            out += f"[{json.dumps(p)}]"
    return out


def _shape_errors(obj: Any, shape: dict, where: list[str | int]) -> list[tuple[list, str]]:
    """(path, message) for each way `obj` breaks the JSON Schema `shape`: a missing field is named
    itself, an unknown field lists the allowed ones."""
    from jsonschema import Draft202012Validator

    out = []
    for e in sorted(Draft202012Validator(shape).iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path]):
        path = where + list(e.absolute_path)
        if e.validator == "required" and isinstance(e.instance, dict):
            out += [(path + [r], "required field is missing") for r in e.validator_value if r not in e.instance]
        elif e.validator == "additionalProperties" and isinstance(e.instance, dict):
            allowed = sorted(e.schema.get("properties", {}))
            out += [(path + [k], f"unknown field; allowed: {', '.join(allowed)}")
                    for k in sorted(set(e.instance) - set(allowed))]
        elif e.validator == "maxLength" and isinstance(e.instance, str):  # jsonschema quotes the whole text
            out.append((path, f"{len(e.instance)} characters, too long ({_HINTS.get(str(path[-1]), '')})"))
        else:
            hint = _HINTS.get(str(path[-1])) if e.validator == "pattern" else None
            out.append((path, e.message + (f" ({hint})" if hint else "")))
    return out


def _parameters_errors(params: dict, where: list[str | int]) -> list[tuple[list, str]]:
    """`required` names that are not properties, then the JSON Schema Draft 2020-12 metaschema."""
    from jsonschema import Draft202012Validator, SchemaError

    props = params.get("properties", {})
    out = [(where + ["required", i], f"{r!r} is not in parameters.properties ({', '.join(sorted(props)) or 'none'})")
           for i, r in enumerate(params.get("required", [])) if r not in props]
    try:
        Draft202012Validator.check_schema(params)
    except SchemaError as e:
        out.append((where + list(e.absolute_path), e.message))
    return out + _ref_errors(params, params, where)


def _ref_errors(node: Any, root: dict, where: list[str | int]) -> list[tuple[list, str]]:
    """Every ``$ref`` must point inside the schema (``#/...``, resolvable): runs are offline, so a remote
    reference could never be fetched, and a dangling one would fail only when an example is checked."""
    out: list[tuple[list, str]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                if not v.startswith("#"):
                    out.append((where + [k], f"{v!r}: only references inside the schema ('#/...') are "
                                             "allowed (runs are offline)"))
                    continue
                target: Any = root
                for part in [p.replace("~1", "/").replace("~0", "~") for p in v[1:].split("/") if p]:
                    if isinstance(target, dict) and part in target:
                        target = target[part]
                    elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                        target = target[int(part)]
                    else:
                        out.append((where + [k], f"{v!r} does not resolve inside the parameters schema"))
                        break
            else:
                out += _ref_errors(v, root, where + [k])
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _ref_errors(v, root, where + [i])
    return out


def _parse_tool(el: Any, i: int) -> tuple[NewTool | None, list[tuple[list, str]], list]:
    """(the tool or None, its errors, the path of its name) for element `i` of the tool list."""
    where: list[str | int] = ["tools", i]
    if not isinstance(el, dict):
        return None, [(where, f"expected a tool object, got {type(el).__name__}")], where
    wrapped = "function" in el or el.get("type") == "function"
    errors = _shape_errors(el, _WRAPPED_SHAPE if wrapped else _BARE_SHAPE, where)
    fn, fwhere = (el.get("function"), where + ["function"]) if wrapped else (el, where)
    if wrapped and isinstance(fn, dict):
        errors += _shape_errors(fn, _FUNCTION_SHAPE, fwhere)
    if errors:
        return None, errors, fwhere + ["name"]
    errors = _parameters_errors(fn["parameters"], fwhere + ["parameters"])
    if errors:
        return None, errors, fwhere + ["name"]
    spec = ToolSpec(name=fn["name"], description=fn["description"], parameters=fn["parameters"])
    return NewTool(spec=spec, doc=el.get("documentation") or fn["description"],
                   implementation=el.get("implementation")), [], fwhere + ["name"]


def _read_json(path: Path, label: str) -> Any:
    if not os.path.isfile(path):  # (False, not OSError, for a name over the filesystem's limit)
        what = "a folder, not a file" if os.path.isdir(path) else "no such file"
        raise ToolSchemaError([f"{label}: {what} (expected a JSON file of OpenAI-format tool schemas)"])
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ToolSchemaError([f"{label}: line {e.lineno}, column {e.colno}: not valid JSON: {e.msg}"]) from None
    except UnicodeDecodeError as e:
        raise ToolSchemaError([f"{label}: not UTF-8 text ({e.reason} at byte {e.start})"]) from None


def _tool_list(data: Any, label: str) -> list:
    if isinstance(data, dict) and "tools" in data:
        extra = sorted(set(data) - {"tools"})
        if extra:
            raise ToolSchemaError([f"{label}: {_at([k])}: unknown top-level field; the file holds "
                                   "{\"tools\": [...]} or a list of tools" for k in extra])
        data = data["tools"]
    if not isinstance(data, list):
        raise ToolSchemaError([(f"{label}: expected a list of tools or {{\"tools\": [...]}}, "
                                f"got {type(data).__name__}")])
    if not data:
        raise ToolSchemaError([f"{label}: tools: the list is empty; give at least one tool"])
    return data


def load_tools(source: str | Path | list | dict) -> list[NewTool]:
    """The new tools of `source`: a JSON file (path) or the parsed JSON (list or dict).

    Accepted: a list of tools or ``{"tools": [...]}``; each tool in OpenAI format
    ``{"type": "function", "function": {"name", "description", "parameters"[, "strict"]}}`` or the bare
    function object, plus the optional keys "documentation" (longer text for the model; default: the
    description) and "implementation" ("package.module:function"), beside "function" or "name".
    Checked: the shape above with no unknown fields; ``name`` matches ``^[a-zA-Z0-9_-]{1,64}$`` and
    is unique; ``description`` is a non-empty string; ``parameters`` is an object-type JSON Schema with
    ``properties`` (each an object schema), every ``required`` name among them, and valid under the
    JSON Schema Draft 2020-12 metaschema (`jsonschema.Draft202012Validator.check_schema`).

    Returns:
        one `NewTool` per tool, in file order.

    Raises:
        ToolSchemaError: every problem, one line each, with the file and the exact field path
            (``tools[i].function.parameters...``); a file that is not JSON gives line and column.
    """
    if isinstance(source, (str, Path)):
        label = str(source)
        data = _read_json(Path(source).expanduser(), label)
    else:
        label, data = "tools", source
    tools, errors, seen = [], [], {}
    for i, el in enumerate(_tool_list(data, label)):
        tool, errs, name_at = _parse_tool(el, i)
        errors += [f"{label}: {_at(p)}: {m}" for p, m in errs]
        if tool is None:
            continue
        if tool.spec.name in seen:
            errors.append(f"{label}: {_at(name_at)}: duplicate tool name {tool.spec.name!r} "
                          f"(also {_at(seen[tool.spec.name])})")
        seen.setdefault(tool.spec.name, name_at)
        try:  # an implementation must import now, not fail (or be ignored) after training
            tool.load_implementation()
        except ToolSchemaError as e:
            errors += [f"{label}: tools[{i}].{m.split('.', 1)[1] if '.' in m else m}" for m in e.errors]
        tools.append(tool)
    if errors:
        raise ToolSchemaError(errors)
    return tools


_EXAMPLE_KEYS = ("tool", "arguments", "result")


def _parse_example(text: str, where: str, specs: dict[str, ToolSpec]) -> tuple[ToolExample | None, list[str]]:
    """One JSONL line -> (the example, []) or (None, its errors prefixed with `where` = "file:line")."""
    from jsonschema import Draft202012Validator

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, [(f"{where}: column {e.colno}: not valid JSON ({e.msg}); each line is one object "
                       '{"tool": NAME, "arguments": {...}, "result": <JSON>}')]
    if not isinstance(obj, dict):
        return None, [f"{where}: expected an object with {', '.join(_EXAMPLE_KEYS)}, got {type(obj).__name__}"]
    errors = [f"{where}: {k}: required field is missing" for k in _EXAMPLE_KEYS if k not in obj]
    errors += [f"{where}: {_at([k])}: unknown field; allowed: {', '.join(_EXAMPLE_KEYS)}"
               for k in sorted(set(obj) - set(_EXAMPLE_KEYS))]
    name, args = obj.get("tool"), obj.get("arguments", {})
    if "tool" in obj and (not isinstance(name, str) or name not in specs):
        errors.append(f"{where}: tool: unknown tool {name!r}; known tools: {', '.join(sorted(specs))}")
    if not isinstance(args, dict):
        errors.append(f"{where}: arguments: expected an object, got {type(args).__name__}")
    elif isinstance(name, str) and name in specs:
        try:
            bad = list(Draft202012Validator(specs[name].parameters).iter_errors(args))
        except Exception as e:  # noqa: BLE001 - e.g. an unresolvable $ref in a schema given as a dict
            return None, [f"{where}: arguments: cannot be checked against {name}'s schema: {type(e).__name__}: {e}"]
        errors += [f"{where}: {_at(['arguments', *e.absolute_path])}: {e.message}"
                   for e in sorted(bad, key=lambda e: [str(p) for p in e.absolute_path])]
    if errors:
        return None, errors
    return ToolExample(call=ToolCall(name=name, arguments=args), result=obj["result"]), []


def load_examples(path: str | Path, tools: Sequence[NewTool | ToolSpec]) -> list[ToolExample]:
    """Real (call, result) examples of the new tools from a JSONL file, one per non-blank line:
    ``{"tool": NAME, "arguments": {...}, "result": <any JSON>}``.

    Each line must be a JSON object with exactly those keys, name one of `tools`, and have arguments
    valid under that tool's ``parameters`` schema (`jsonschema.Draft202012Validator`).

    Returns:
        the examples in file order.

    Raises:
        ToolSchemaError: every problem, one line each, as ``FILE:LINE: FIELD: message`` (e.g.
            ``ex.jsonl:3: arguments.amount: 'ten' is not of type 'number'``; an unknown tool lists
            the known ones); also a missing or empty file.
    """
    label = str(path)
    p = Path(path).expanduser()
    if not p.is_file():
        what = "a folder, not a file" if p.is_dir() else "no such file"
        raise ToolSchemaError([f"{label}: {what} (expected JSON lines of tool-call examples)"])
    specs = {(t.spec if isinstance(t, NewTool) else t).name: (t.spec if isinstance(t, NewTool) else t)
             for t in tools}
    examples, errors = [], []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ToolSchemaError([f"{label}: not UTF-8 text ({e.reason} at byte {e.start})"]) from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        ex, errs = _parse_example(line, f"{label}:{n}", specs)
        errors += errs
        examples += [ex] if ex else []
    if not examples and not errors:
        errors.append(f"{label}: no examples in the file (one JSON object per line)")
    if errors:
        raise ToolSchemaError(errors)
    return examples
