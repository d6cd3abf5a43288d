"""Tool learning (METHOD.md §5, issue 8): teach a registered policy new tools by rehearsal.

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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.types import ToolCall, ToolSpec

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
    "description": {"type": "string", "minLength": 1},
    "parameters": _PARAMETERS_SHAPE,
    "strict": {"type": "boolean"},
}
_EXTRA_FIELDS = {  # envace's optional per-tool keys
    "documentation": {"type": "string"},
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
    if not path.is_file():
        raise ToolSchemaError([f"{label}: no such file (expected a JSON file of OpenAI-format tool schemas)"])
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
        raise ToolSchemaError([f"{label}: no such file (expected JSON lines of tool-call examples)"])
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


# ---- task builder, adaptation run, measurement (A2) ----
import random  # A2's section keeps its own imports, so the two sections can be edited apart
import statistics
from collections.abc import Iterator
from typing import TYPE_CHECKING, Self

from envace_core.types import Task

if TYPE_CHECKING:
    from envace_core.config import RunConfig

# Why a task "needs" a new tool: its gold actions call one (METHOD.md §5). Held-out tasks are real tau2
# tasks only (scorable by replay in the real environment); tasks built from the user's examples have no
# tau2 database state and train with the `actions` reward only.
HELD_OUT_SPLIT = "test"  # the dataset split name `stages.load_dataset(..., "test")` reads as held out
_TEMPLATES = (  # opening requests built from a tool's documentation and an example's arguments
    "Hi! I'd like you to {purpose}. {details}",
    "{details} Could you {purpose} for me?",
    "Please {purpose}. {details}",
)


class AdaptationError(EnvaceError):
    """Tool learning cannot do what was asked: too few tasks, a tool with no source, bad arguments."""


class RealToolCallError(AdaptationError):
    """A real call to a new tool was attempted while adapting (the run is not registered)."""


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _sha(obj: Any) -> str:
    import hashlib

    return hashlib.sha256(_canonical(obj).encode()).hexdigest()


def _key(task: Task) -> str:
    """Deduplication key: normalised opening request + canonical gold actions (as `synth.Candidate.key`)."""
    return " ".join(task.first_user_message.lower().split()) + "\n" + _canonical(
        [[a.name, a.arguments] for a in task.gold_actions])


def tool_schema_sha256(spec: ToolSpec) -> str:
    """sha256 of the tool's canonical OpenAI-format schema (sorted keys, no whitespace)."""
    return _sha(spec.openai_schema())


def examples_sha256(examples: Sequence[ToolExample]) -> str | None:
    """sha256 of the examples' canonical JSON lines, in order; None when there are none."""
    if not examples:
        return None
    return _sha([{"tool": e.call.name, "arguments": e.call.arguments, "result": e.result} for e in examples])


# ------------------------------------------------------------------------------- task builder
def _excluded_users(domain: str, test: list[Task]) -> tuple[set[str], Any]:
    """(user ids named by the domain's test split, the packaged DB) for the synth domains; (set(), None)
    elsewhere (no user table to check against)."""
    from envace_core import synth

    if domain not in synth.SYNTH_DOMAINS:
        return set(), None
    db = synth._env(domain).tools.db
    return synth.test_users(domain, test, db), db


def _calls_ok(calls: Sequence[tuple[str, dict]], names: set[str], blocked: set[str],
              specs: dict[str, ToolSpec]) -> bool:
    """The calls use >= 1 new tool, no blocked (hidden, not re-added) tool, and every new-tool call's
    arguments validate against the new schema (a user's schema of a domain tool may be stricter)."""
    from jsonschema import Draft202012Validator

    used = {n for n, _ in calls}
    if not used & names or used & blocked:
        return False
    return all(next(Draft202012Validator(specs[n].parameters).iter_errors(a), None) is None
               for n, a in calls if n in names)


def _scorable(task: Task) -> bool:
    """tau2 can score it offline: its reward basis is not NL assertions alone (no judge offline)."""
    basis = ((task.source or {}).get("evaluation_criteria") or {}).get("reward_basis") or []
    return bool(set(basis) - {"NL_ASSERTION"})


