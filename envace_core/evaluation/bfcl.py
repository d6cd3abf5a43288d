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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from envace_core import EnvaceError
from envace_core import rehearsal as rehearsal_mod
from envace_core.engines.base import SamplingParams
from envace_core.envs.bfcl import (
    BFCL_MODEL_NAME,
    BfclMultiTurnEnv,
    bfcl_tool_spec,
    check_multi_turn,
    import_bfcl,
)
from envace_core.roles import (
    ParseError,
    compact_openai_schema,
    render_tool,
    template_supports_tools,
)
from envace_core.types import Message, Step, Task, TaskContext, ToolCall, ToolSpec

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
    (positional arguments that cannot be named), `unsupported_argument` (a Python argument that is not a
    literal), `call_in_prose` (an untagged call inside text). `.raw` is the full output.
    """

    def __init__(self, message: str, raw: str = "", reason: str = "bad_json"):
        super().__init__(message, raw)
        self.reason = reason


_TAG = re.compile(r"</?tool_call\b[^>]*>?")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?```\Z", re.DOTALL)
_CALL_START = re.compile(r"\A\[?\s*([A-Za-z_][\w.]*)\s*\(")


def _param_order(tools: Iterable[Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t in tools or ():
        if isinstance(t, ToolSpec):
            name, params = t.name, t.parameters
        elif isinstance(t, dict) and "name" in t:
            name, params = t["name"], t.get("parameters") or {}
        else:
            continue
        out[name] = list((params or {}).get("properties") or {})
    return out


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
        except ValueError:
            raise DecodeError(f"arguments of {name} are a string that is not JSON", raw, "bad_arguments") from None
    if not isinstance(args, dict):
        raise DecodeError(f"arguments of {name} must be an object, got {type(args).__name__}", raw, "bad_arguments")
    return {name.strip(): args}


def _calls_from_value(value: Any, raw: str) -> list[dict]:
    if isinstance(value, list):
        return [_call_from_obj(v, raw) for v in value]
    return [_call_from_obj(value, raw)]


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _literal(node: ast.AST, raw: str, where: str) -> Any:
    try:
        return ast.literal_eval(node)  # literals only; never evaluates code
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise DecodeError(f"{where}: {ast.unparse(node)[:60]!r} is not a literal", raw, "unsupported_argument") from None


def _python_call(node: ast.Call, params: dict[str, list[str]], raw: str) -> dict:
    name = _dotted(node.func)
    if name is None:
        raise DecodeError(f"not a function name: {ast.unparse(node.func)[:60]!r}", raw, "bad_json")
    args: dict[str, Any] = {}
    if node.args:
        order = params.get(name)
        if order is None or len(node.args) > len(order) or any(isinstance(a, ast.Starred) for a in node.args):
            raise DecodeError(f"{name}: positional arguments cannot be named", raw, "positional_arguments")
        for pname, a in zip(order, node.args):
            args[pname] = _literal(a, raw, f"{name}({pname}=..)")
    for kw in node.keywords:
        if kw.arg is None:
            raise DecodeError(f"{name}: **kwargs are not supported", raw, "unsupported_argument")
        if kw.arg in args:
            raise DecodeError(f"{name}: argument {kw.arg!r} given twice", raw, "positional_arguments")
        args[kw.arg] = _literal(kw.value, raw, f"{name}({kw.arg}=..)")
    return {name: args}


def _decode_body(body: str, params: dict[str, list[str]], raw: str) -> list[dict]:
    """One call text: JSON; else Python call(s) `f(a=1)` / `[f(a=1), g()]`; else a Python literal."""
    body = _strip_fence(body)
    if not body:
        raise DecodeError("empty tool call", raw, "empty_call_block")
    try:
        return _calls_from_value(json.loads(body, parse_constant=_reject_constant), raw)
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
      positional arguments are named by the tool's parameter order); a single-quoted Python dict.
      Nested quotes are whatever JSON / Python string syntax allows (`"a \\"b\\""`, `'it\\'s'`, `"it's"`).

    Returns `[]` when the output holds no call at all (plain text, an empty list): the model chose not
    to call, which is correct for bfcl's irrelevance categories.

    Raises `DecodeError` (see its `reason`s) for a call that cannot be decoded: bad or unclosed tags,
    invalid JSON inside tags, JSON that is not call-shaped, an output that starts like a JSON value or a
    call of a known tool but does not parse, or an untagged call of a known tool inside prose.
    """
    if text is None or not text.strip():
        return []
    params = _param_order(tools)
    if "<tool_call" in text or _CLOSE in text:
        calls: list[dict] = []
        for body in _tag_bodies(text):
            calls += _decode_body(body, params, text)
        return calls
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


