"""BFCL-v4 evaluation with bfcl-eval's own data, possible answers, checkers and weighting (METHOD.md §6).

* Data: `load_bfcl(category)` reads bfcl's `BFCL_v4_<category>.json` and its possible answer through
  bfcl's `load_dataset_entry` / `load_ground_truth_entry` (bfcl_eval/utils.py), with bfcl's
  Python-syntax hint in the function descriptions, as bfcl's own inference does.
* Output parsing: the policy answers in our native form, one or several
  `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks; `decode_calls` turns that (and a few
  awkward forms, see its docstring) into bfcl's decoded form `[{func_name: {arg: value}}]`, or raises a
  typed `DecodeError`. Decode errors are counted and reported per category, separately from wrong answers.
* Scoring: single-turn AST categories with bfcl's `ast_checker` (bfcl_eval/eval_checker/ast_eval/
  ast_checker.py); irrelevance / relevance with bfcl's rule from `_evaluate_single_relevance_entry`
  (eval_runner.py: no decodable non-empty call = irrelevance correct); multi-turn with bfcl's own tool
  classes (`envs.bfcl.BfclMultiTurnEnv`) and `multi_turn_checker`.
* Private Rehearsal (METHOD.md §4), multi-turn categories only: with a `rehearsal.RehearsalAgent`, each
  user turn (with `reenter`: each step) starts with a rehearsal round in imagination from the real history
  (REHEARSE imagines the tool outputs; the round gets a `TaskContext`, never the `BfclMultiTurnEnv`, and
  `rehearsal.isolated` checks the env's call counter and state hash around it); the round's memory joins
  the committed prompt's system message as "# Notes from rehearsal", as in `roles.act_messages`.
  Single-turn categories never rehearse (one generation, no environment to imagine).
* Overall: bfcl's `generate_leaderboard_csv` (bfcl_eval/eval_checker/eval_runner_helper.py) composition,
  computed with bfcl's own `calculate_weighted_accuracy` / `calculate_unweighted_accuracy` /
  `calculate_percentage_weighted_accuracy` (see `overall_scores`).

bfcl-eval is imported through `envs.bfcl.import_bfcl`, which installs a stand-in for its model-config
module first (that module imports every vendor SDK; the checkers need one mapping from it).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.bfcl import (
    BFCL_MODEL_NAME,
    import_bfcl,
)
from envace_core.roles.errors import ParseError
from envace_core.roles.foreign import describe, dotted_name, find_foreign_call
from envace_core.roles.tools import (
    compact_openai_schema,
    render_tool,
    template_supports_tools,
)
from envace_core.types import Task, ToolSpec

# ------------------------------------------------------------------------------------- categories
AST_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple",
                  "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
RELEVANCE_CATEGORIES = ("irrelevance", "live_irrelevance", "live_relevance")
MULTI_TURN_CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
                         "multi_turn_long_context")
SUPPORTED_CATEGORIES = AST_CATEGORIES + RELEVANCE_CATEGORIES + MULTI_TURN_CATEGORIES
ALIASES = {"simple": "simple_python"}  # bfcl v3's name of the Python simple category


class UnsupportedCategory(EnvaceError):
    """A category this adapter does not run (Java/JavaScript need bfcl's tree-sitter decoders; memory and
    web search need embedding models or the network) or an unknown name."""


def resolve_category(category: str) -> str:
    """bfcl's category name for `category` (accepts `simple` for `simple_python`); raises `UnsupportedCategory`."""
    name = ALIASES.get(category, category)
    if name not in SUPPORTED_CATEGORIES:
        raise UnsupportedCategory(f"BFCL category {category!r} is not supported; supported: "
                                  f"{', '.join(SUPPORTED_CATEGORIES)} (alias: simple)")
    return name


@dataclass
class BfclEntry:
    """One bfcl test entry. `ground_truth` is bfcl's possible answer (scoring only, never in a prompt):
    `[{func: {arg: [options]}}]` for AST categories, per-turn call strings for multi-turn, None for
    (ir)relevance."""

    id: str
    category: str
    question: list[list[dict]]
    functions: list[dict]
    ground_truth: Any
    raw: dict = field(repr=False)


