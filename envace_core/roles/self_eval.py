"""The SELF-EVAL role for sequential Private Rehearsal (METHOD.md §4): prompt and strict parser of the self-evaluation."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from envace_core.roles.chat import chat_ids
from envace_core.roles.tools import one_line
from envace_core.types import TaskContext

# --------------------------------------------------------------------------------------- SELF-EVAL
_HINTS = {"blocker": "<the rule or error that stopped it, or empty>",
          "advice": "<what to do instead next time, one sentence>"}
_SELF_EVAL_SYSTEM = (
    "You review a rehearsal: an imagined attempt by a customer service agent in the {domain} domain "
    "to serve a user, with tool responses that were imagined too. Judge it against the policy. "
    "Reply with ONLY a JSON object, nothing before or after it:\n"
    f'{{{{"reached_goal": true or false, "blocker": "{_HINTS["blocker"]}", '
    f'"advice": "{_HINTS["advice"]}"}}}}'
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
            raw = one_line(self.raw)[:200]
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
    return chat_ids(tokenizer, self_eval_messages(ctx, trajectory_summary))


_BOOL_WORDS = {"true": True, "yes": True, "false": False, "no": False}
_GOAL_RE = re.compile(r'reached[ _]goal"?\s*[:=]\s*"?(true|false|yes|no)\b', re.IGNORECASE)


def _text_field(name: str, text: str) -> str:
    """The value of `"name": "..."` in possibly truncated JSON (up to the closing quote or the end)."""
    m = re.search(rf'"{name}"\s*:\s*"((?:[^"\\]|\\.)*)', text)
    if not m:
        return ""
    try:
        return one_line(json.loads(f'"{m.group(1)}"'))
    except ValueError:  # a dangling escape at a truncation point
        return one_line(m.group(1))


_MAX_STARTS = 256  # `{` positions tried: bounds the work on long `{{{{..` outputs


def _first_object(text: str) -> dict | None:
    """The first complete JSON object in `text` (prose or fences around it are skipped), among the first
    `_MAX_STARTS` `{` positions."""
    dec = json.JSONDecoder()
    for k, m in enumerate(re.finditer(r"\{", text)):
        if k >= _MAX_STARTS:
            break
        try:
            value, _ = dec.raw_decode(text, m.start())
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the interpreter allows
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
    be recovered stays `None` / "", and so does a field that repeats the prompt's placeholder. `raw` is
    `text` unchanged.
    """
    text = text if isinstance(text, str) else ""
    obj = _first_object(text)
    if obj is not None and any(k in obj for k in ("reached_goal", "blocker", "advice")):
        def field(k: str) -> str:
            v = obj.get(k)
            return "" if v is None else _unhinted(k, one_line(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)))
        return SelfEval(_as_bool(obj.get("reached_goal")), field("blocker"), field("advice"), text)
    m = _GOAL_RE.search(text)
    return SelfEval(_BOOL_WORDS[m.group(1).lower()] if m else None,
                    _unhinted("blocker", _text_field("blocker", text)), _unhinted("advice", _text_field("advice", text)),
                    text)


def _unhinted(name: str, value: str) -> str:
    """"" when `value` is the prompt's own placeholder for field `name`, or its start (cut by the token limit),
    in any case: the model copied the template, which says nothing, and a memory line "blocker: <the rule or
    error …>" would read as a finding. Otherwise `value`."""
    v = value.strip().lower()
    return "" if len(v) > 1 and v.startswith("<") and _HINTS[name].startswith(v) else value