# ------------------------------------------------------------------------------------------- report
class EntryResult(BaseModel):
    """One entry's verdict. outcome: correct | wrong | no_call | decode_error (single-turn);
    correct | wrong | force_terminated (multi-turn, whose decode errors are counted in `decode_errors`)."""

    id: str
    valid: bool
    outcome: str
    error_type: str = ""
    error: str = ""
    decode_errors: int = 0
    decode_reasons: list[str] = Field(default_factory=list)
    output: str = ""  # the model's raw text (single-turn), truncated
    calls: Any = None  # the decoded calls (single-turn) or per-turn call strings (multi-turn)
    truncated: int = 0  # generations that hit max_new_tokens
    # multi-turn with Private Rehearsal only: mode, n, reenter, rounds, rehearsals, rejected, memory_chars (last
    # round), real_calls_during_rehearsal (always 0: anything else raises IsolationError)
    rehearsal: dict[str, Any] | None = None


class CategoryResult(BaseModel):
    """Per-category numbers. `accuracy` = correct / n, bfcl's definition (decode errors stay in n; for
    irrelevance bfcl counts an undecodable output as "no call", i.e. correct). `decode_errors` counts entries
    with at least one decode error and is never folded into `wrong`."""

    category: str
    n: int = 0
    correct: int = 0
    accuracy: float = 0.0
    wrong: int = 0
    no_call: int = 0
    decode_errors: int = 0
    decode_error_steps: int = 0
    force_terminated: int = 0
    truncated: int = 0  # generations that hit max_new_tokens
    error_types: dict[str, int] = Field(default_factory=dict)
    decode_reasons: dict[str, int] = Field(default_factory=dict)
    entries: list[EntryResult] = Field(default_factory=list)


class BfclReport(BaseModel):
    """The evaluation report: per category, bfcl's groups, and the overall.

    `overall` follows bfcl exactly: a category that was not run counts as accuracy 0 with its full
    dataset size (bfcl's `get_category_score`), so a partial run's overall is a lower bound and
    `complete` is False (also when `limit_per_category` subsampled). `overall_evaluated` is the same formula over only the categories that were run
    (groups without any are dropped and the remaining group weights renormalised), for partial runs.
    """

    categories: dict[str, CategoryResult] = Field(default_factory=dict)
    groups: dict[str, float | None] = Field(default_factory=dict)  # bfcl's rule (missing = 0)
    groups_evaluated: dict[str, float | None] = Field(default_factory=dict)  # over evaluated categories
    overall: float = 0.0
    overall_evaluated: float | None = None
    complete: bool = False
    missing_categories: list[str] = Field(default_factory=list)
    weighting: str = ("bfcl_eval/eval_checker/eval_runner_helper.py::generate_leaderboard_csv: overall = "
                      "10% non-live AST + 10% live AST + 10% irrelevance + 30% multi-turn + 40% agentic")
    limit_per_category: int | None = None

    def table(self) -> str:
        """A text table: per category n / accuracy / correct / wrong / no call / decode errors, then groups."""
        head = f"{'category':<26}{'n':>6}{'acc':>8}{'correct':>9}{'wrong':>7}{'no_call':>9}{'decode_err':>12}"
        lines = [head, "-" * len(head)]
        for c in self.categories.values():
            lines.append(f"{c.category:<26}{c.n:>6}{c.accuracy:>8.3f}{c.correct:>9}{c.wrong:>7}{c.no_call:>9}"
                         f"{c.decode_errors:>12}")
        lines.append("-" * len(head))
        fmt = lambda v: "N/A" if v is None else f"{v:.3f}"
        lines.append(f"{'group':<26}{'bfcl (missing = 0)':>20}{'evaluated only':>16}")
        for g, v in self.groups.items():
            lines.append(f"{g:<26}{fmt(v):>20}{fmt(self.groups_evaluated.get(g)):>16}")
        ev = "N/A" if self.overall_evaluated is None else f"{self.overall_evaluated:.3f}"
        lines.append(f"{'overall (bfcl)':<26}{'':>6}{self.overall:>8.3f}"
                     + ("" if self.complete else f"   (partial run; over evaluated categories: {ev})"))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------- weighting
