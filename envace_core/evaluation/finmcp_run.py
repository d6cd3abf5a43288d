"""Running FinMCP-Bench: prompts from the gold history, decoding the model's tool calls, and `evaluate_finmcp`."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from envace_core import EnvaceError
from envace_core.engines.base import Engine, SamplingParams
from envace_core.evaluation.finmcp import (
    PUBLISHED,
    FinMCPSample,
    finmcp_metrics,
    tool_name_counts,
)
from envace_core.roles.act import parse_act
from envace_core.roles.errors import (
    EmptyOutput,
    InvalidArguments,
    MalformedToolCall,
    ParseError,
    UnknownTool,
    format_error,
)
from envace_core.roles.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    compact_openai_schema,
    render_tool,
    template_supports_tools,
)
from envace_core.types import ToolSpec

# ------------------------------------------------------------------------------------------ prompts
_SYSTEM = "You are a financial assistant. Use the tools to get the data you need before answering."
_CALL_FORMAT = (
    "To call a tool, write exactly:\n"
    '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
    "You may write several such blocks in one reply when several calls are needed; the results come in "
    "the next messages. If no tool is needed, answer the user in plain text."
)


def _render_call(c: dict[str, Any]) -> str:
    body = json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def prompt_messages(sample: FinMCPSample, turn: int, native_tools: bool = False) -> list[dict[str, str]]:
    """Chat messages of the ACT prompt for user turn `turn` (0-based) of `sample`.

    A system message (role line; the gold system messages that precede the turn, as "# Instructions";
    unless `native_tools`, the tools rendered by `roles.render_tool` and the `<tool_call>` format that allows
    several calls per reply), then the gold user / assistant / tool messages up to and including the turn's
    user message. Assistant tool calls become `<tool_call>` blocks after the message text; tool results keep
    role "tool" and their content unchanged. Nothing after the turn's user message is included.
    Raises `EnvaceError` for a turn index out of range.
    """
    users = sample.user_turns()
    if not 0 <= turn < len(users):
        raise EnvaceError(f"sample {sample.id!r} has {len(users)} user turn(s); turn {turn} does not exist")
    history = sample.messages[:users[turn] + 1]
    instructions = [m["content"].strip() for m in history if m["role"] == "system" and m["content"].strip()]
    parts = [_SYSTEM]
    if instructions:
        parts.append("# Instructions\n" + "\n\n".join(instructions))
    if not native_tools:
        parts.append("# Tools\n" + "\n".join(render_tool(t) for t in sample.tools) + "\n\n" + _CALL_FORMAT)
    else:
        parts.append(_CALL_FORMAT)
    out = [{"role": "system", "content": "\n\n".join(parts)}]
    for m in history:
        if m["role"] == "system":
            continue
        content = m["content"]
        if m["role"] == "assistant" and m["tool_calls"]:
            calls = "\n".join(_render_call(c) for c in m["tool_calls"])
            content = f"{content.strip()}\n{calls}" if content.strip() else calls
        out.append({"role": m["role"], "content": content})
    return out


def prompt_ids(tokenizer, sample: FinMCPSample, turn: int) -> list[int]:
    """Token ids of `prompt_messages(sample, turn)` with the assistant generation prompt; the tools go to
    the chat template natively when `roles.template_supports_tools(tokenizer)`."""
    native = template_supports_tools(tokenizer)
    kw = {"tools": [compact_openai_schema(t) for t in sample.tools]} if native else {}
    ids = tokenizer.apply_chat_template(prompt_messages(sample, turn, native), add_generation_prompt=True,
                                        tokenize=True, return_dict=False, **kw)
    return [int(i) for i in ids]


# ------------------------------------------------------------------------------------------ decoding
_TAG = re.compile(r"</?tool_call\b[^>]*>?")


@dataclass
class DecodedTurn:
    """The tool calls decoded from one model output (rules: module docstring)."""

    names: list[str]  # predicted tool names, in order, at most max_calls_per_turn
    decode_errors: list[str]  # "Class: message" per failed block (or per broken turn)
    invalid_calls: list[str]  # "Class: message" per well-formed call with unknown tool / invalid arguments
    text_outside: bool = False
    over_cap: int = 0


def decode_tool_calls(text: str, tools: list[ToolSpec], max_calls: int = 10) -> DecodedTurn:
    """Decode every `<tool_call>` block of `text` strictly. Never raises on model output.

    Decode failures (`decode_errors`, "Class: message"): an empty output (`EmptyOutput`); broken tags
    (the whole turn fails); a block that is not a well-formed call (`MalformedToolCall`); a turn without
    our tags that holds a call in another model family's format (`roles.act.parse_act`, strict:
    `ForeignToolCallFormat`, one per turn), which is never "no call". Invalid calls (`invalid_calls`):
    a well-formed call of an unknown tool or with invalid arguments; its name still counts as
    predicted. Text without any call is a plain answer: no tool predicted.
    """
    if not text or not text.strip():
        return DecodedTurn([], [format_error(EmptyOutput("empty output", text or ""))], [])
    if "<tool_call" not in text and TOOL_CALL_CLOSE not in text:
        try:
            parse_act(text, tools, strict=True, lenient=False)  # a message, unless another family's call
        except ParseError as e:  # ForeignToolCallFormat
            return DecodedTurn([], [format_error(e)], [])
        return DecodedTurn([], [], [])  # a plain answer: no tool predicted
    blocks: list[str] = []
    outside: list[str] = []
    pos, open_at = 0, None
    try:
        for m in _TAG.finditer(text):
            tag = m.group(0)
            if tag not in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
                raise MalformedToolCall(f"malformed tag {tag!r}", text)
            if tag == TOOL_CALL_OPEN:
                if open_at is not None:
                    raise MalformedToolCall(f"{TOOL_CALL_OPEN} opened again before it was closed", text)
                outside.append(text[pos:m.start()])
                open_at = m.end()
            else:
                if open_at is None:
                    raise MalformedToolCall(f"{TOOL_CALL_CLOSE} without an opening tag", text)
                blocks.append(text[open_at:m.start()])
                open_at, pos = None, m.end()
        if open_at is not None:
            raise MalformedToolCall(f"unclosed {TOOL_CALL_OPEN}", text)
    except ParseError as e:
        return DecodedTurn([], [format_error(e)], [])
    outside.append(text[pos:])
    out = DecodedTurn([], [], [], text_outside=any(s.strip() for s in outside))
    for body in blocks:
        block = f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"
        try:
            name = parse_act(block, tools, strict=True).tool_call.name
        except (UnknownTool, InvalidArguments) as e:
            out.invalid_calls.append(format_error(e))
            name = json.loads(body)["name"]  # well-formed: parse_act checked JSON and the name first
        except ParseError as e:
            out.decode_errors.append(format_error(e))
            continue
        if len(out.names) < max_calls:
            out.names.append(name)
        else:
            out.over_cap += 1
    return out


# ---------------------------------------------------------------------------------------- evaluation
def group_metrics(samples_out: list[dict], key: str) -> dict[str, dict]:
    groups: dict[str, list] = defaultdict(list)
    for s in samples_out:
        groups[s[key]].append((s["tp"], s["fp"], s["fn"]))
    return {k: finmcp_metrics(v) for k, v in sorted(groups.items())}


def evaluate_finmcp(engine: Engine, samples: Sequence[FinMCPSample], max_new_tokens: int = 512,
                    max_calls_per_turn: int = 10, temperature: float = 0.0, batch_size: int = 8,
                    seed: int | None = 0) -> dict[str, Any]:
    """Run ACT on every user turn of every sample (gold history up to the turn) and score tool names.

    One `engine.generate` per turn prompt (batched `batch_size` prompts at a time, greedy by default);
    output text = `tokenizer.decode(ids, skip_special_tokens=True)`; calls decoded by `decode_tool_calls`.

    Returns `{"n_samples", "n_turns", "micro", "macro"` (as `finmcp_metrics`), `"by_task"`, `"by_diff_level"`
    (`finmcp_metrics` per label), `"decode": {"failed_blocks", "turns_with_failure", "by_class",
    "invalid_calls", "invalid_by_class", "calls_over_cap", "turns_with_text_outside_calls",
    "truncated_turns"}`, `"samples": [{"id", "task", "diff_level", "scenery", "tp", "fp", "fn", "turns":
    [{"turn", "gold", "pred", "decode_errors", "invalid_calls", "text", "finish_reason"}]}]`, `"published"`}.
    Raises `EnvaceError` for no samples or non-positive limits.
    """
    if not samples:
        raise EnvaceError("evaluate_finmcp needs at least one sample")
    if max_new_tokens < 1 or max_calls_per_turn < 1 or batch_size < 1:
        raise EnvaceError("max_new_tokens, max_calls_per_turn and batch_size must be >= 1")
    tok = engine.tokenizer
    jobs = [(si, t) for si, s in enumerate(samples) for t in range(len(s.user_turns()))]
    prompts = [prompt_ids(tok, samples[si], t) for si, t in jobs]
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=1, seed=seed)
    completions = []
    for b in range(0, len(prompts), batch_size):
        completions += [outs[0] for outs in engine.generate(prompts[b:b + batch_size], sp)]

    per_sample: list[dict] = [{"id": s.id, "task": s.task, "diff_level": s.diff_level, "scenery": s.scenery,
                               "tp": 0, "fp": 0, "fn": 0, "turns": []} for s in samples]
    by_class: Counter = Counter()
    invalid_by_class: Counter = Counter()
    dec = {"failed_blocks": 0, "turns_with_failure": 0, "invalid_calls": 0, "calls_over_cap": 0,
           "turns_with_text_outside_calls": 0, "truncated_turns": 0}
    for (si, t), c in zip(jobs, completions):
        s = samples[si]
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        d = decode_tool_calls(text, s.tools, max_calls_per_turn)
        gold = s.gold_names(t)
        tp, fp, fn = tool_name_counts(d.names, gold)
        row = per_sample[si]
        row["tp"] += tp
        row["fp"] += fp
        row["fn"] += fn
        row["turns"].append({"turn": t, "gold": gold, "pred": d.names, "decode_errors": d.decode_errors,
                             "invalid_calls": d.invalid_calls, "text": text, "finish_reason": c.finish_reason})
        dec["failed_blocks"] += len(d.decode_errors)
        dec["turns_with_failure"] += bool(d.decode_errors)
        dec["invalid_calls"] += len(d.invalid_calls)
        dec["calls_over_cap"] += d.over_cap
        dec["turns_with_text_outside_calls"] += d.text_outside
        dec["truncated_turns"] += c.finish_reason == "length"
        by_class.update(e.split(":", 1)[0] for e in d.decode_errors)
        invalid_by_class.update(e.split(":", 1)[0] for e in d.invalid_calls)
    dec["by_class"] = dict(sorted(by_class.items()))
    dec["invalid_by_class"] = dict(sorted(invalid_by_class.items()))
    overall = finmcp_metrics([(r["tp"], r["fp"], r["fn"]) for r in per_sample])
    return {"n_samples": len(samples), "n_turns": len(jobs), "micro": overall["micro"], "macro": overall["macro"],
            "by_task": group_metrics(per_sample, "task"), "by_diff_level": group_metrics(per_sample, "diff_level"),
            "decode": dec, "samples": per_sample, "published": dict(PUBLISHED)}
