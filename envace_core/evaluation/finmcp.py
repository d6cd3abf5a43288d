"""FinMCP-Bench adapter: load its JSON task format from a user path, run ACT per user turn, score tool names.

FinMCP-Bench (613 samples, CC-BY-NC-SA) is not on any registry and not reachable offline: the user
points `load_finmcp` at their copy. Format (METHOD.md §6), one sample per JSON object:

    {"id": "...",                 # optional; default "<file stem>#<index>"
     "question": "...",           # the user's request (used as the first user turn if `messages` has none)
     "messages": [...],           # the gold trajectory, OpenAI chat format (system/user/assistant/tool;
                                  #   assistant messages carry `tool_calls`: [{"id", "type": "function",
                                  #   "function": {"name", "arguments": "<JSON text>"}}])
     "task": "single" | "multi step" | "multi turn",
     "diff_level": ..., "scenery": ...,
     "tools": [...]}              # optional, OpenAI function format

Tools offered to the model. A sample's own `tools` field wins. Without one, the schemas are unknown, so the
tools are derived from tool *names* seen in gold assistant messages, each with the permissive schema
`{"type": "object"}` (any argument object is accepted). By default (`derived_tools="dataset"`) a sample
without `tools` is offered the union of gold tool names over every loaded sample without `tools`
(sorted by name): a per-sample derivation (`derived_tools="sample"`) would offer exactly the gold tools of
that sample, which tells the model the answer and inflates tool precision.

Protocol (METHOD.md §6, "the model answers each user turn given the gold history up to that turn"): for
each user message u_j of a sample, the prompt is the gold history up to and including u_j (system messages
become the system prompt's instructions; assistant tool calls are rendered as `<tool_call>` blocks; tool
results are shown as given). Nothing after u_j reaches the prompt. The model generates once; every
`<tool_call>...</tool_call>` block in its output is one predicted call. The gold of turn j is the multiset
of tool names called by the gold assistant messages between u_j and u_{j+1} (or the end).

Metrics (FinMCP-Bench's tool-name metrics, METHOD.md §6): per sample, predicted and gold tool names are
multisets pooled over the sample's turns; TP = |pred ∩ gold| (multiset intersection), FP = |pred| − TP,
FN = |gold| − TP. Tool precision P = TP/(TP+FP), recall R = TP/(TP+FN), TF1 = 2PR/(P+R), each 0 when its
denominator is 0. Micro (the paper's table): P, R, TF1 from counts pooled over samples. Macro: the mean
over samples of each sample's P, R and TF1 (a sample with no gold and no predicted call scores 0 under
the zero-denominator rule). Values are fractions in [0, 1]; the paper prints percentages.

Decoding (never silently a wrong answer): each block is parsed with `roles.parse_act(strict=True)`.
  * A block that is not a well-formed call (bad JSON, no "name", extra keys, ...) and a turn whose tags are
    broken (unclosed / stray / misspelt tag), or an empty output, are *decode failures*: counted per error
    class in the report's `decode` section; for TF1 they predict no tool (so the gold calls of that turn
    count as FN).
  * A well-formed call whose name is not an offered tool (`UnknownTool`) or whose arguments fail the
    tool's schema (`InvalidArguments`) still predicts that tool name (the metric is on names); these are
    counted separately under `decode.invalid_calls`.
  * Text outside the blocks is ignored (counted under `decode.turns_with_text_outside_calls`); output
    without any tool tag is a plain answer and predicts no tool.
  * Only the first `max_calls_per_turn` decoded calls of a turn are scored (the rest: `decode.calls_over_cap`),
    so a degenerate repetition loop cannot add unbounded false positives.

Published (EnvACE paper, EnvACE-8B): FinMCP TF1 46.78, tool precision 54.04 (percent, micro).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from envace_core import EnvaceError
from envace_core.types import ToolSpec

PUBLISHED = {"model": "EnvACE-8B", "tf1": 46.78, "tool_precision": 54.04, "unit": "percent, micro"}

_ROLES = ("system", "user", "assistant", "tool", "function")
PERMISSIVE_SCHEMA: dict[str, Any] = {"type": "object"}


# ---------------------------------------------------------------------------------------------- data
@dataclass
class FinMCPSample:
    """One FinMCP-Bench sample, normalised.

    `messages`: the gold trajectory as dicts `{"role", "content": str, "tool_calls": [{"name", "arguments"}],
    ...}` (role "function" is folded into "tool"; `arguments` is the parsed JSON object, or the raw string
    when it is not valid JSON). `tools`: what the model is offered; `tools_source` is "sample" (the
    sample's `tools` field) or "derived" (gold tool names, permissive schema; see the module docstring).
    `raw` keeps the record as read.
    """

    id: str
    question: str
    messages: list[dict[str, Any]]
    task: str
    diff_level: str
    scenery: str
    tools: list[ToolSpec]
    tools_source: str
    source_file: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def user_turns(self) -> list[int]:
        """Indices in `messages` of the user messages (one evaluated turn each)."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "user"]

    def gold_names(self, turn: int) -> list[str]:
        """Gold tool names of user turn `turn` (0-based): calls in assistant messages after that user
        message and before the next one, in order (a multiset when duplicated)."""
        users = self.user_turns()
        start = users[turn] + 1
        stop = users[turn + 1] if turn + 1 < len(users) else len(self.messages)
        return [c["name"] for m in self.messages[start:stop] if m["role"] == "assistant"
                for c in m.get("tool_calls", [])]


# ------------------------------------------------------------------------------------------ loading
def _scalar_label(rec: dict, key: str, where: str) -> str:
    v = rec.get(key)
    if v is None:
        return "unknown"
    if isinstance(v, (str, int, float)) and not isinstance(v, bool):
        return str(v).strip() or "unknown"
    raise EnvaceError(f"{where}: field {key!r} must be a string or number, got {type(v).__name__}")


def _content(v: Any, where: str) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # OpenAI content parts
        parts = []
        for k, p in enumerate(v):
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise EnvaceError(f"{where}.content[{k}]: expected a text part {{'type': 'text', 'text': ...}}")
        return "".join(parts)
    raise EnvaceError(f"{where}.content: must be a string, a list of text parts or null, got {type(v).__name__}")


def _arguments(v: Any, where: str) -> Any:
    if v is None:
        return {}
    if isinstance(v, dict):
        return v
    if isinstance(v, str):
        if not v.strip():
            return {}
        try:
            return json.loads(v)
        except ValueError:
            return v  # shown as given in the gold history; the metric only uses names
    raise EnvaceError(f"{where}.arguments: must be a JSON object or JSON text, got {type(v).__name__}")


def _function_part(obj: dict[str, Any], where: str, fields: str, why: str = "") -> tuple[dict[str, Any], str, str]:
    """(function object, its error location, stripped name) of an OpenAI-format call or tool.

    OpenAI nests both under "function"; a flat object with the same fields is accepted too.
    """
    fn = obj.get("function", obj)
    fwhere = f"{where}.function" if "function" in obj else where
    if not isinstance(fn, dict):
        raise EnvaceError(f"{fwhere}: must be an object with {fields}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise EnvaceError(f"{fwhere}.name: missing or not a non-empty string{why}")
    return fn, fwhere, name


def _tool_call(tc: Any, where: str) -> dict[str, Any]:
    if not isinstance(tc, dict):
        raise EnvaceError(f"{where}: a tool call must be an object, got {type(tc).__name__}")
    fn, fwhere, name = _function_part(tc, where, "'name' and 'arguments'",
                                      " (a tool call needs a function name)")
    return {"id": str(tc.get("id") or ""), "name": name.strip(),
            "arguments": _arguments(fn.get("arguments"), fwhere)}


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise EnvaceError(f"{where}: a message must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in _ROLES:
        raise EnvaceError(f"{where}.role: {role!r} is not one of {list(_ROLES)}")
    out: dict[str, Any] = {"role": "tool" if role == "function" else role,
                           "content": _content(m.get("content"), where)}
    calls = []
    if role == "assistant":
        tcs = m.get("tool_calls")
        if tcs is not None:
            if not isinstance(tcs, list):
                raise EnvaceError(f"{where}.tool_calls: must be a list")
            calls = [_tool_call(tc, f"{where}.tool_calls[{k}]") for k, tc in enumerate(tcs)]
        if m.get("function_call") is not None:  # legacy single call
            calls.append(_tool_call({"function": m["function_call"]}, f"{where}.function_call"))
    elif m.get("tool_calls"):
        raise EnvaceError(f"{where}.tool_calls: only assistant messages may call tools (role is {role!r})")
    out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _tool_spec(t: Any, where: str) -> ToolSpec:
    if not isinstance(t, dict):
        raise EnvaceError(f"{where}: a tool must be an object in OpenAI function format")
    fn, fwhere, name = _function_part(t, where, "'name', 'description', 'parameters'")
    params = fn.get("parameters", PERMISSIVE_SCHEMA)
    if params is None:
        params = PERMISSIVE_SCHEMA
    if not isinstance(params, dict):
        raise EnvaceError(f"{fwhere}.parameters: must be a JSON-schema object")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise EnvaceError(f"{fwhere}.description: must be a string")
    return ToolSpec(name=name.strip(), description=desc, parameters=dict(params))


def _sample(rec: Any, file: Path, index: int) -> tuple[FinMCPSample, bool]:
    """Returns the sample and whether its tools still need deriving."""
    where = f"{file}: sample {index}"
    if not isinstance(rec, dict):
        raise EnvaceError(f"{where}: must be a JSON object, got {type(rec).__name__}")
    sid = str(rec.get("id", rec.get("sample_id", f"{file.stem}#{index}")))
    where = f"{where} (id {sid!r})"
    msgs = rec.get("messages")
    if msgs is None:
        raise EnvaceError(f"{where}: missing field 'messages' (the gold trajectory in OpenAI chat format)")
    if not isinstance(msgs, list) or not msgs:
        raise EnvaceError(f"{where}: field 'messages' must be a non-empty list of chat messages")
    messages = [_message(m, f"{where}: messages[{j}]") for j, m in enumerate(msgs)]
    question = rec.get("question")
    if question is not None and not isinstance(question, str):
        raise EnvaceError(f"{where}: field 'question' must be a string")
    if not any(m["role"] == "user" for m in messages):
        if not question or not question.strip():
            raise EnvaceError(f"{where}: no user message in 'messages' and no 'question' to start from")
        k = 0
        while k < len(messages) and messages[k]["role"] == "system":
            k += 1
        messages.insert(k, {"role": "user", "content": question, "tool_calls": []})
    if not question:
        question = next(m["content"] for m in messages if m["role"] == "user")
    tools_field = rec.get("tools")
    if tools_field is not None and not isinstance(tools_field, list):
        raise EnvaceError(f"{where}: field 'tools' must be a list of OpenAI function tools")
    tools = [_tool_spec(t, f"{where}: tools[{k}]") for k, t in enumerate(tools_field or [])]
    dup = [n for n, c in Counter(t.name for t in tools).items() if c > 1]
    if dup:
        raise EnvaceError(f"{where}: field 'tools' names {dup} more than once")
    sample = FinMCPSample(
        id=sid, question=question, messages=messages,
        task=_scalar_label(rec, "task", where), diff_level=_scalar_label(rec, "diff_level", where),
        scenery=_scalar_label(rec, "scenery", where), tools=tools,
        tools_source="sample" if tools_field else "derived", source_file=str(file), raw=rec)
    return sample, not tools_field


def _read_records(file: Path) -> list[Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EnvaceError(f"{file}: not UTF-8 text ({e}); FinMCP-Bench data is JSON / JSONL") from None
    if file.suffix == ".jsonl":
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError as e:
                    raise EnvaceError(f"{file}: line {n} is not valid JSON: {e}") from None
        return out
    try:
        data = json.loads(text)
    except ValueError as e:
        raise EnvaceError(f"{file}: not valid JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return data["data"]
    return data if isinstance(data, list) else [data]


def _derived_tool(name: str) -> ToolSpec:
    return ToolSpec(name=name, description="(schema not given in the data; any argument object is accepted)",
                    parameters=dict(PERMISSIVE_SCHEMA))


def load_finmcp(path: str | Path, derived_tools: Literal["dataset", "sample"] = "dataset") -> list[FinMCPSample]:
    """Load FinMCP-Bench samples from a JSON / JSONL file or a directory of them (sorted, recursive).

    A `.json` file holds one sample object, a list of them, or `{"data": [...]}`; a `.jsonl` file holds
    one sample per line. Tools without a `tools` field are derived per `derived_tools` (module docstring).

    Raises `EnvaceError` naming the file, sample and field on malformed input: a missing path, no data
    files, invalid JSON, a missing or empty `messages`, an unknown role, a tool call without a function
    name, malformed `tools`, or a duplicate sample id.
    """
    if derived_tools not in ("dataset", "sample"):
        raise EnvaceError(f"derived_tools must be 'dataset' or 'sample', got {derived_tools!r}")
    p = Path(path).expanduser()
    if not p.exists():
        raise EnvaceError(f"FinMCP-Bench path {p} does not exist (point it at the benchmark's JSON/JSONL files)")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".json", ".jsonl")) if p.is_dir() else [p]
    if not files:
        raise EnvaceError(f"no .json / .jsonl files under {p}")
    samples: list[FinMCPSample] = []
    to_derive: list[FinMCPSample] = []
    seen: dict[str, str] = {}
    for f in files:
        for i, rec in enumerate(_read_records(f)):
            s, derive = _sample(rec, f, i)
            if s.id in seen:
                raise EnvaceError(f"{f}: sample {i}: id {s.id!r} already used in {seen[s.id]}")
            seen[s.id] = str(f)
            samples.append(s)
            if derive:
                to_derive.append(s)
    pool = sorted({c["name"] for s in to_derive for m in s.messages for c in m["tool_calls"]})
    for s in to_derive:
        names = pool if derived_tools == "dataset" else sorted(
            {c["name"] for m in s.messages for c in m["tool_calls"]})
        s.tools = [_derived_tool(n) for n in names]
    return samples


# ------------------------------------------------------------------------------------------ metrics
def tool_name_counts(pred_names: Iterable[str], gold_names: Iterable[str]) -> tuple[int, int, int]:
    """(TP, FP, FN) of predicted vs gold tool names as multisets (FinMCP-Bench, METHOD.md §6).

    TP = Σ_name min(#pred, #gold); FP = |pred| − TP; FN = |gold| − TP. E.g. pred [a, a, b], gold [a, c]
    → (1, 2, 1).
    """
    p, g = Counter(pred_names), Counter(gold_names)
    tp = sum((p & g).values())
    return tp, sum(p.values()) - tp, sum(g.values()) - tp


def _prf(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    prec = tp / (tp + fp) if tp + fp else 0.0
    rec = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    return prec, rec, f1


def finmcp_metrics(per_sample_counts: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """Micro and macro tool precision / recall / TF1 over samples (FinMCP-Bench, METHOD.md §6).

    Args: `per_sample_counts`: one (TP, FP, FN) per sample (pooled over its turns).
    Returns `{"micro": {"precision", "recall", "tf1", "tp", "fp", "fn"}, "macro": {"precision", "recall",
    "tf1"}, "n": number of samples}`, fractions in [0, 1]. P = TP/(TP+FP), R = TP/(TP+FN),
    TF1 = 2PR/(P+R), each 0 on a zero denominator. Micro computes them from pooled counts (the paper's
    table); macro averages each sample's own P, R, TF1 (all 0 when there are no samples).
    Raises `EnvaceError` on a negative count.
    """
    counts = [tuple(int(x) for x in c) for c in per_sample_counts]
    if any(len(c) != 3 or min(c) < 0 for c in counts):
        raise EnvaceError("per-sample counts must be (tp, fp, fn) triples of non-negative integers")
    tp, fp, fn = (sum(c[i] for c in counts) for i in range(3))
    p, r, f = _prf(tp, fp, fn)
    per = [_prf(*c) for c in counts]
    n = len(per)
    macro = {k: (sum(x[i] for x in per) / n if n else 0.0) for i, k in enumerate(("precision", "recall", "tf1"))}
    return {"micro": {"precision": p, "recall": r, "tf1": f, "tp": tp, "fp": fp, "fn": fn},
            "macro": macro, "n": n}