@dataclass(frozen=True)
class _Node:
    """A node of bfcl's score composition: kind "u" (unweighted mean), "w" (count-weighted mean) or
    "p" (percentage weights); children are nodes or category names."""

    kind: str
    children: tuple
    name: str | None = None
    weights: tuple = ()


# bfcl_eval/eval_checker/eval_runner_helper.py::generate_leaderboard_csv, as a tree.
_OVERALL_TREE = _Node("p", (
    _Node("u", (_Node("u", ("simple_python", "simple_java", "simple_javascript"), "simple"),
                "multiple", "parallel", "parallel_multiple"), "non_live"),
    _Node("w", ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"), "live"),
    _Node("u", ("irrelevance", "live_irrelevance"), "irrelevance"),
    _Node("u", MULTI_TURN_CATEGORIES, "multi_turn"),
    _Node("u", (_Node("u", ("web_search_base", "web_search_no_snippet"), "web_search"),
                _Node("u", ("memory_kv", "memory_vector", "memory_rec_sum"), "memory")), "agentic"),
), "overall", (10, 10, 10, 30, 40))


def _dataset_size(category: str) -> int:
    b = import_bfcl()
    try:
        return len(b.load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False))
    except (OSError, ValueError, KeyError):  # a category bfcl cannot load offline weighs nothing
        return 0


def overall_scores(scores: dict[str, dict], only_evaluated: bool = False) -> tuple[dict | None, dict]:
    """bfcl's overall and group scores from per-category `{"accuracy", "total_count"}` dicts.

    The composition is bfcl's `generate_leaderboard_csv` (eval_runner_helper.py): non-live = unweighted
    mean of simple (itself the unweighted mean of simple_python/java/javascript), multiple, parallel,
    parallel_multiple; live = count-weighted mean of live simple/multiple/parallel/parallel_multiple;
    irrelevance = unweighted mean of irrelevance and live_irrelevance; multi-turn = unweighted mean of its
    four categories; agentic = unweighted mean of web search and memory; overall = 10/10/10/30/40
    percentage weights; every step is computed by bfcl's own `calculate_unweighted_accuracy`,
    `calculate_weighted_accuracy` or `calculate_percentage_weighted_accuracy`. live_relevance is not in
    the overall (bfcl only displays it).

    With `only_evaluated` False a missing category is `{"accuracy": 0, "total_count": <dataset size>}`
    (bfcl's `get_category_score`); with True missing categories are dropped, empty nodes disappear and the
    remaining percentage weights are renormalised (by bfcl's function).
    Returns (overall dict, or None when nothing was evaluated; {group name: accuracy or None}).
    """
    b = import_bfcl()
    groups: dict[str, float | None] = {}

    def visit(spec) -> dict | None:
        if isinstance(spec, str):
            if spec in scores:
                s = scores[spec]
                return {"accuracy": s["accuracy"], "total_count": s["total_count"], "display_accuracy": s["accuracy"]}
            if only_evaluated:
                return None
            return {"accuracy": 0, "total_count": _dataset_size(spec), "display_accuracy": "N/A"}
        vals, ws = [], []
        for i, child in enumerate(spec.children):
            v = visit(child)
            if v is not None:
                vals.append(v)
                ws.append(spec.weights[i] if spec.weights else 1)
        if not vals:
            result = None
        elif spec.kind == "u":
            result = b.calculate_unweighted_accuracy(vals, display_na_if_category_missing=False)
        elif spec.kind == "w":
            result = (b.calculate_weighted_accuracy(vals, display_na_if_category_missing=False)
                      if sum(v["total_count"] for v in vals) else {"accuracy": 0.0, "total_count": 0})
        else:
            result = b.calculate_percentage_weighted_accuracy(vals, ws, display_na_if_category_missing=False)
        if spec.name is not None and spec is not _OVERALL_TREE:
            groups[spec.name] = None if result is None else float(result["accuracy"])
        return result

    return visit(_OVERALL_TREE), groups


def _leaves(spec=_OVERALL_TREE) -> list[str]:
    if isinstance(spec, str):
        return [spec]
    return [c for child in spec.children for c in _leaves(child)]


# ---------------------------------------------------------------------------------------- evaluation
def _generate(engine, prompts: list[list[int]], params: SamplingParams, batch_size: int) -> list[tuple[str, str]]:
    tok = engine.tokenizer
    out: list[tuple[str, str]] = []
    for i in range(0, len(prompts), max(1, batch_size)):
        for comps in engine.generate(prompts[i:i + batch_size], params):
            c = comps[0]
            out.append((tok.decode(c.token_ids, skip_special_tokens=True), c.finish_reason))
    return out