def _domain_tasks(domain: str, names: set[str], blocked: set[str], specs: dict[str, ToolSpec],
                  seed: int, test: list[Task], excluded: set[str], db: Any) -> Iterator[Task]:
    """The domain's real tasks that need a new tool, lazily, deterministic in `seed`: the tau2 train
    split's and `synth` candidates' (levels 1-3, each validated by running its gold,
    `synth.validate`), each list shuffled by seed, then interleaved. Never a `test` task, nor one
    that names an `excluded` (test-split) user of `db` (`synth.test_users`)."""
    from envace_core import synth
    from envace_core.envs.tau2 import Tau2Environment, load_tasks

    test_ids = {t.id for t in test}
    tau2 = [t for t in load_tasks(domain, "train")
            if _calls_ok([(a.name, a.arguments) for a in t.gold_actions], names, blocked, specs)
            and _scorable(t) and t.id not in test_ids
            and not (db is not None and synth.test_users(domain, [t], db) & excluded)]
    random.Random(f"{seed}:{domain}:adapt-tau2").shuffle(tau2)
    cands = [c for lv in synth.LEVELS for c in synth.candidates(domain, lv, excluded, db)
             if _calls_ok(c.actions, names, blocked, specs)] if db is not None else []
    random.Random(f"{seed}:{domain}:adapt-synth").shuffle(cands)

    def synthesized() -> Iterator[Task]:
        base = Tau2Environment(domain).snapshot()
        for c in cands:
            task = synth.build_task(domain, c)
            if task.id not in test_ids and not synth.validate(task, base):
                yield task

    sources = [iter(tau2), synthesized()]
    while sources:  # round-robin, so neither source crowds the other out
        for it in list(sources):
            task = next(it, None)
            if task is None:
                sources.remove(it)
            else:
                yield task


def _label(name: str) -> str:
    return name.replace("_", " ").strip()


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def example_request(tool: NewTool, arguments: dict[str, Any], template: int = 0) -> str:
    """A user's opening request for `arguments` of `tool`, deterministic: the first sentence of the
    tool's documentation (lower-cased first letter) as what the user wants, and one sentence per
    argument in the schema's property order ("The first name is Yusuf."). `template` picks one of
    the phrasings `_TEMPLATES` (mod their number)."""
    doc = " ".join((tool.doc or tool.spec.description or "").split())
    first = re.split(r"(?<=[.!?])\s", doc, maxsplit=1)[0].rstrip(".!? ") if doc else ""
    purpose = (first[:1].lower() + first[1:]) if first else f"use the {tool.spec.name} tool"
    order = list(tool.spec.parameters.get("properties") or {}) + sorted(arguments)
    keys = [k for k in dict.fromkeys(order) if k in arguments]
    details = " ".join(f"The {_label(k)} is {_value(arguments[k])}." for k in keys)
    text = _TEMPLATES[template % len(_TEMPLATES)].format(purpose=purpose, details=details)
    text = " ".join(text.split())
    return text[:1].upper() + text[1:]


def _example_tasks(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample],
                   added: list[ToolSpec], hidden: list[str]) -> list[Task]:
    """One train task per (template, example), template-major: the opening request from
    `example_request`, gold = the example call; `source` marks it as example-built (no tau2 record,
    so nothing can replay it against a tau2 database)."""
    by_name = {t.spec.name: t for t in tools}
    out = []
    for k in range(len(_TEMPLATES)):
        for i, ex in enumerate(examples):
            msg = example_request(by_name[ex.call.name], ex.call.arguments, k)
            gold = [ToolCall(name=ex.call.name, arguments=dict(ex.call.arguments), id="example_0")]
            task = Task(id="", domain=domain, split="train", first_user_message=msg, gold_actions=gold,
                        source={"envace_adapt": {"origin": "example", "example": i, "template": k}},
                        tools_added=list(added), tools_hidden=list(hidden))
            out.append(task)
    return out


def _with_id(task: Task, split: str, added: list[ToolSpec], hidden: list[str]) -> Task:
    return task.model_copy(update={"id": f"{task.domain}/adapt-{_sha(_key(task))[:12]}", "split": split,
                                   "tools_added": list(added), "tools_hidden": list(hidden)})