def load_bfcl(category: str, limit: int | None = None) -> list[BfclEntry]:
    """The first `limit` entries (file order; all when None) of a bfcl category with their possible answers.

    Uses bfcl's `load_dataset_entry(category, include_prereq=False, include_language_specific_hint=True)`
    and `load_ground_truth_entry` (bfcl_eval/utils.py); answers are matched by id. Raises
    `UnsupportedCategory`, or `EnvaceError` when an entry has no possible answer.
    """
    cat = resolve_category(category)
    b = import_bfcl()
    entries = b.load_dataset_entry(cat, include_prereq=False, include_language_specific_hint=True)
    if limit is not None:
        entries = entries[: max(0, int(limit))]
    answers: dict[str, Any] = {}
    if cat not in RELEVANCE_CATEGORIES:
        answers = {a["id"]: a["ground_truth"] for a in b.load_ground_truth_entry(cat)}
    out = []
    for e in entries:
        if cat not in RELEVANCE_CATEGORIES and e["id"] not in answers:
            raise EnvaceError(f"BFCL entry {e['id']} has no possible answer")
        out.append(BfclEntry(id=e["id"], category=cat, question=e["question"], functions=e.get("function", []),
                             ground_truth=answers.get(e["id"]), raw=e))
    return out


def bfcl_task(entry: BfclEntry) -> Task:
    """A multi-turn entry as our `Task` (for `BfclMultiTurnEnv.reset`): `source` holds bfcl's entry and
    ground truth (scoring only)."""
    first = next((m["content"] for m in entry.question[0] if m.get("role") == "user"), "") if entry.question else ""
    return Task(id=f"bfcl/{entry.id}", domain="bfcl", split="test", first_user_message=first,
                source={"entry": entry.raw, "ground_truth": entry.ground_truth, "category": entry.category})


# ----------------------------------------------------------------------------------------- decoding
class DecodeError(ParseError):
    """A model output that holds a function call we cannot decode into bfcl's form.

    `reason` is one of: `unclosed_tag`, `stray_tag`, `malformed_tag`, `empty_call_block`, `bad_json`
    (neither JSON, a Python literal nor a Python call), `not_a_call` (JSON that is not
    `{"name", "arguments"}` objects), `bad_arguments` (arguments not an object), `positional_arguments`
    (positional arguments that cannot be named, or a positional dict for a parameter that is not a dict),
    `unsupported_argument` (a Python argument that is not a literal), `call_in_prose` (an untagged call
    inside text), `foreign_format` (a call in another model family's format, `roles.foreign`). `.raw` is
    the full output.
    """

    def __init__(self, message: str, raw: str = "", reason: str = "bad_json"):
        super().__init__(message, raw)
        self.reason = reason