def _history(turn_messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m.get("content", "")} for m in turn_messages]


def _run_single_turn(engine, entries: list[BfclEntry], params: SamplingParams, batch_size: int,
                     keep_output_chars: int) -> CategoryResult:
    tok = engine.tokenizer
    cat = entries[0].category if entries else ""
    res = CategoryResult(category=cat)
    prompts = []
    for e in entries:
        tools = [bfcl_tool_spec(f) for f in e.functions]
        prompts.append(bfcl_prompt_ids(tok, tools, _history(e.question[0]), multi_turn=False))
    for e, (text, finish) in zip(entries, _generate(engine, prompts, params, batch_size)):
        try:
            calls, reason = decode_calls(text, e.functions), ""
        except DecodeError as err:
            calls, reason = None, err.reason
        verdict = score_single_turn(e, calls)
        if reason:
            outcome = "decode_error"
        elif verdict["valid"]:
            outcome = "correct"
        elif not calls:
            outcome = "no_call"
        else:
            outcome = "wrong"
        res.entries.append(EntryResult(
            id=e.id, valid=verdict["valid"], outcome=outcome, error_type=verdict["error_type"],
            error="; ".join(verdict["error"])[:500], decode_errors=1 if reason else 0,
            decode_reasons=[reason] if reason else [], output=text[:keep_output_chars], calls=calls,
            truncated=int(finish == "length")))
    return _tally(res)


def _tally(res: CategoryResult) -> CategoryResult:
    res.n = len(res.entries)
    res.correct = sum(r.valid for r in res.entries)
    res.accuracy = res.correct / res.n if res.n else 0.0
    res.decode_errors = sum(r.decode_errors > 0 for r in res.entries)
    res.decode_error_steps = sum(r.decode_errors for r in res.entries)
    res.wrong = sum(r.outcome == "wrong" for r in res.entries)
    res.no_call = sum(r.outcome == "no_call" for r in res.entries)
    res.force_terminated = sum(r.outcome == "force_terminated" for r in res.entries)
    res.truncated = sum(r.truncated for r in res.entries)
    for r in res.entries:
        if not r.valid and r.error_type:
            res.error_types[r.error_type] = res.error_types.get(r.error_type, 0) + 1
        for reason in r.decode_reasons:
            res.decode_reasons[reason] = res.decode_reasons.get(reason, 0) + 1
    return res