def build_adaptation_tasks(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample], *,
                           n: int, seed: int = 0, held_out: float = 0.3,
                           hidden: Sequence[str] = ()) -> dict[str, list[Task]]:
    """Rehearsal training tasks that need the new `tools`, plus held-out real tasks to measure them on.

    Sources (METHOD.md §5, issue 8 item 2):
      (a) for a new tool named like a tool of `domain`: the domain's real tasks whose gold actions
          call it (`_domain_tasks`: tau2's train split and `synth` candidates of levels 1-3, gold
          verified by running it; never a test-split task or user);
      (b) each of the user's `examples`: an opening request written from the tool's documentation
          and the example's arguments (`example_request`, deterministic templates, no LLM), gold =
          the example call. These have no tau2 database state: they are train-only and scored by the
          `actions` reward.
    Budget: `n` tasks in all; the examples get at least min(len(examples), n // 2) of them, the
    domain the rest (then the examples any the domain could not fill). Tasks whose gold calls a
    `hidden` domain tool that is not re-added are skipped (their context would lack it).

    Every task gets `tools_added` = the new tools' specs, `tools_hidden` = `hidden`, and id
    ``<domain>/adapt-<12 hex>`` (sha256 of the dedup key: normalised opening request + canonical gold
    actions; duplicates are dropped). Held out: round(held_out * #domain tasks) of the domain tasks
    (at least 1 when there are >= 2, or 1 plus an example task), chosen by a `seed`-ed shuffle, in
    split "test", never one naming a user the examples name (its answer would be given away); example
    tasks are only ever in "train". The table passes `gates.dataset_gate`
    (gold calls valid under the new schemas, no test-split id in train) before it is returned.

    Returns {"train": [...], "held_out": [...]} (held-out possibly empty when no new tool is a domain
    tool). Raises AdaptationError (fewer than 2 tasks: says why per tool; bad `n`/`held_out`/
    `hidden`), `gates.GateFailed` when the gate fails, `UnknownDomainError` for an unknown domain.
    """
    return _build_tasks(domain, tools, examples, n, seed, held_out, hidden)[0]


