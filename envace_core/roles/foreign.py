"""Tool calls written in other model families' tool formats: recognise them (and decode them for a lenient parser).

Our format is `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (METHOD.md §1). A policy started from
another family, or prompted without our format, writes calls in that family's native format; a parser that
only looks for `<tool_call>` would read such text as a message to the user. `find_foreign_call` recognises the
shapes below (the open-source tool parsers of vLLM, `vllm/tool_parsers/*_tool_parser.py`, and the models'
own chat templates), so that strict parsers can report them as `errors.ForeignToolCallFormat`.

Markers are searched anywhere in the text; the structural shapes (`json_call`, `pythonic`, ...) are searched
anywhere too, `pythonic` and `xml_tool_tag` only for the given tool names. Decoding is best effort:
`ForeignCall.calls` is None for a recognised but undecodable call; values of XML-style parameters are JSON
when they parse as JSON, else the stripped text.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

#: format name -> where it comes from (the model family / vLLM tool parser) and what it looks like.
FOREIGN_FORMATS: dict[str, str] = {
    "llama3_python_tag": 'Llama 3.1+ (vLLM llama3_json): <|python_tag|>{"name": .., "parameters": {..}} or f.call(..)',
    "mistral": 'Mistral (vLLM mistral): [TOOL_CALLS][{"name": .., "arguments": {..}}] or [TOOL_CALLS]f[ARGS]{..}',
    "function_tag": "Llama 3.1 custom / Qwen3-Coder / Seed-OSS: <function=f>{..}</function> or <parameter=k>v",
    "glm4": "GLM-4.5 (vLLM glm45): f<arg_key>k</arg_key><arg_value>v</arg_value>",
    "tagged_json": "Granite, Jamba, MiniMax, Hunyuan, Nemotron, Glaive, Functionary, LFM2: <tool_calls>, "
                   "<|tool_call|>, <function_call>, <functioncall>, <TOOLCALL>, <tool_use>, ... around JSON",
    "phi4_mini": 'Phi-4-mini (vLLM phi4_mini_json): functools[{"name": .., "arguments": {..}}]',
    "internlm": 'InternLM2 (vLLM internlm): <|action_start|><|plugin|>{"name": .., "parameters": ..}<|action_end|>',
    "deepseek": "DeepSeek-V3/V3.1 (vLLM deepseek_v3/v31): <｜tool▁call▁begin｜>..<｜tool▁sep｜>..",
    "kimi_k2": "Kimi-K2 (vLLM kimi_k2): <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{..}",
    "gpt_oss": "gpt-oss harmony (vLLM openai): to=functions.f <|constrain|>json<|message|>{..}<|call|>",
    "functiongemma": "FunctionGemma: <start_function_call>call:f{k:<escape>v<escape>}<end_function_call>",
    "anthropic_xml": '<function_calls><invoke name="f"><parameter name="k">v</parameter></invoke>',
    "openai_tool_calls": '{"tool_calls": [{"type": "function", "function": {"name": .., "arguments": "{..}"}}]}',
    "openai_function": '{"type": "function", "function": {"name": .., "arguments": ..}}',
    "llama3_json": 'Llama 3 JSON without the tag: {"name": .., "parameters": {..}}',
    "json_call": 'a bare JSON call or list of calls (Hermes without tags, xLAM): {"name": .., "arguments": ..}',
    "json_function": 'BFCL/Gorilla JSON: {"function": .., "parameters"|"arguments": ..}',
    "agent_json": 'Cohere / LangChain JSON: {"tool_name"|"tool"|"action": .., "parameters"|"tool_input"|..: ..}',
    "react": "ReAct: Action: f / Action Input: {..}",
    "pythonic": "Python call syntax (Llama 3.2/4 pythonic, Gemma tool_code, ToolACE): f(k=v) or [f(k=v), ..]",
    "xml_tool_tag": "the tool's name as an XML tag: <f><k>v</k></f>",
}


@dataclass
class ForeignCall:
    """A recognised foreign-format call: `format` (a `FOREIGN_FORMATS` key), the decoded `(name, arguments)`
    pairs in output order (None when recognised but not decodable; arguments as the model wrote them, not
    validated) and `outside`, the text outside the call(s)."""

    format: str
    calls: list[tuple[str, Any]] | None
    outside: str = field(default="", repr=False)


_MAX_CANDIDATES = 256  # JSON start positions tried per text (bounds the work on `{{{{..` inputs)
_NAME_KEYS = ("name", "function", "tool_name", "tool", "action", "recipient_name")
_ARG_KEYS = ("arguments", "parameters", "args", "tool_input", "action_input", "input")


# ------------------------------------------------------------------------------------ value decoding
def _loads(s: str) -> Any:
    """`json.loads`, raising ValueError for everything that is not one JSON value (deep nesting included)."""
    try:
        return json.loads(s)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _value(s: str) -> Any:
    s = s.strip()
    try:
        return _loads(s)
    except ValueError:
        return s


def _args(v: Any) -> Any:
    if isinstance(v, str):  # OpenAI's wire form: arguments as a JSON string
        try:
            return _loads(v) if v.strip() else {}
        except ValueError:
            return v
    return {} if v is None else v


def _call_of(obj: Any) -> tuple[str, Any] | None:
    """`(name, arguments)` of one call-shaped JSON object, else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        return _call_of(obj["function"])
    name = next((obj[k] for k in _NAME_KEYS if isinstance(obj.get(k), str) and obj[k].strip()), None)
    if name is None:
        return None
    key = next((k for k in _ARG_KEYS if k in obj), None)
    return name.strip().removeprefix("functions."), _args(obj.get(key) if key else None)


