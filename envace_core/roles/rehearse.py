"""The REHEARSE role (METHOD.md §1): (history, tool call) → prompt, and the strict parser of the imagined observation."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from envace_core.roles.act import with_first_user
from envace_core.envs.tau2.observations import is_cut, render_observation
from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS, bound_history, bound_text, clean_text
from envace_core.roles.chat import chat_ids
from envace_core.roles.grounding import example_text
from envace_core.roles.errors import EmptyOutput, InvalidRehearsal
from envace_core.roles.json_prefix import cut_head, json_head_viable
from envace_core.roles.strict_json import strict_json
from envace_core.roles.tools import render_tool
from envace_core.types import Message, Observation, TaskContext, ToolCall


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
        ex = "\n".join(example_text(c, o) for c, o in examples)
        parts.append(f"# Examples from other conversations\n{ex}")
    transcript = _transcript(with_first_user(ctx, history))
    call_text = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    parts.append(f"# Conversation\n{transcript}\n\n# Call\n{call_text}\n\nReply with the tool's JSON output only.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def rehearse_prompt_ids(tokenizer, ctx: TaskContext, history: list[Message], call: ToolCall,
                        examples: Sequence[tuple[ToolCall, Observation]] = (),
                        max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS) -> list[int]:
    """Token ids of the REHEARSE prompt (`rehearse_messages`), ending with the generation prompt.

    `examples` (optional, METHOD.md §1 "grounding examples") must come from other tasks and be
    budgeted by the caller. Every tool result, of `history` and of `examples`, is cut to
    `max_observation_tokens` tokens with a visible marker (`roles.bounds.bound_text`, the same cut
    as ACT's; None = uncut).
    """
    history = bound_history(history, tokenizer, max_observation_tokens)
    examples = [(c, o.model_copy(update={"content": bound_text(o.content, tokenizer, max_observation_tokens)}))
                for c, o in examples]
    return chat_ids(tokenizer, rehearse_messages(ctx, history, call, examples))


_FENCE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n(.*?)\n?```\Z", re.DOTALL)


def parse_rehearse(text: str, tool: str = "") -> Observation:
    """Parse one REHEARSE output (METHOD.md §1): a single JSON value, the imagined result of `tool`.

    Surrounding whitespace and one enclosing ``` / ```json fence are accepted; nothing else.
    An object with a truthy "error" key is a tool error: `Observation(error=True)`. `content` is
    the canonical rendering of the parsed value (`envs.tau2.observations.render_observation(tool,
    value)`: compact JSON, key order kept, the tool's view), the same text a real result of `tool`
    has. A result cut with the truncation marker (`roles.bounds.TRUNCATION_MARKER`, as real results
    over the budget are shown and taught) whose head is the start of a JSON value
    (`roles.json_prefix.json_head_viable`) is taken as it is: content = the text, error = whether it
    starts like an error object.

    Raises `EmptyOutput` (empty/whitespace) or `InvalidRehearsal` (anything that is not one JSON value as
    `roles.strict_json.strict_json` reads it: NaN/Infinity, a key repeated in one object (a real tool
    result, a Python dict rendered, never has one) and nesting deeper than `strict_json.MAX_JSON_DEPTH`
    arrays/objects are refused, the message naming the key or the limit).
    """
    if not isinstance(text, str) or not text.strip():
        raise EmptyOutput("empty rehearsal", text if isinstance(text, str) else "")
    body = text.strip()
    fence = _FENCE.match(body)
    if fence:
        body = fence.group(1).strip()
    if is_cut(body):
        if not json_head_viable(cut_head(body)):
            raise InvalidRehearsal("a cut result must be the head of a JSON value before its marker", text)
        return Observation(content=clean_text(body), error=body.startswith('{"error"'))
    try:
        value = strict_json(body)
    except ValueError as e:
        raise InvalidRehearsal(f"not a single JSON value: {e}", text) from None
    error = isinstance(value, dict) and value.get("error") not in (None, False, "")
    try:
        content = render_observation(tool, value)
    except RecursionError:  # parsed just under the recursion limit, too deep to write back
        raise InvalidRehearsal("JSON nested too deeply", text) from None
    return Observation(content=content, error=error)