def _build_tasks(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample], n: int, seed: int,
                 held_out: float, hidden: Sequence[str]) -> tuple[dict[str, list[Task]], Any]:
    """`build_adaptation_tasks` and its passing `gates.GateResult`."""
    from envace_core import synth
    from envace_core.envs.tau2 import _domain_static, load_tasks

    if n < 2:
        raise AdaptationError(f"n={n}: tool learning needs at least 2 tasks")
    if not 0 <= held_out < 1:
        raise AdaptationError(f"held_out={held_out}: the held-out share must be in [0, 1)")
    if not tools:
        raise AdaptationError("no new tools given: pass at least one tool schema")
    domain_tools = {t.name for t in _domain_static(domain)[0]}
    unknown = sorted(set(hidden) - domain_tools)
    if unknown:
        raise AdaptationError(f"hidden tools {unknown} are not tools of {domain!r} "
                              f"({', '.join(sorted(domain_tools))})")
    specs = {t.spec.name: t.spec for t in tools}
    names, added, hidden = set(specs), [t.spec for t in tools], sorted(set(hidden))
    bad = sorted({e.call.name for e in examples} - names)
    if bad:
        raise AdaptationError(f"examples call {bad}, which are not among the new tools {sorted(names)}")
    blocked = set(hidden) - names
    test = load_tasks(domain, "test")
    excluded, db = _excluded_users(domain, test)
    n_ex = min(len(examples), n // 2)
    seen: set[str] = set()
    real: list[Task] = []
    if names & domain_tools:
        for t in _domain_tasks(domain, names & domain_tools, blocked, specs, seed, test, excluded, db):
            if len(real) >= n - n_ex:
                break
            if _key(t) not in seen:
                seen.add(_key(t))
                real.append(t)
    made = []
    for t in _example_tasks(domain, tools, examples, added, hidden):
        if len(made) >= n - len(real):
            break
        if db is not None and synth.test_users(domain, [t], db) & excluded:
            continue  # an example about a test-split user would leak test data into training
        if _key(t) not in seen:
            seen.add(_key(t))
            made.append(t)
    if len(real) + len(made) < 2:
        raise AdaptationError(_too_few(domain, tools, examples, domain_tools, real, made))
    for tool in tools:
        if not any(a.name == tool.spec.name for t in real + made for a in t.gold_actions):
            print(f"[adapt-tools] WARNING: no task needs {tool.spec.name!r} "
                  f"({_why_none(tool.spec.name, domain, domain_tools, examples)})")
    order = list(range(len(real)))
    random.Random(f"{seed}:{domain}:adapt-held-out").shuffle(order)
    k = min(max(round(held_out * len(real)), 1 if held_out > 0 else 0), len(real) - (0 if made else 1))
    # A task about a user the examples name (arguments or result) would give its answer away: train only.
    ex_users = _example_users(domain, examples, db) if db is not None and examples else set()
    order = [i for i in order if not synth.test_users(domain, [real[i]], db) & ex_users] if ex_users else order
    held_idx = set(order[:max(k, 0)])
    train = [_with_id(t, "train", added, hidden) for i, t in enumerate(real) if i not in held_idx]
    made_train, made_held = _split_implemented(made, tools, domain_tools, held_out, seed)
    train += [_with_id(t, "train", added, hidden) for t in made_train]
    held = [_with_id(real[i], HELD_OUT_SPLIT, added, hidden) for i in sorted(held_idx)]
    held += [_with_id(t, HELD_OUT_SPLIT, added, hidden) for t in made_held]
    gate = adaptation_gate(domain, train, held, blocked).raise_if_failed()
    return {"train": train, "held_out": held}, gate


def _split_implemented(made: list[Task], tools: Sequence[NewTool], domain_tools: set[str], held_out: float,
                       seed: int) -> tuple[list[Task], list[Task]]:
    """(train, held-out) of the example-built tasks. For a new tool that no tau2 domain executes but
    that has an `implementation`, round(held_out x its examples) whole examples (all their phrasings,
    so no held-out answer is trained on; at least 1 when it has 2+ examples) are held out and marked
    to be scored by running the implementation (`ImplementationEnvironment`)."""
    impl = {t.spec.name: t.implementation for t in tools if t.implementation and t.spec.name not in domain_tools}
    chosen: set[tuple[str, int]] = set()
    for name in sorted(impl):
        idx = sorted({t.source["envace_adapt"]["example"] for t in made if t.gold_actions[0].name == name})
        k = min(max(round(held_out * len(idx)), 1 if held_out > 0 else 0), len(idx) - 1)
        random.Random(f"{seed}:{name}:adapt-held-out-examples").shuffle(idx)
        chosen |= {(name, i) for i in idx[:max(k, 0)]}
    train, held = [], []
    for t in made:
        name = t.gold_actions[0].name
        if (name, t.source["envace_adapt"]["example"]) in chosen:
            mark = {**t.source["envace_adapt"], "scored_by": {name: impl[name]}}
            held.append(t.model_copy(update={"source": {"envace_adapt": mark}}))
        else:
            train.append(t)
    return train, held


class ImplementationEnvironment:
    """A real environment for tools no tau2 domain executes: each call runs the tool's
    `implementation` (``"module:function"``, called with the call's arguments as keywords) and the
    JSON of its return value is the observation; an exception or an unknown tool is an error
    observation. Used only to score held-out tasks (`measure`), never during adaptation.

    Args:
        implementations: {tool name: "module:function"}.
    Raises:
        ToolSchemaError: an implementation cannot be imported.
    """

    def __init__(self, implementations: dict[str, str]):
        self.fns = {n: NewTool(ToolSpec(name=n), "", path).load_implementation()
                    for n, path in implementations.items()}
        self.calls_made = 0

    def reset(self, task: Task) -> None:
        self.calls_made = 0

    def step(self, call: ToolCall):
        from envace_core.types import Observation

        self.calls_made += 1
        fn = self.fns.get(call.name)
        if fn is None:
            return Observation(content=f"Error: unknown tool {call.name!r}", error=True)
        try:
            return Observation(content=json.dumps(fn(**call.arguments), default=str))
        except Exception as e:  # noqa: BLE001 - a tool error is an observation, as in tau2
            return Observation(content=f"Error: {type(e).__name__}: {e}", error=True)


def _implemented(task: Task) -> dict[str, str] | None:
    """{tool: "module:function"} for a held-out task scored by running implementations, else None."""
    return ((task.source or {}).get("envace_adapt") or {}).get("scored_by")


def _example_users(domain: str, examples: Sequence[ToolExample], db: Any) -> set[str]:
    """User ids of `db` the examples name, in their arguments or results (`synth.test_users` rules)."""
    from envace_core import synth

    probes = [Task(id="probe", domain=domain, split="train", first_user_message="",
                   user_scenario=_canonical(e.result), gold_actions=[e.call]) for e in examples]
    return synth.test_users(domain, probes, db)


def _why_none(name: str, domain: str, domain_tools: set[str], examples: Sequence[ToolExample]) -> str:
    has_examples = any(e.call.name == name for e in examples)
    if name not in domain_tools and not has_examples:
        return f"it is neither a tool of the {domain!r} domain nor has examples; give examples of its use"
    if name in domain_tools:
        return f"no train task of {domain!r} that avoids test-split users calls it validly" + (
            "" if has_examples else "; give examples of its use")
    return "its examples duplicate other tasks"


def _too_few(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample],
             domain_tools: set[str], real: list[Task], made: list[Task]) -> str:
    def count(name: str) -> int:
        return sum(any(a.name == name for a in t.gold_actions) for t in real + made)

    reasons = "; ".join(f"{t.spec.name}: " + (f"{count(t.spec.name)} task(s)" if count(t.spec.name) else
                                             _why_none(t.spec.name, domain, domain_tools, examples))
                        for t in tools)
    return (f"only {len(real) + len(made)} adaptation task(s) could be built for {domain!r} "
            f"({len(real)} from the domain, {len(made)} from examples); at least 2 are needed. {reasons}")