def _shape(obj: Any, tool_names: Collection[str]) -> str | None:
    """The `FOREIGN_FORMATS` name of a call-shaped JSON value, else None. A bare `{"name": ..}` counts
    only when it names a known tool (`{"name": "John"}` is data)."""
    if isinstance(obj, list):  # a list of calls (one level: a list of lists is not a call)
        shapes = {_shape(x, tool_names) if isinstance(x, dict) else None for x in obj}
        return shapes.pop() if obj and len(shapes) == 1 and None not in shapes else None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("tool_calls"), list) and obj["tool_calls"] and \
            all(_call_of(x) is not None for x in obj["tool_calls"]):
        return "openai_tool_calls"
    if isinstance(obj.get("function"), dict) and _call_of(obj["function"]) is not None:
        return "openai_function"
    has_args = any(k in obj for k in _ARG_KEYS)
    if isinstance(obj.get("name"), str):
        if "parameters" in obj:
            return "llama3_json"
        if has_args or obj["name"] in tool_names:
            return "json_call"
        return None
    if isinstance(obj.get("function"), str) and has_args:
        return "json_function"
    if any(isinstance(obj.get(k), str) for k in ("tool_name", "tool", "action", "recipient_name")) and has_args:
        return "agent_json"
    return None


def _json_values(s: str) -> list[Any] | None:
    """One or several JSON values separated by whitespace, `;` or `,` (Llama 3 separates calls by `; `)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(s) and s[i] in " \t\r\n;,":
            i += 1
        if i >= len(s):
            return out or None
        try:
            v, i = dec.raw_decode(s, i)
        except (ValueError, RecursionError):
            return None
        out.extend(v if isinstance(v, list) else [v])


def _json_calls(s: str) -> list[tuple[str, Any]] | None:
    vals = _json_values(_unfence(s))
    if not vals:
        return None
    out = []
    for v in vals:
        if isinstance(v, dict) and isinstance(v.get("tool_calls"), list):
            inner = [_call_of(x) for x in v["tool_calls"]]
        else:
            inner = [_call_of(v)]
        if any(c is None for c in inner):
            return None
        out += inner
    return out


def dotted_name(node: ast.AST) -> str | None:
    """The dotted name of a call's function node (`a.b.c` for Attribute(Attribute(Name a, b), c)), or None
    when it is not made of names only (a subscript, a call, a literal...)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _py_calls(s: str) -> list[tuple[str, Any]] | None:
    """Python call syntax `f(k=v)` / `[f(k=v), g()]` (keyword literals only; Llama's built-in `f.call(..)`)."""
    try:
        tree = ast.parse(_unfence(s).strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = [tree] if isinstance(tree, ast.Call) else list(getattr(tree, "elts", None) or [])
    if not nodes or not all(isinstance(n, ast.Call) for n in nodes):
        return None
    out = []
    for n in nodes:
        name = dotted_name(n.func)
        if name is None or n.args or any(k.arg is None for k in n.keywords):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in n.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        out.append((name.removesuffix(".call"), args))
    return out


def _payload_calls(s: str) -> list[tuple[str, Any]] | None:
    return _json_calls(s) or _py_calls(s)


_FENCE = re.compile(r"\A\s*```[\w-]*[ \t]*\n?(.*?)\n?```\s*\Z", re.DOTALL)


def _unfence(s: str) -> str:
    m = _FENCE.match(s)
    return m.group(1) if m else s


def _xml_params(s: str, pattern: str) -> dict[str, Any]:
    return {m.group(1).strip(): _value(m.group(2)) for m in re.finditer(pattern, s, re.DOTALL)}


# ------------------------------------------------------------------------------------ the detectors
# Each detector: (text, tool names) -> (format, calls or None, [(start, end) spans of the call text]) or None.
Detector = Callable[[str, Collection[str]], "tuple[str, list | None, list[tuple[int, int]]] | None"]


def _python_tag(text, names):
    m = re.search(r"<\|python_tag\|>(.*?)(?:<\|eom_id\|>|<\|eot_id\|>|\Z)", text, re.DOTALL)
    return m and ("llama3_python_tag", _payload_calls(m.group(1)), [m.span()])


def _mistral(text, names):
    m = re.search(r"\[TOOL_CALLS\](.*?)(?:</s>|\Z)", text, re.DOTALL)
    if not m:
        return None
    body = m.group(1)
    if "[ARGS]" not in body:  # [TOOL_CALLS][{"name": .., "arguments": ..}, ..]
        return "mistral", _json_calls(body), [m.span()]
    calls: list | None = []  # v11+: [TOOL_CALLS]f[ARGS]{..}[TOOL_CALLS]g[ARGS]{..}
    for part in (p for p in body.split("[TOOL_CALLS]") if p.strip()):
        name, sep, args = part.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        try:
            calls.append((name, _loads(args.strip())))
        except ValueError:
            calls = None
        if calls is None or not sep or not name:
            calls = None
            break
    return "mistral", calls or None, [m.span()]


def _function_tag(text, names):
    hits = list(re.finditer(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", text, re.DOTALL))
    if not hits:
        return None
    calls: list | None = []
    for m in hits:
        body = m.group(2).strip()
        if "<parameter=" in body:
            args = _xml_params(body, r"<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)")
        else:
            try:
                args = _loads(body) if body else {}
            except ValueError:
                calls = None
                break
        calls.append((m.group(1).strip(), args))
    spans = [m.span() for m in hits]
    seed = re.search(r"</?seed:tool_call>", text)
    if seed:  # Seed-OSS wraps the function tags in <seed:tool_call>..</seed:tool_call>
        spans += [s.span() for s in re.finditer(r"</?seed:tool_call>", text)]
    return "function_tag", calls, spans


def _glm4(text, names):
    at = text.find("<arg_key>")
    if at < 0:
        return None
    head = re.search(r"([\w.-]+)\s*\Z", text[max(0, at - 200):at])  # the name just before the first key
    pairs = list(re.finditer(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", text[at:], re.DOTALL))
    if not head or not pairs:
        return "glm4", None, [(0, len(text))]
    args = {p.group(1).strip(): _value(p.group(2)) for p in pairs}
    return "glm4", [(head.group(1), args)], [(at - len(head.group(0)), at + pairs[-1].end())]


_TAGS = ("tool_calls", "tool_call", "toolcall", "tool-call", "tool_use", "tools", "function_call", "functioncall",
         "function_calls", "tool_call_start", "TOOLCALL")
_TAG_RE = re.compile(r"<\|?(" + "|".join(re.escape(t) for t in _TAGS) + r")\|?>", re.IGNORECASE)


def _tagged_json(text, names):
    for m in _TAG_RE.finditer(text):
        tag = m.group(0)
        if tag == "<tool_call>" or tag.lower() == "<function_calls>" and "<invoke" in text:
            continue  # ours, or the Anthropic XML detector's
        end = re.compile(r"(?:</\|?" + re.escape(m.group(1)) + r"\|?>|<\|" + re.escape(m.group(1).removesuffix(
            "_start")) + r"_end\|>|<\|eom_id\|>|<\|eot_id\|>)", re.IGNORECASE).search(text, m.end())
        stop = end.start() if end else len(text)
        return "tagged_json", _payload_calls(text[m.end():stop]), [(m.start(), end.end() if end else len(text))]
    return None


def _phi4(text, names):
    m = re.search(r"functools\s*(\[.*\])", text, re.DOTALL)
    return m and ("phi4_mini", _json_calls(m.group(1)), [m.span()])


def _internlm(text, names):
    m = re.search(r"(?:<\|action_start\|>)?<\|plugin\|>(.*?)(?:<\|action_end\|>|\Z)", text, re.DOTALL)
    return m and ("internlm", _json_calls(m.group(1)), [m.span()])


_DS = r"[|｜]"


def _deepseek(text, names):
    if not re.search(rf"<{_DS}tool▁calls?▁begin{_DS}>", text):
        return None
    calls: list | None = []
    for m in re.finditer(rf"<{_DS}tool▁call▁begin{_DS}>(.*?)<{_DS}tool▁sep{_DS}>(.*?)"
                         rf"(?:<{_DS}tool▁call▁end{_DS}>|\Z)", text, re.DOTALL):
        head, body = m.group(1).strip(), m.group(2).strip()
        if head == "function":  # V3: function<sep>name\n```json\n{..}\n```
            name, _, body = body.partition("\n")
        else:  # V3.1: name<sep>{..}
            name = head
        try:
            calls.append((name.strip(), _loads(_unfence(body).strip())))
        except ValueError:
            calls = None
            break
    return "deepseek", calls or None, [(0, len(text))]


def _kimi(text, names):
    hits = list(re.finditer(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*"
                            r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|\Z)", text, re.DOTALL))
    if not hits and "<|tool_calls_section_begin|>" not in text and "<|tool_call_begin|>" not in text:
        return None
    try:
        calls = [(m.group(1), _loads(m.group(2).strip())) for m in hits] or None
    except ValueError:
        calls = None
    return "kimi_k2", calls, [(0, len(text))]


def _gpt_oss(text, names):
    m = re.search(r"to=functions\.([\w.-]+)[^<]*(?:<\|constrain\|>\s*\w+\s*)?(?:<\|message\|>(.*?)"
                  r"(?:<\|call\|>|\Z))?", text, re.DOTALL)
    if not m:
        return None
    try:
        calls = [(m.group(1), _loads(m.group(2).strip()))] if m.group(2) is not None else None
    except ValueError:
        calls = None
    start = text.rfind("<|start|>", 0, m.start())
    return "gpt_oss", calls, [(start if start >= 0 else m.start(), m.end())]


def _functiongemma(text, names):
    m = re.search(r"<start_function_call>\s*call:([\w.-]+)\s*\{(.*?)\}\s*(?:<end_function_call>|\Z)", text,
                  re.DOTALL)
    if not m:
        return ("functiongemma", None, [(0, len(text))]) if "<start_function_call>" in text else None
    args = {k.group(1): _value(k.group(2) if k.group(2) is not None else k.group(3))
            for k in re.finditer(r"(\w+)\s*:\s*(?:<escape>(.*?)<escape>|([^,]*))", m.group(2), re.DOTALL)}
    return "functiongemma", [(m.group(1), args)], [m.span()]


def _anthropic(text, names):
    hits = list(re.finditer(r"<invoke\s+name=[\"']([^\"']+)[\"']\s*>(.*?)(?:</invoke>|\Z)", text, re.DOTALL))
    if not hits:
        return None
    calls = [(m.group(1), _xml_params(m.group(2), r"<parameter\s+name=[\"']([^\"']+)[\"']\s*>(.*?)</parameter>"))
             for m in hits]
    spans = [m.span() for m in hits] + [s.span() for s in re.finditer(r"</?function_calls>", text)]
    return "anthropic_xml", calls, spans


def _json_anywhere(text, names):
    dec = json.JSONDecoder()
    for k, m in enumerate(re.finditer(r"[\[{]", text)):
        if k >= _MAX_CANDIDATES:
            break
        try:
            value, end = dec.raw_decode(text, m.start())
        except (ValueError, RecursionError):
            continue
        fmt = _shape(value, names)
        if fmt is not None:
            return fmt, _json_calls(text[m.start():end]), [(m.start(), end)]
    return None


def _react(text, names):
    m = re.search(r"^[ \t]*Action[ \t]*:[ \t]*([\w.-]+)[ \t]*\r?\n[ \t]*Action[ \t]+Input[ \t]*:[ \t]*(.*?)"
                  r"(?=^[ \t]*Observation[ \t]*:|\Z)", text, re.DOTALL | re.MULTILINE)
    if not m:
        return None
    try:
        calls = [(m.group(1), _loads(_unfence(m.group(2)).strip()))]
    except ValueError:
        calls = None
    return "react", calls, [m.span()]


def _pythonic(text, names):
    if not names:
        return None
    alts = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    m = re.search(rf"(?<![\w.])({alts})\s*\(", text)
    if not m:
        return None
    whole = _py_calls(text.strip())
    if whole is not None and all(n in names for n, _ in whole):
        return "pythonic", whole, [(0, len(text))]
    start = m.start()
    if start > 0 and text[:start].rstrip().endswith("["):  # a list of calls: [f(..), g(..)]
        start = text[:start].rstrip().rfind("[")
    for k, close in enumerate(re.finditer(r"[)\]]", text[start:])):
        if k >= _MAX_CANDIDATES:
            break
        calls = _py_calls(text[start:start + close.end()])
        if calls is not None:
            return "pythonic", calls, [(start, start + close.end())]
    return "pythonic", None, [(m.start(), len(text))]


def _xml_tool_tag(text, names):
    for n in sorted(names, key=len, reverse=True):
        m = re.search(rf"<{re.escape(n)}(?:\s[^>]*)?>(.*?)(?:</{re.escape(n)}>|\Z)", text, re.DOTALL)
        if m:
            body = m.group(1).strip()
            if body.startswith(("{", "[")):
                try:
                    return "xml_tool_tag", [(n, _loads(body))], [m.span()]
                except ValueError:
                    return "xml_tool_tag", None, [m.span()]
            return "xml_tool_tag", [(n, _xml_params(body, r"<([\w-]+)>(.*?)</\1>"))], [m.span()]
    return None


# Markers first (unambiguous), then structural shapes.
MARKER_DETECTORS: tuple[Detector, ...] = (_python_tag, _mistral, _deepseek, _kimi, _gpt_oss, _functiongemma,
                                          _internlm, _anthropic, _function_tag, _glm4, _tagged_json, _phi4)
SHAPE_DETECTORS: tuple[Detector, ...] = (_json_anywhere, _react, _pythonic, _xml_tool_tag)


def _outside(text: str, spans: list[tuple[int, int]]) -> str:
    out, pos = [], 0
    for a, b in sorted(spans):
        if a > pos:
            out.append(text[pos:a])
        pos = max(pos, b)
    out.append(text[pos:])
    return " ".join(s.strip() for s in out if s.strip())


def find_foreign_call(text: str, tool_names: Collection[str] = (), markers_only: bool = False) -> ForeignCall | None:
    """The first foreign-format tool call in `text` (`FOREIGN_FORMATS`), or None when there is none.

    `tool_names` (the task's tools) enables the `pythonic` and `xml_tool_tag` shapes and lets a bare
    `{"name": <tool>}` count; with `markers_only`, only the marker formats (special tokens / tags, not plain
    JSON or Python) are looked for. Never raises for any `str`.
    """
    names = set(tool_names or ())
    for det in MARKER_DETECTORS + (() if markers_only else SHAPE_DETECTORS):
        hit = det(text, names)
        if hit:
            fmt, calls, spans = hit
            return ForeignCall(format=fmt, calls=calls, outside=_outside(text, spans))
    return None


def describe(call: ForeignCall) -> str:
    """One line for an error message: the format's name and what it looks like."""
    return f"{call.format} ({FOREIGN_FORMATS[call.format]})"
