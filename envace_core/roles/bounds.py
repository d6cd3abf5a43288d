"""Token budgets of the prompts: long tool results cut with a visible marker, and the prompt-length limit.

One canonical cut (`bound_text`) serves every prompt that shows a tool result: ACT's history and
REHEARSE's transcript and grounding examples (real and imagined observations alike), the SELF-EVAL
summary and rehearsal memory lines (`rehearsal.agent.summarise`) and the judge's transcript. A prompt
that still exceeds its limit after the cuts raises `PromptTooLong`; rollouts turn that into a masked
trajectory (termination "prompt_too_long"), never an exception out of the rollout. The generation budgets
of REHEARSE per tool (`REHEARSE_TOKENS_PER_TOOL`, the default of rollout.max_new_tokens_rehearse_per_tool)
live here too.
"""

from __future__ import annotations

from envace_core import EnvaceError
from envace_core.types import Message

MAX_OBSERVATION_TOKENS = 1024  # default budget of one tool result in a prompt (rollout.max_observation_tokens)
TRUNCATION_MARKER = "…[{what} truncated: {shown} of {total} tokens shown]"

# REHEARSE budget per tool: max(p95 of its gold calls' real results, longest wrong-call error) + 1 (eos), in
# tokens of the bundled SmolLM2 tokenizer under the canonical rendering; 701 gold actions of airline + retail
# train + test and their 671 wrong calls (benchmarks/observation_lengths.py, results/observation_lengths.json).
REHEARSE_TOKENS_PER_TOOL: dict[str, int] = {
    "book_reservation": 422, "calculate": 21, "cancel_pending_order": 560, "cancel_reservation": 380,
    "exchange_delivered_order_items": 665, "find_user_id_by_email": 29, "find_user_id_by_name_zip": 33,
    "get_order_details": 610, "get_product_details": 956, "get_reservation_details": 361, "get_user_details": 410,
    "modify_pending_order_address": 520, "modify_pending_order_items": 583, "modify_pending_order_payment": 327,
    "modify_user_address": 184, "return_delivered_order_items": 651, "search_direct_flight": 481,
    "send_certificate": 33, "transfer_to_human_agents": 27, "update_reservation_baggages": 354,
    "update_reservation_flights": 354, "update_reservation_passengers": 285}


class PromptTooLong(EnvaceError):
    """A prompt of `n_tokens` ids exceeds `limit` (the model's context minus the generation budget,
    or `rollout.max_prompt_tokens`) even after tool results were cut."""

    def __init__(self, role: str, n_tokens: int, limit: int):
        super().__init__(f"{role} prompt has {n_tokens} tokens, more than its limit of {limit}")
        self.role, self.n_tokens, self.limit = role, n_tokens, limit


def clean_text(text: str) -> str:
    """`text` with what no tokenizer can encode replaced: lone surrogates (bytes decoded with
    ``surrogateescape``, broken UTF-16) become "?"; everything else is kept as is."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def n_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` alone: ``len(tokenizer.encode(text, add_special_tokens=False))``."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def bound_text(text: str, tokenizer, max_tokens: int | None, what: str = "tool result") -> str:
    """`text` (`clean_text`) if it has at most `max_tokens` tokens (`n_tokens`), else its head cut at a
    token boundary and followed by the marker ``…[<what> truncated: <k> of <n> tokens shown]``, the
    whole at most `max_tokens` tokens. The head is a prefix of `text` itself (never a re-decoded
    one); a budget smaller than the marker gives the marker alone. `max_tokens` None = no bound.

    Token counts are of the text alone; in a prompt the boundary tokens may merge with their
    neighbours, so the prompt grows by at most `max_tokens` plus a few tokens per cut text.
    """
    text = clean_text(text if isinstance(text, str) else str(text))
    if max_tokens is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    total = len(ids)
    if total <= max_tokens:
        return text
    head_of = _head_cutter(tokenizer, text, ids)
    keep = max_tokens - n_tokens(tokenizer, TRUNCATION_MARKER.format(what=what, shown=max_tokens, total=total))
    for _ in range(8):  # re-encoding the cut text can merge or split a token at the seam: shrink until it fits
        if keep <= 0:
            return TRUNCATION_MARKER.format(what=what, shown=0, total=total)
        out = head_of(keep) + TRUNCATION_MARKER.format(what=what, shown=keep, total=total)
        over = n_tokens(tokenizer, out) - max_tokens
        if over <= 0:
            return out
        keep -= over
    return TRUNCATION_MARKER.format(what=what, shown=0, total=total)


def _head_cutter(tokenizer, text: str, ids: list[int]):
    """k -> the text of the first k tokens: a prefix of `text` itself, cut at the end of token k's
    characters (a fast tokenizer's offsets), so the head is never re-decoded (decoding is lossy for
    characters a vocabulary lacks); else the decoded ids, a partial character dropped."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, TypeError, KeyError, ValueError):
        offsets = None
    if offsets is not None and len(offsets) == len(ids):
        return lambda k: text[:offsets[k - 1][1]]
    return lambda k: tokenizer.decode(ids[:k], skip_special_tokens=False).rstrip("\ufffd")


def bound_history(history: list[Message], tokenizer, max_observation_tokens: int | None) -> list[Message]:
    """`history` with every tool message's content `bound_text`-cut to `max_observation_tokens`
    (other messages unchanged; the given messages are not mutated)."""
    return [m.model_copy(update={"content": bound_text(m.content, tokenizer, max_observation_tokens)})
            if m.role == "tool" else m for m in history]


def check_prompt(role: str, prompt: list[int], limit: int | None) -> list[int]:
    """`prompt` unchanged, or `PromptTooLong` when `limit` is set and ``len(prompt) > limit``."""
    if limit is not None and len(prompt) > limit:
        raise PromptTooLong(role, len(prompt), limit)
    return prompt


def context_tokens(engine) -> int | None:
    """The most tokens (prompt + generation) `engine`'s model takes: ``engine.context_tokens`` when an
    engine states it, else the HF model's ``config.max_position_embeddings`` (`engines.hf.HFEngine`
    rejects longer prompts), else vLLM's ``llm.llm_engine.model_config.max_model_len``; None when
    unknown (e.g. a scripted test engine)."""
    for n in (getattr(engine, "context_tokens", None),
              getattr(getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings", None),
              getattr(getattr(getattr(getattr(engine, "llm", None), "llm_engine", None), "model_config", None),
                      "max_model_len", None)):
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def prompt_limit(engine, max_new_tokens: int, max_prompt_tokens: int | None = None) -> int | None:
    """The most prompt tokens a call with `max_new_tokens` may send to `engine`:
    min(`context_tokens(engine)` − `max_new_tokens`, `max_prompt_tokens`), whichever are known;
    None = no limit known."""
    ctx = context_tokens(engine)
    limits = [x for x in (None if ctx is None else ctx - max_new_tokens, max_prompt_tokens) if x is not None]
    return min(limits) if limits else None