def adaptation_gate(domain: str, train: list[Task], held: list[Task], blocked: set[str] = frozenset()):
    """`gates.dataset_gate` on the adaptation table, as `stages.curate` runs it: schema, unique ids,
    valid gold calls (domain tools minus `blocked` hidden ones, plus each row's `tools_added`), no
    test-split id in train (the domain's tau2 test ids and the held-out ids), >= 2 rows. With no
    held-out task only the train split is required. Returns the `GateResult`."""
    import pandas as pd

    from envace_core.envs.tau2 import _domain_static, load_tasks
    from envace_core.gates import dataset_gate
    from envace_core.stages import _task_record

    frame = pd.DataFrame([_task_record(t) for t in train + held])
    test_ids = {t.id for t in load_tasks(domain, "test")} | {t.id for t in held}
    tools = {domain: {t.name: t.parameters for t in _domain_static(domain)[0] if t.name not in blocked}}
    return dataset_gate(frame, test_ids, 2, None, train_split="train",
                        test_split=HELD_OUT_SPLIT if held else "train", domains=[domain], tools=tools)


# ----------------------------------------------------------------------------------- adaptation run
class RealCallGuard:
    """Counts, while active, every real tool call (`Tau2Environment.step`, the only way to the real
    tau2 environment) and refuses those of the `blocked` tools: they get an error observation and are
    never executed. ``calls`` = {tool name: attempts}; ``blocked_calls`` = attempts on blocked tools.
    A context manager; patches the class, so it sees every environment made inside it."""

    def __init__(self, blocked: set[str]):
        self.blocked, self.calls = set(blocked), {}

    @property
    def blocked_calls(self) -> int:
        return sum(v for k, v in self.calls.items() if k in self.blocked)

    def __enter__(self) -> Self:
        from envace_core.envs.tau2 import Tau2Environment
        from envace_core.types import Observation

        self._cls, self._step, guard = Tau2Environment, Tau2Environment.step, self

        def step(env, call):
            guard.calls[call.name] = guard.calls.get(call.name, 0) + 1
            if call.name in guard.blocked:
                return Observation(content=f"Error: real call to new tool {call.name!r} refused "
                                   "during tool-learning adaptation", error=True)
            return guard._step(env, call)

        Tau2Environment.step = step
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls.step = self._step


def _adapter_settings(adapter_dir: str | None) -> dict[str, Any]:
    """train.* settings a parent adapter fixes (`train.init_adapter` must match them): LoRA r, alpha,
    target modules, and the per-role layout (act/ + rehearse/)."""
    if not adapter_dir:
        return {}
    d = Path(adapter_dir)
    per_role = (d / "act" / "adapter_config.json").is_file()
    cfg_file = d / "act" / "adapter_config.json" if per_role else d / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdaptationError(f"parent adapter {adapter_dir} has no adapter_config.json")
    lora = json.loads(cfg_file.read_text())
    mods = lora.get("target_modules") or []
    return {"lora_r": lora["r"], "lora_alpha": lora["lora_alpha"],
            "lora_target_modules": sorted([mods] if isinstance(mods, str) else mods),
            "policy_per_role": per_role}