_TAG = re.compile(r"</?tool_call\b[^>]*>?")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?```\Z", re.DOTALL)
_CALL_START = re.compile(r"\A\[?\s*([A-Za-z_][\w.]*)\s*\(")


def _param_order(tools: Iterable[Any]) -> dict[str, list[tuple[str, str]]]:
    """Per function name, its parameters in declaration order as `(name, declared type)` ("" when none)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for t in tools or ():
        if isinstance(t, ToolSpec):
            name, params = t.name, t.parameters
        elif isinstance(t, dict) and isinstance(t.get("name"), str):
            name, params = t["name"], t.get("parameters") or {}
        else:
            continue
        props = (params or {}).get("properties") if isinstance(params, dict) else None
        props = props if isinstance(props, dict) else {}
        out[name] = [(p, str(s.get("type", "")) if isinstance(s, dict) else "") for p, s in props.items()]
    return out


_MAPPING_TYPES = ("dict", "object")  # bfcl's function docs say "dict", JSON schema says "object"


def _strip_fence(s: str) -> str:
    m = _FENCE.match(s.strip())
    return m.group(1).strip() if m else s.strip()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _call_from_obj(obj: Any, raw: str) -> dict:
    if not isinstance(obj, dict):
        raise DecodeError(f"a call must be an object, got {type(obj).__name__}", raw, "not_a_call")
    if isinstance(obj.get("function"), dict):  # OpenAI style {"type": "function", "function": {...}}
        return _call_from_obj(obj["function"], raw)
    name = obj.get("name", obj.get("function"))  # bfcl's JSON style uses "function"/"parameters"
    if not isinstance(name, str) or not name.strip():
        raise DecodeError('a call needs a "name" string', raw, "not_a_call")
    arg_keys = [k for k in ("arguments", "parameters") if k in obj]
    extra = sorted(set(obj) - {"name", "function", "arguments", "parameters", "type", "id"})
    if extra or len(arg_keys) > 1:
        raise DecodeError(f"unexpected keys in a call: {extra or arg_keys}", raw, "not_a_call")
    args = obj.get(arg_keys[0], {}) if arg_keys else {}
    if isinstance(args, str):  # arguments given as a JSON string (OpenAI wire format)
        try:
            args = json.loads(args, parse_constant=_reject_constant) if args.strip() else {}
        except (ValueError, RecursionError):
            raise DecodeError(f"arguments of {name} are a string that is not JSON", raw, "bad_arguments") from None
    if not isinstance(args, dict):
        raise DecodeError(f"arguments of {name} must be an object, got {type(args).__name__}", raw, "bad_arguments")
    return {name.strip(): args}


def _calls_from_value(value: Any, raw: str) -> list[dict]:
    if isinstance(value, list):
        return [_call_from_obj(v, raw) for v in value]
    return [_call_from_obj(value, raw)]


def _literal(node: ast.AST, raw: str, where: str) -> Any:
    try:
        return ast.literal_eval(node)  # literals only; never evaluates code
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise DecodeError(f"{where}: {ast.unparse(node)[:60]!r} is not a literal", raw, "unsupported_argument") from None


def _python_call(node: ast.Call, params: dict[str, list[tuple[str, str]]], raw: str) -> dict:
    name = dotted_name(node.func)
    if name is None:
        raise DecodeError(f"not a function name: {ast.unparse(node.func)[:60]!r}", raw, "bad_json")
    args: dict[str, Any] = {}
    if node.args:
        order = params.get(name)
        if order is None or len(node.args) > len(order) or any(isinstance(a, ast.Starred) for a in node.args):
            raise DecodeError(f"{name}: positional arguments cannot be named", raw, "positional_arguments")
        for (pname, ptype), a in zip(order, node.args):
            value = _literal(a, raw, f"{name}({pname}=..)")
            if isinstance(value, dict) and ptype not in _MAPPING_TYPES:
                # f({"a": 1}): the keyword arguments written as a dict, or a dict for a parameter that takes
                # none; either way not the value of `pname` (bfcl's own decoder keeps keywords only)
                raise DecodeError(f"{name}: a positional dict for parameter {pname!r} of type {ptype or 'any'!r}; "
                                  "write keyword arguments", raw, "positional_arguments")
            args[pname] = value
    for kw in node.keywords:
        if kw.arg is None:
            raise DecodeError(f"{name}: **kwargs are not supported", raw, "unsupported_argument")
        if kw.arg in args:
            raise DecodeError(f"{name}: argument {kw.arg!r} given twice", raw, "positional_arguments")
        args[kw.arg] = _literal(kw.value, raw, f"{name}({kw.arg}=..)")
    return {name: args}


def _decode_body(body: str, params: dict[str, list[tuple[str, str]]], raw: str) -> list[dict]:
    """One call text: JSON; else Python call(s) `f(a=1)` / `[f(a=1), g()]`; else a Python literal."""
    body = _strip_fence(body)
    if not body:
        raise DecodeError("empty tool call", raw, "empty_call_block")
    try:
        return _calls_from_value(json.loads(body, parse_constant=_reject_constant), raw)
    except RecursionError:
        raise DecodeError("tool call JSON nested too deeply", raw, "bad_json") from None
    except ValueError:
        pass
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise DecodeError(f"tool call is neither JSON nor a Python call: {body[:80]!r}", raw, "bad_json") from None
    if isinstance(tree, ast.Call):
        return [_python_call(tree, params, raw)]
    if isinstance(tree, (ast.List, ast.Tuple)) and tree.elts and all(isinstance(e, ast.Call) for e in tree.elts):
        return [_python_call(e, params, raw) for e in tree.elts]
    if isinstance(tree, (ast.Dict, ast.List)):  # e.g. single-quoted {'name': .., 'arguments': ..}
        return _calls_from_value(_literal(tree, raw, "tool call"), raw)
    raise DecodeError(f"tool call is neither JSON nor a Python call: {body[:80]!r}", raw, "bad_json")


def _tag_bodies(text: str) -> list[str]:
    bodies, open_at = [], None
    for m in _TAG.finditer(text):
        tag = m.group(0)
        if tag not in (_OPEN, _CLOSE):
            raise DecodeError(f"malformed tag {tag!r}", text, "malformed_tag")
        if tag == _OPEN:
            if open_at is not None:
                raise DecodeError(f"{_OPEN} opened again before {_CLOSE}", text, "unclosed_tag")
            open_at = m.end()
        else:
            if open_at is None:
                raise DecodeError(f"{_CLOSE} without {_OPEN}", text, "stray_tag")
            bodies.append(text[open_at:m.start()])
            open_at = None
    if open_at is not None:
        raise DecodeError(f"unclosed {_OPEN}", text, "unclosed_tag")
    return bodies


def decode_calls(text: str, tools: Sequence[Any] = ()) -> list[dict]:
    """Decode one model output into bfcl's form `[{func_name: {arg: value}}, ...]` (in output order).

    Accepted (`tools`: `ToolSpec`s or bfcl function docs; used only to name positional arguments and to
    recognise a bare Python call):

    * our native form, one or several `<tool_call>{"name": "f", "arguments": {..}}</tool_call>` blocks;
      text around the blocks is ignored (a model's prose before/after its calls);
    * inside a block, or as the whole output (one ``` fence allowed): a JSON object or a bare JSON list of
      `{"name", "arguments"}` objects (also `"parameters"` for `"arguments"`, bfcl's
      `{"function": name, "parameters": ..}`, OpenAI's `{"function": {..}}` and arguments as a JSON
      string); a Python-style call `f(a=1, b="x")` or a list `[f(a=1), g()]`, parsed with `ast.parse`,
      values by `ast.literal_eval` (never evaluated: a non-literal argument is a `DecodeError`;
      positional arguments are named by the tool's parameter order, except that a positional dict for a
      parameter not typed dict/object is a `DecodeError`: bfcl's own `ast_parse` reads keywords only);
      a single-quoted Python dict.
      Nested quotes are whatever JSON / Python string syntax allows (`"a \\"b\\""`, `'it\\'s'`, `"it's"`).

    Returns `[]` when the output holds no call at all (plain text, an empty list): the model chose not
    to call, which is correct for bfcl's irrelevance categories.

    Raises `DecodeError` (see its `reason`s) for a call that cannot be decoded: bad or unclosed tags,
    invalid JSON inside tags, JSON that is not call-shaped, an output that starts like a JSON value or a
    call of a known tool but does not parse, an untagged call of a known tool inside prose, or a call in
    another model family's format (`roles.foreign.FOREIGN_FORMATS`: `<|python_tag|>`, `[TOOL_CALLS]`,
    `<function=f>`, ...), which is never read as "no call".
    """
    if not isinstance(text, str) or not text.strip():
        return []
    params = _param_order(tools)
    if _TAG.search(text):
        calls: list[dict] = []
        for body in _tag_bodies(text):
            calls += _decode_body(body, params, text)
        return calls
    foreign = find_foreign_call(text, params, markers_only=True)
    if foreign is not None:
        raise DecodeError(f"a call in another tool-call format: {describe(foreign)}", text, "foreign_format")
    if "<tool_call" in text:
        raise DecodeError("malformed <tool_call tag", text, "malformed_tag")
    body = _strip_fence(text)
    if body[:1] in ("[", "{"):
        return _decode_body(body, params, text)
    m = _CALL_START.match(body)
    if m and m.group(1) in params:
        return _decode_body(body, params, text)
    names = sorted(params, key=len, reverse=True)
    if names and re.search(r"(?<![\w.])(" + "|".join(re.escape(n) for n in names) + r")\s*\(", text):
        raise DecodeError("a call of a known function inside prose, without <tool_call> tags", text, "call_in_prose")
    if re.search(r'\{\s*"name"\s*:', text):
        raise DecodeError("a JSON call inside prose, without <tool_call> tags", text, "call_in_prose")
    foreign = find_foreign_call(text, params)
    if foreign is not None:  # a JSON / ReAct / XML-tag call that the forms above do not take
        raise DecodeError(f"a call in another tool-call format: {describe(foreign)}", text, "foreign_format")
    return []


# --------------------------------------------------------------------------------------- scoring
def score_single_turn(entry: BfclEntry, calls: list[dict] | None) -> dict:
    """bfcl's verdict for one single-turn entry given its decoded calls (`None` = a decode error).

    AST categories: bfcl's `ast_checker(functions, calls, possible_answer, Language.PYTHON, category,
    model_name)`; a decode error is invalid (`ast_decoder:decoder_failed`, as bfcl). Relevance categories:
    bfcl's rule from `_evaluate_single_relevance_entry` (eval_runner.py): a call is present when decoding
    succeeded and `is_empty_output` is false; irrelevance is valid without a call, relevance with one.
    Returns a dict with `valid`, `error_type` and `error` (a list of strings).
    """
    b = import_bfcl()
    if entry.category in RELEVANCE_CATEGORIES:
        has_call = calls is not None and not b.is_empty_output(calls)
        valid = (not has_call) if "irrelevance" in entry.category else has_call
        if valid:
            return {"valid": True, "error_type": "", "error": []}
        if "irrelevance" in entry.category:
            return {"valid": False, "error_type": "irrelevance_error:decoder_success",
                    "error": ["Valid syntax. Successfully decode AST when it should not."]}
        return {"valid": False, "error_type": "relevance_error:decoder_failed",
                "error": ["Failed to decode a function call when it should have."]}
    if calls is None:
        return {"valid": False, "error_type": "ast_decoder:decoder_failed", "error": ["Failed to decode AST."]}
    if not b.is_function_calling_format_output(calls):
        return {"valid": False, "error_type": "ast_decoder:decoder_wrong_output_format",
                "error": ["Did not output in the specified format."]}
    r = b.ast_checker(entry.functions, calls, entry.ground_truth, b.Language.PYTHON, entry.category,
                      BFCL_MODEL_NAME)
    return {"valid": bool(r["valid"]), "error_type": r.get("error_type", "") if not r["valid"] else "",
            "error": [str(e) for e in r.get("error", [])]}


# ------------------------------------------------------------------------------------------ prompts
_CALL_FORMAT = (
    "To call functions, reply with only this, nothing before or after it:\n"
    '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
    "Put each call in its own <tool_call> block; several blocks may follow each other. Arguments are "
    "required unless marked optional. If no function fits, reply in plain text without any <tool_call>."
)


def bfcl_system_prompt(tools: list[ToolSpec], multi_turn: bool, native_tools: bool = False,
                       memory: str | None = None) -> str:
    """The system prompt: bfcl's classic persona and task text (`PROMPT_STYLE_TEMPLATES["classic"]`),
    its multi-turn behaviour line for multi-turn entries, then (unless the chat template renders tools
    itself) the tools as `roles.render_tool` text and our `<tool_call>` format, then the rehearsal
    `memory` under "# Notes from rehearsal" when given (the section `roles.act_messages` ends with)."""
    tpl = import_bfcl().PROMPT_STYLE_TEMPLATES["classic"]
    parts = [f"{tpl['persona']} {tpl['task']}"]
    if multi_turn:
        parts.append(tpl["multiturn_behavior"])
    if not native_tools:
        parts.append("# Tools\n" + "\n".join(render_tool(t) for t in tools) + "\n\n" + _CALL_FORMAT)
    if memory and memory.strip():
        parts.append(f"# Notes from rehearsal\n{memory.strip()}")
    return "\n\n".join(parts)


def bfcl_messages(tools: list[ToolSpec], history: list[dict], multi_turn: bool,
                  native_tools: bool = False, memory: str | None = None) -> list[dict]:
    """Chat messages: our system prompt (an entry's own system message appended to it), then `history`."""
    system = bfcl_system_prompt(tools, multi_turn, native_tools, memory)
    rest = []
    for m in history:
        if m.get("role") == "system":
            system += "\n\n" + str(m.get("content", ""))
        else:
            rest.append({"role": m["role"], "content": m.get("content", "")})
    return [{"role": "system", "content": system}, *rest]


def bfcl_prompt_ids(tokenizer, tools: list[ToolSpec], history: list[dict], multi_turn: bool,
                    memory: str | None = None) -> list[int]:
    """Token ids of `bfcl_messages` with the generation prompt; native tool templates get `tools=`."""
    native = template_supports_tools(tokenizer)
    kw = {"tools": [compact_openai_schema(t) for t in tools]} if native else {}
    ids = tokenizer.apply_chat_template(bfcl_messages(tools, history, multi_turn, native, memory),
                                        add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
    return [int(i) for i in ids]