class _Episode:
    """One multi-turn entry being played: our agent on `BfclMultiTurnEnv`, bfcl's inference loop.

    Per user turn (bfcl's `inference_multi_turn_prompting`): the turn's user message (for a miss_func
    holdout turn, bfcl's "additional functions" message, and the revealed tools join the prompt); then
    steps: generate, decode, stop the turn on no call or a decode error, otherwise execute the calls and
    add their results; more than `max_steps` steps in one turn force-terminates the entry.

    With `rehearsal` (mode other than "none"), `rehearse` runs a rehearsal round before the turn's first
    step (every step with `rehearsal.reenter`); its memory enters every prompt until the next round.
    The round sees `messages` (the real history as our `Message`s, one assistant message per executed
    call followed by its result), the current turn's real `Step`s as its prefix, and a `TaskContext`
    whose `first_user_message` is the current turn's request (what SELF-EVAL judges the rehearsal by).
    """

    def __init__(self, entry: BfclEntry, max_steps: int, rehearsal: rehearsal_mod.RehearsalAgent | None = None):
        self.entry, self.max_steps = entry, max_steps
        self.rehearsal = rehearsal if rehearsal is not None and rehearsal.mode != "none" else None
        self.env = BfclMultiTurnEnv()
        self.task = bfcl_task(entry)
        self.env.reset(self.task)
        self.history: list[dict] = []
        self.messages: list[Message] = []  # the same history for rehearsal (module docstring)
        self.turn_steps: list[Step] = []
        self.request = ""
        self.memory = ""
        self.due = False  # a rehearsal round is due before the next step
        self.stats: dict[str, int] = {"rounds": 0, "rehearsals": 0, "rejected": 0}
        self.turn = -1
        self.count = 0
        self.done = False
        self.force_terminated = False
        self.decode_reasons: list[str] = []
        self.truncated = 0
        self._next_turn()

    def _next_turn(self) -> None:
        self.turn += 1
        self.count = 0
        if self.turn >= len(self.entry.question):
            self.done = True
            return
        revealed = self.env.begin_turn()
        msgs = _history(self.entry.question[self.turn])
        if revealed:
            tpl = import_bfcl().DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
            msgs = [{"role": "user", "content": tpl.format(functions=json.dumps(revealed, ensure_ascii=False))}]
        self.history += msgs
        users = [str(m["content"]) for m in msgs if m["role"] == "user"]
        self.messages += [Message(role="user", content=u) for u in users]
        self.request = "\n".join(users) or self.request
        self.turn_steps = []
        self.due = True

    def context(self) -> TaskContext:
        """What a rehearsal may see: the tools visible now, bfcl's policy line, the current request."""
        return TaskContext(task_id=self.task.id, domain="bfcl", policy=self.env.policy(), tools=self.env.tools(),
                           first_user_message=self.request)

    def rehearse(self) -> None:
        """One rehearsal round in imagination if one is due (class docstring); raises
        `rehearsal.IsolationError` if the real env's call counter or state hash changed during it."""
        agent = self.rehearsal
        if agent is None or self.done or not (self.due or agent.reenter):
            return
        self.due = False
        ctx, history, prefix, k = self.context(), list(self.messages), list(self.turn_steps), self.stats["rounds"]
        rnd = rehearsal_mod.isolated(self.env, lambda: agent.rehearse_round(ctx, history, prefix, k))
        self.memory = rnd.memory
        self.stats["rounds"] += 1
        self.stats["rehearsals"] += len(rnd.rehearsals)
        self.stats["rejected"] += len(rnd.rejected)

    def prompt_ids(self, tokenizer) -> list[int]:
        return bfcl_prompt_ids(tokenizer, self.env.tools(), self.history, multi_turn=True, memory=self.memory or None)

    def advance(self, text: str, finish: str) -> None:
        self.truncated += finish == "length"
        self.history.append({"role": "assistant", "content": text})
        try:
            calls = decode_calls(text, self.env.tools())
        except DecodeError as err:
            self.decode_reasons.append(err.reason)
            calls = []
        if not calls:
            if text.strip():
                self.messages.append(Message(role="assistant", content=text.strip()))
            self._next_turn()
            return
        pairs = [(name, args) for c in calls for name, args in c.items()]
        tool_calls = [ToolCall(name=name, arguments=args, id=f"call_{self.turn}_{self.count}_{i}")
                      for i, (name, args) in enumerate(pairs)]
        for call, obs in zip(tool_calls, self.env.step_calls(tool_calls)):
            self.history.append({"role": "tool", "content": obs.content})
            self.messages += [Message(role="assistant", tool_call=call),
                              Message(role="tool", content=obs.content, error=obs.error)]
            self.turn_steps.append(Step(action=call, observation=obs, real_observation=obs))
        self.count += 1
        if self.count > self.max_steps:
            self.force_terminated = True
            self.done = True

    def result(self) -> EntryResult:
        try:
            r = check_multi_turn(self.entry.raw, self.env.turn_calls, self.entry.ground_truth)
        finally:
            self.env.close()
        valid = bool(r.get("valid"))
        outcome = "correct" if valid else ("force_terminated" if self.force_terminated else "wrong")
        reh = None
        if self.rehearsal is not None:
            reh = {"mode": self.rehearsal.mode, "n": self.rehearsal.n, "reenter": self.rehearsal.reenter,
                   **self.stats, "memory_chars": len(self.memory), "real_calls_during_rehearsal": 0}
        return EntryResult(id=self.entry.id, valid=valid, outcome=outcome,
                           error_type="" if valid else str(r.get("error_type", "")),
                           error="" if valid else str(r.get("error_message", ""))[:500],
                           decode_errors=len(self.decode_reasons), decode_reasons=self.decode_reasons,
                           calls=self.env.turn_calls, truncated=self.truncated, rehearsal=reh)