def adaptation_config(cfg: RunConfig, parent: Any, domain: str, hidden: Sequence[str],
                      registry: str, name: str) -> RunConfig:
    """`cfg` set up for an adaptation run from `parent` (an `eval_run.ResolvedModel`): its base
    model and adapter (`train.init_adapter`; LoRA shape taken from it), rehearsal only
    (rollout.source=imagined, reward.name=actions, reward.replay_fidelity=false: no environment call
    while scoring; train.sft_warmup_steps=0: the warm-up executes gold calls for real), data.domains =
    [domain] with `hidden`, and the registry/name to register under."""
    from envace_core.config import ConfigError, RunConfig

    d = cfg.to_dict()
    d["model"]["ref"] = parent.base_ref
    d["data"].update(domains=[domain], hidden_tools=list(hidden))
    d["rollout"].update(source="imagined")
    d["reward"].update(name="actions", replay_fidelity=False, fidelity_lambda=0.0)
    fixed = _adapter_settings(parent.adapter_dir)
    for k, v in fixed.items():  # a continued adapter keeps its shape: say so instead of silently overriding
        mine = d["train"].get(k)
        if (sorted(mine) if k == "lora_target_modules" and mine else mine) != v:
            print(f"[adapt] train.{k}={mine!r} from the config is replaced by the parent's {v!r} "
                  f"(the adaptation continues {parent.ref}'s adapter, so its shape is fixed)")
    d["train"].update(init_adapter=parent.adapter_dir, sft_warmup_steps=0, **fixed)
    d["store"].update(registry=registry, model_name=name)
    try:
        return RunConfig.model_validate(d)
    except ValueError as e:
        raise ConfigError(f"adaptation config for {domain!r} from {parent.ref!r} is invalid: {e}") from None


def _parent_lineage(parent: Any, registry: str) -> dict[str, Any]:
    """{ref, name, version, manifest_sha256, base_model} of the parent; name/version/sha None for a
    plain model (a base model with a fresh adapter)."""
    import hashlib

    from envace_core.lineage import MANIFEST, Registry

    if parent.manifest is None:
        return {"ref": parent.ref, "name": None, "version": None, "manifest_sha256": None,
                "base_model": parent.base_ref}
    name, version = parent.manifest["name"], parent.manifest["version"]
    raw = (Registry(registry).version_dir(name, version) / MANIFEST).read_bytes()
    return {"ref": parent.ref, "name": name, "version": version,
            "manifest_sha256": hashlib.sha256(raw).hexdigest(), "base_model": parent.base_ref}


def _inputs_text(tools: Sequence[NewTool], examples: Sequence[ToolExample]) -> dict[str, str]:
    """The adaptation inputs as registry artifacts (hashed with the version): tools.json, examples.jsonl."""
    out = {"tools.json": json.dumps([{**t.spec.openai_schema(), "documentation": t.doc,
                                      **({"implementation": t.implementation} if t.implementation else {})}
                                     for t in tools], indent=2, sort_keys=True)}
    if examples:
        out["examples.jsonl"] = "".join(_canonical({"tool": e.call.name, "arguments": e.call.arguments,
                                                    "result": e.result}) + "\n" for e in examples)
    return out


