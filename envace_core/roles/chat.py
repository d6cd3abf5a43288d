"""Chat messages to token ids through the model's chat template, and the interaction history rendered as messages."""

from __future__ import annotations

from envace_core.roles.bounds import clean_text
from envace_core.roles.tools import format_tool_call
from envace_core.types import Message


def render_history(history: list[Message]) -> list[dict]:
    """Chat dicts (`role`, `content`) for `history`, in order.

    An assistant message with a `tool_call` becomes the `<tool_call>` text of `format_tool_call`
    (preceded by its `content` on its own line if that is not empty); tool results keep role "tool"
    and their JSON content unchanged. Message `error` flags are not rendered: the content says it.
    """
    out = []
    for m in history:
        content = m.content
        if m.role == "assistant" and m.tool_call is not None:
            call = format_tool_call(m.tool_call)
            content = f"{content.strip()}\n{call}" if content.strip() else call
        out.append({"role": m.role, "content": content})
    return out


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template with the generation prompt.

    Message contents are `roles.bounds.clean_text`-ed first (lone surrogates, e.g. from bytes decoded
    with ``surrogateescape``, cannot be encoded).
    """
    messages = [{**m, "content": clean_text(m["content"])} if isinstance(m.get("content"), str) else m
                for m in messages]
    kw = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False, **kw)
    return [int(i) for i in ids]