def run_multi_turn(engine, entries: list[BfclEntry], params: SamplingParams, batch_size: int = 4,
                   max_steps: int | None = None, rehearsal: rehearsal_mod.RehearsalAgent | None = None,
                   on_entry: Callable[[EntryResult], None] | None = None) -> CategoryResult:
    """Play multi-turn `entries` (one category) with bfcl's loop and score each with bfcl's checker.

    Up to `batch_size` episodes advance in lockstep (one batched generation per step); `max_steps` per
    user turn (default bfcl's `MAXIMUM_STEP_LIMIT`). `rehearsal`: Private Rehearsal per `_Episode`
    (rounds run one episode at a time, before the batched step). `on_entry` is called with each entry's
    result as soon as it is scored (per-entry resume caches). Entries are reported in input order.
    Raises `rehearsal.IsolationError` if a rehearsal round touched a real environment.
    """
    tok = engine.tokenizer
    steps = import_bfcl().MAXIMUM_STEP_LIMIT if max_steps is None else int(max_steps)
    res = CategoryResult(category=entries[0].category if entries else "")
    pending = list(entries)
    active: list[_Episode] = []
    while pending or active:
        while pending and len(active) < max(1, batch_size):
            active.append(_Episode(pending.pop(0), steps, rehearsal))
        live = [ep for ep in active if not ep.done]
        for ep in live:
            ep.rehearse()
        if live:
            outs = _generate(engine, [ep.prompt_ids(tok) for ep in live], params, batch_size)
            for ep, (text, finish) in zip(live, outs):
                ep.advance(text, finish)
        for ep in [ep for ep in active if ep.done]:
            active.remove(ep)
            res.entries.append(ep.result())
            if on_entry is not None:
                on_entry(res.entries[-1])
    order = {e.id: i for i, e in enumerate(entries)}
    res.entries.sort(key=lambda r: order[r.id])
    return _tally(res)


def sampling_params(engine, max_new_tokens: int = 512, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
    """`evaluate_bfcl`'s sampling: `temperature` (0 = greedy), `max_new_tokens`, `seed`; the tokenizer's
    eos stops."""
    eos = getattr(engine.tokenizer, "eos_token_id", None)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=1, seed=seed,
                          stop_token_ids=(int(eos),) if eos is not None else ())


def evaluate_bfcl(engine, categories: Sequence[str], limit_per_category: int | None = None, *,
                  max_new_tokens: int = 512, temperature: float = 0.0, seed: int = 0, batch_size: int = 8,
                  max_steps: int | None = None, keep_output_chars: int = 2000,
                  progress: Callable[[str, CategoryResult], None] | None = None,
                  rehearsal: rehearsal_mod.RehearsalAgent | None = None) -> BfclReport:
    """Run our policy (`engine`, the `Engine` protocol) on BFCL categories and score them with bfcl.

    Single-turn categories: one generation per entry (batched by `batch_size`), `decode_calls`, then
    `score_single_turn`; never rehearsed. Multi-turn categories: `run_multi_turn` (an `_Episode` per
    entry: bfcl's inference loop on `BfclMultiTurnEnv`, at most `max_steps` steps per turn, default bfcl's
    `MAXIMUM_STEP_LIMIT` = 20; episodes batched in lockstep; Private Rehearsal with `rehearsal`), then
    bfcl's `multi_turn_checker` via `check_multi_turn`.
    Sampling (`sampling_params`): `temperature` (0 = greedy), `max_new_tokens`, `seed`; eos stops.

    Returns a `BfclReport`: per category accuracy, decode errors (separately), error types; bfcl's groups;
    `overall` in bfcl's weighting (`overall_scores`). Raises `UnsupportedCategory` for a category not run,
    `rehearsal.IsolationError` if a rehearsal round touched a real environment.
    """
    cats = [resolve_category(c) for c in categories]
    params = sampling_params(engine, max_new_tokens, temperature, seed)
    report = BfclReport(limit_per_category=limit_per_category)
    for cat in dict.fromkeys(cats):
        entries = load_bfcl(cat, limit_per_category)
        if cat in MULTI_TURN_CATEGORIES:
            res = run_multi_turn(engine, entries, params, batch_size, max_steps, rehearsal)
        else:
            res = _run_single_turn(engine, entries, params, batch_size, keep_output_chars)
        res.category = cat
        report.categories[cat] = res
        if progress is not None:
            progress(cat, res)
    scores = {c: {"accuracy": r.accuracy, "total_count": r.n} for c, r in report.categories.items() if r.n}
    overall, groups = overall_scores(scores)
    report.overall = float(overall["accuracy"]) if overall else 0.0
    evaluated, groups_evaluated = overall_scores(scores, only_evaluated=True)
    report.overall_evaluated = None if evaluated is None else float(evaluated["accuracy"])
    report.groups, report.groups_evaluated = groups, groups_evaluated
    report.missing_categories = [c for c in _leaves() if c not in scores]
    report.complete = not report.missing_categories and limit_per_category is None
    return report