def adapt(cfg: RunConfig, model_ref: str, tools: Sequence[NewTool], examples: Sequence[ToolExample], *,
          domain: str, n_tasks: int, registry: str | None = None, name: str | None = None) -> dict[str, Any]:
    """Teach `model_ref` the new `tools` by rehearsal only and register the result (issue 8 item 3).

    1. Parent: `eval_run.resolve_model_ref` (``registry:NAME@VERSION`` is verified first; a plain
       path/``bundled:`` ref is the base model with a fresh adapter). Its hidden tools
       (``data.hidden_tools`` of its manifest config, plus `cfg`'s) stay hidden unless re-added.
    2. Tasks: `build_adaptation_tasks` (n = `n_tasks`, seed = ``train.seed``), written as a dataset
       with `stages.write_dataset` (train + held-out split "test"), gate report included.
    3. Training: `stages.rollout_and_train` with `adaptation_config` (imagined rollouts, `actions`
       reward, no fidelity replay, starting from the parent's adapter), inside a `RealCallGuard`:
       any real call of a new tool is refused and raises `RealToolCallError` after the run (nothing
       registered). Re-running the same command resumes the run's checkpoint.
    4. Registration: `stages.register` under `name` (default: the parent's name, else
       ``store.model_name``) in `registry` (default ``store.registry``); the manifest adds `parent`
       {ref, name, version, manifest_sha256, base_model}, `tools` [{name, schema_sha256}],
       `examples_sha256`, and `adaptation` {domain, tasks, hidden, real calls}; tools.json and
       examples.jsonl are artifacts.

    Returns {"name", "version", "path", "manifest" (its path), "dataset" (the `stages.load_dataset`
    dict; split "test" = held-out tasks), "trained" {run_id, adapter_dir, learning_signal,
    iterations}, "tasks" {train, held_out}, "real_calls_to_new_tools": 0, "real_calls": {tool: n}}.
    Raises `eval_run.ModelRefError`, `AdaptationError`, `gates.GateFailed`, `config.ConfigError`.
    """
    from envace_core import stages
    from envace_core.envs.tau2 import _domain_static
    from envace_core.eval_run import resolve_model_ref

    registry = registry or cfg.store.registry
    parent = resolve_model_ref(model_ref, registry)
    domain_tools = {t.name for t in _domain_static(domain)[0]}
    inherited = (((parent.manifest or {}).get("config") or {}).get("data") or {}).get("hidden_tools") or []
    hidden = sorted((set(inherited) | set(cfg.data.hidden_tools)) & domain_tools)
    name = name or (parent.manifest or {}).get("name") or cfg.store.model_name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name):
        raise AdaptationError(f"registry name {name!r}: use letters, digits, '.', '_' or '-' (e.g. envace-policy)")
    acfg = adaptation_config(cfg, parent, domain, hidden, registry, name)
    try:  # model, store, registry, parent adapter, engine: fail now, not after the tasks are built
        stages.preflight(acfg)
    except EnvaceError as e:
        hint = (f" (a registry version is written registry:{model_ref})"
                if "@" in model_ref and not model_ref.startswith(("registry:", "s3://", "bundled:")) else "")
        raise AdaptationError(f"--model {model_ref!r} cannot be used: {e}{hint}") from e
    built, gate = _build_tasks(domain, tools, examples, n_tasks, acfg.train.seed, 0.3, hidden)
    train, held = built["train"], built["held_out"]
    blocked = {t.spec.name for t in tools} & domain_tools
    dataset = {**stages.write_dataset(acfg, [stages._task_record(t) for t in train + held], gate, {
        "domains": [domain], "n_train": len(train), "n_test": len(held),
        "splits": {"train": "train", "test": HELD_OUT_SPLIT}, "source": "envace tool learning",
        "tools": [t.spec.name for t in tools], "hidden_tools": hidden}),
        "n_train": len(train), "n_test": len(held),
        "dvc": {"tracked": False, "reason": "adaptation dataset: data.dvc tracks the curated dataset"}}
    print(f"[adapt-tools] dataset {dataset['version']}: {len(train)} train / {len(held)} held-out tasks "
          f"needing {sorted(t.spec.name for t in tools)} -> {dataset['dir']}")
    with RealCallGuard({t.spec.name for t in tools}) as guard:
        trained = stages.rollout_and_train(acfg, dataset)
    if guard.blocked_calls:
        raise RealToolCallError(f"{guard.blocked_calls} real call(s) to new tools were attempted during "
                                f"adaptation ({guard.calls}); refused, and the model was not registered")
    print(f"[adapt-tools] real tool calls during training: {sum(guard.calls.values())} "
          f"(new tools: {guard.blocked_calls})")
    lineage = {
        "parent": _parent_lineage(parent, registry),
        "tools": [{"name": t.spec.name, "schema_sha256": tool_schema_sha256(t.spec)} for t in tools],
        "examples_sha256": examples_sha256(examples),
        "adaptation": {"domain": domain, "n_train": len(train), "n_held_out": len(held), "hidden_tools": hidden,
                       "real_calls_to_new_tools": guard.blocked_calls, "real_calls": dict(guard.calls),
                       "new_domain_tools": sorted(blocked)},
    }
    reg = stages.register(acfg, dataset, trained, {"metrics": {}, "gate": None},
                          {"summary": {}, "note": "not evaluated here: see tool_learning.measure"},
                          extra_manifest=lineage, extra_artifacts=_inputs_text(tools, examples))
    return {**reg, "dataset": dataset, "tasks": {"train": len(train), "held_out": len(held)},
            "trained": {"run_id": trained["run_id"], "adapter_dir": trained["adapter_dir"],
                        "learning_signal": trained["learning_signal"], "iterations": len(trained["history"])},
            "real_calls_to_new_tools": guard.blocked_calls, "real_calls": dict(guard.calls)}


