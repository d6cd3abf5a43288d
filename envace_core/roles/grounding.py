"""Grounding examples for REHEARSE (METHOD.md §1): the k most similar real transitions of the same tool
from other tasks, under a token budget (cf. DreamGym: top-k real transitions retrieved into the
simulator's prompt).

Similarity is lexical and cheap: a call is the set of its features, the argument names, the word
tokens of its argument values and the character 3-grams of each value (so ids of one shape, e.g.
``#W2378156`` vs ``#W2378157``, are close), and two calls score the Jaccard index of their feature
sets, |A ∩ B| / |A ∪ B|. No network, no second model; ties go to the earlier transition, so the
same index and call always give the same examples.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from envace_core.roles.bounds import bound_text, n_tokens
from envace_core.types import Observation, ToolCall

if TYPE_CHECKING:
    from envace_core.training.transitions import Transition

_WORD = re.compile(r"\w+", re.UNICODE)
# fewest result tokens an example cut to the budget left must keep to be shown (else it is skipped)
MIN_CUT_RESULT_TOKENS = 48


def _values(x) -> list[str]:
    if isinstance(x, dict):
        return [s for v in x.values() for s in _values(v)]
    if isinstance(x, list):
        return [s for v in x for s in _values(v)]
    return [json.dumps(x, ensure_ascii=False) if not isinstance(x, str) else x]


def call_features(call: ToolCall) -> frozenset[str]:
    """The feature set of `call`'s arguments: ``k:<name>`` for each top-level argument name,
    ``w:<word>`` for each lower-cased word of a value, ``c:<3-gram>`` for each character 3-gram of a
    value (values of nested objects and lists included)."""
    feats = {f"k:{k}" for k in call.arguments}
    for v in _values(call.arguments):
        low = v.lower()
        feats.update(f"w:{w}" for w in _WORD.findall(low))
        feats.update(f"c:{low[i:i + 3]}" for i in range(max(len(low) - 2, 0)))
    return frozenset(feats)


def example_text(call: ToolCall, obs: Observation) -> str:
    """One grounding example as REHEARSE's prompt shows it (`roles.rehearse.rehearse_messages`)."""
    return (f"call: {json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}\n"
            f"result: {obs.content.strip()}")


class GroundingIndex:
    """An index of real transitions (`training.transitions.Transition`) by tool, for
    `examples`. Build it from train-split transitions only (the warm-start data): it returns what
    it holds."""

    def __init__(self, transitions: Sequence[Transition]):
        self._by_tool: dict[str, list[tuple[str, str, ToolCall, Observation, frozenset[str]]]] = {}
        for t in transitions:
            self._by_tool.setdefault(t.tool, []).append(
                (t.task_id, t.domain, t.call, t.observation, call_features(t.call)))

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_tool.values())

    def examples(self, task_id: str, call: ToolCall, k: int, max_tokens: int,
                 tokenizer) -> list[tuple[ToolCall, Observation]]:
        """Up to `k` (call, real result) pairs of `call.name` from tasks other than `task_id` (never
        its own; one per distinct arguments) of the same domain (``<domain>/...`` task ids; tau2's
        domains share tool names such as ``transfer_to_human_agents`` whose results differ), most
        similar first (Jaccard of `call_features`, ties by index order), taken greedily while their
        `example_text`s total at most `max_tokens` tokens (`tokenizer`). An example that does not fit
        whole is cut to the budget left (the marker of `roles.bounds.bound_text`, as ACT's
        history cuts real results) when at least `MIN_CUT_RESULT_TOKENS` of its result fit, else
        skipped for a later, shorter one: long records (e.g. retail product details, ~900 tokens) are
        shown in part instead of being replaced by short, less similar error results. [] when k <= 0."""
        if k <= 0 or max_tokens <= 0:
            return []
        q = call_features(call)
        domain = task_id.split("/", 1)[0] if "/" in task_id else None
        ranked = []
        for i, (tid, dom, c, o, f) in enumerate(self._by_tool.get(call.name, ())):
            if tid == task_id or (domain is not None and dom != domain):
                continue
            union = len(q | f)
            ranked.append((-(len(q & f) / union if union else 1.0), i, c, o))
        ranked.sort(key=lambda r: (r[0], r[1]))
        out, used, seen = [], 0, set()
        for _, _, c, o in ranked:
            key = json.dumps(c.arguments, sort_keys=True, ensure_ascii=False)
            if key in seen:  # the same call of another task: one copy is enough
                continue
            cost = n_tokens(tokenizer, example_text(c, o)) + 1
            if used + cost > max_tokens:
                room = max_tokens - used - 1 - n_tokens(tokenizer, example_text(c, Observation(content="")))
                if room < MIN_CUT_RESULT_TOKENS:
                    continue
                o = Observation(content=bound_text(o.content, tokenizer, room, what="tool result"), error=o.error)
                cost = n_tokens(tokenizer, example_text(c, o)) + 1
                if used + cost > max_tokens:  # the seam merged tokens: skip rather than overrun
                    continue
            out.append((c, o))
            seen.add(key)
            used += cost
            if len(out) == k:
                break
        return out