# ------------------------------------------------------------------------------------ measurement
def measure(cfg: RunConfig, model_ref: str, tasks: Sequence[Task], *, tools: Sequence[str],
            trials: int = 1, seed: int = 0, registry: str | None = None) -> dict[str, Any]:
    """Real-environment success and REHEARSE fidelity of `model_ref` on held-out `tasks` (issue 8 item 4).

    Success: per task, `trials` ACT rollouts (`rollout.real_rollouts`, greedy at ``eval.temperature``,
    ``eval.max_turns``; the opening request is the whole user side), each against its own private
    `Tau2Environment` reset to the task, scored by the `replay` reward (tau2's evaluator,
    `stages.score`); a trial succeeds iff reward >= 1, the task's value is its trials' mean.
    Fidelity: the tasks' gold actions replayed for real (`stages.held_out_transitions`); for each
    transition whose call is one of `tools`, REHEARSE predicts the observation greedily
    (`stages.rehearse_rows`: F(ô, o) of METHOD.md §2, 0 when unparseable); the task's value is its
    transitions' mean. Each metric: mean over tasks and a 95% percentile-bootstrap CI over tasks
    (`stats.mean_ci`, seed `seed`); n = tasks measured.

    Returns {"success": {"mean", "ci95", "n", "method"}, "fidelity": {... , "transitions"},
    "per_task": [{"task_id", "success", "rewards", "terminations", "fidelity", "transitions"}],
    "model", "trials", "protocol"}. Raises AdaptationError for a task without a tau2 record
    (example-built tasks cannot be scored in the real environment) or trials < 1, and
    `eval_run.ModelRefError` for a bad model ref. `registry`: where a ``registry:`` ref lives
    (default ``store.registry``).
    """
    from envace_core import stages
    from envace_core.envs.tau2 import Tau2Environment, task_context
    from envace_core.eval_run import load_engine, resolve_model_ref
    from envace_core.rollout import real_rollouts
    from envace_core.stats import mean_ci
    from envace_core.types import Message

    if trials < 1:
        raise AdaptationError(f"trials={trials}: need at least 1")
    bad = [t.id for t in tasks if not (t.source or {}).get("evaluation_criteria") and not _implemented(t)]
    if bad:
        raise AdaptationError(f"tasks {bad[:3]} have no tau2 record and no tool implementation, so they cannot "
                              "be scored in a real environment (example-built tasks are train-only unless the "
                              "tool has an \"implementation\")")
    engine, _ = load_engine(cfg, resolve_model_ref(model_ref, registry or cfg.store.registry))
    p = stages.rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=cfg.eval.max_turns)
    per_task = []
    from envace_core.rewards import actions_reward, score_trajectory

    for i, task in enumerate(tasks):
        impl = _implemented(task)
        envs = [ImplementationEnvironment(impl) if impl else Tau2Environment(task.domain) for _ in range(trials)]
        for env in envs:
            env.reset(task)
        trajs = real_rollouts(engine, task_context(task, cfg.data.policy_max_chars), envs, p, seed=seed * 100003 + i)
        # tau2 tasks: tau2's evaluator on a replay; implemented tools: every gold call made (actions
        # reward, tau2's all-match rule) and a clean end, as tau2 requires
        trajs = [score_trajectory(task, t, actions_reward, replay_fidelity=False) if impl else stages.score(task, t)
                 for t in trajs]
        rewards = [t.reward for t in trajs]
        per_task.append({"task_id": task.id, "success": statistics.fmean(float((r or 0) >= 1.0) for r in rewards),
                         "rewards": rewards, "terminations": [t.termination for t in trajs],
                         "fidelity": None, "transitions": 0})
    wanted = set(tools)
    trans = [tr for tr in stages.held_out_transitions([t for t in tasks if not _implemented(t)], 1 << 30)
             if tr[2].name in wanted]
    for task in (t for t in tasks if _implemented(t)):  # the example's call, executed by its implementation
        env = ImplementationEnvironment(_implemented(task))
        call = task.gold_actions[0].model_copy(update={"id": "call_1"})
        trans.append((task, [Message(role="user", content=task.first_user_message)], call, env.step(call)))
    by_task: dict[str, list[float]] = {}
    for (task, *_), row in zip(trans, stages.rehearse_rows(cfg, engine, trans)):
        by_task.setdefault(task.id, []).append(row["fidelity"])
    for rec in per_task:
        f = by_task.get(rec["task_id"], [])
        rec.update(fidelity=statistics.fmean(f) if f else None, transitions=len(f))
    fid = mean_ci([r["fidelity"] for r in per_task if r["fidelity"] is not None], seed=seed)
    return {"success": mean_ci([r["success"] for r in per_task], seed=seed),
            "fidelity": {**fid, "transitions": len(trans)}, "per_task": per_task,
            "model": model_ref, "trials": trials, "tools": sorted(wanted),
            "protocol": {"user": "opening request only (no simulated follow-ups)",
                         "success": "tau2 replay reward == 1 in a private real environment",
                         "fidelity": "REHEARSE on held-out real transitions of the new tools, greedy",
                         "ci": "95% percentile bootstrap over tasks"}}
