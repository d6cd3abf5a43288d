"""The task's gold, transposed into a rehearsed world: what ACT should have done given what it was shown.

In an imagined trajectory (METHOD.md §2) REHEARSE answers ACT's calls, so the records ACT sees are
not the real database's: a reservation id, a price or an address is whatever REHEARSE imagined.
Scoring ACT's calls against the real gold then measures whether REHEARSE memorised the database,
not whether ACT acted well. This module rewrites the gold into the world ACT was shown:

1. The gold actions are replayed in a real environment once (`gold_reference`), giving the real
   observation each gold call returned.
2. Every leaf value of a gold call's arguments, and every ``communicate_info`` value the agent must
   tell the user (tau2 task ``evaluation_criteria``), is *located*: if the user's own request or
   scenario states it, it is *literal* (the user knows it, in any world); otherwise the first earlier
   gold observation that holds it gives its *address* — the path of keys and list positions, or the
   position of a mapping key (`locate`). A value found nowhere (a constant such as a cabin class) is
   literal too.
3. In the imagined trajectory, the value at that address of the imagined observation of the call
   that matched that earlier gold call is the *transposed* value (`Transposer`). Gold calls are
   matched greedily in gold order against ACT's calls (same name, transposed arguments equal on
   tau2's ``compare_args``), so a later call's expected arguments come from what ACT was actually
   shown.

A value whose source call ACT never made cannot be transposed: the item *fails* (skipping a required
look-up earns nothing). A value whose address does not exist in the imagined observation (REHEARSE
imagined another shape), or whose source call could itself not be transposed, is *unscorable*:
neither credit nor blame for ACT (REHEARSE's fidelity term,
`rewards.row_rewards` with λ > 0, is where a wrong imagined record costs REHEARSE). A
``communicate_info`` value computed from several fields (a sum) has no address and is unscorable too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from envace_core.types import Observation, Task, Trajectory

# One step of an address: ("key", name, position) looks up `name` in a mapping, or its
# `position`-th key when the name is absent (dynamic keys such as item ids differ between worlds);
# ("index", i, i) a list position; ("mapkey", _, position) the position-th key itself (a value filed
# as a mapping key, e.g. a payment-method id).
Address = tuple[tuple[str, Any, int], ...]
Outcome = Literal["literal", "mapped", "missing_call", "unscorable"]


def canonical(value: Any) -> str:
    """A leaf's comparison form: numbers (and numeric strings) as their float's repr, other strings
    stripped and case-folded, booleans and null as JSON. "1628" == 1628 == 1628.0."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(float(value)) if math.isfinite(float(value)) else str(value)
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        return text.casefold()
    return repr(number) if math.isfinite(number) and text.lower() not in ("nan", "inf", "-inf") else text.casefold()


def observation_value(obs: Optional[Observation]) -> Any:
    """The JSON value an observation's text holds (the text itself when it is not JSON); None for no
    observation or a tool error (an error addresses nothing)."""
    if obs is None or obs.error:
        return None
    try:
        return json.loads(obs.content)
    except ValueError:
        return obs.content


def addresses(value: Any, prefix: Address = ()) -> list[tuple[Address, Any]]:
    """Every (address, leaf) of `value` in document order, mapping keys included as leaves of kind
    "mapkey" (a mapping key is a value ACT can read too)."""
    out: list[tuple[Address, Any]] = []
    if isinstance(value, dict):
        for pos, (k, v) in enumerate(value.items()):
            out.append((prefix + (("mapkey", None, pos),), k))
            out.extend(addresses(v, prefix + (("key", k, pos),)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(addresses(v, prefix + (("index", i, i),)))
    else:
        out.append((prefix, value))
    return out


_MISSING = object()


def resolve(value: Any, address: Address) -> Any:
    """The leaf of `value` at `address` (see `Address`), or `_MISSING` when the shape differs."""
    node = value
    for kind, name, pos in address:
        if kind == "index":
            if not isinstance(node, list) or pos >= len(node):
                return _MISSING
            node = node[pos]
        elif kind == "key":
            if not isinstance(node, dict):
                return _MISSING
            if name in node:
                node = node[name]
            elif pos < len(node):
                node = list(node.values())[pos]
            else:
                return _MISSING
        else:  # mapkey
            if not isinstance(node, dict) or pos >= len(node):
                return _MISSING
            return list(node.keys())[pos]
    return node


def locate(value: Any, sources: list[Any]) -> Optional[tuple[int, Address]]:
    """(index of the first source holding a leaf equal to `value` under `canonical`, its first
    address), or None. Only scalar values are located."""
    if isinstance(value, (dict, list)):
        return None
    want = canonical(value)
    for i, src in enumerate(sources):
        for addr, leaf in addresses(src):
            if not isinstance(leaf, (dict, list)) and canonical(leaf) == want:
                return i, addr
    return None


def gold_reference(task: Task, env_factory) -> list[Any]:
    """The real observation value (`observation_value`) of each of `task.gold_actions`, replayed in
    order in a fresh ``env_factory(task.domain)`` reset to `task`. Errors building the environment
    propagate; a failing gold call gives None (it addresses nothing)."""
    env = env_factory(task.domain)
    env.reset(task)
    return [observation_value(env.step(a)) for a in task.gold_actions]


@dataclass
class Item:
    """One checked item: a gold action (`kind="action"`, `index` into gold_actions) or a
    communicate_info value (`kind="communicate"`); `outcome` "pass" / "fail" / "unscorable"."""

    kind: Literal["action", "communicate"]
    index: int
    outcome: Literal["pass", "fail", "unscorable"]
    expected: Any = None
    why: str = ""


@dataclass
class Transposed:
    """The items of one imagined trajectory (`transpose_and_check`) and the ACT calls the gold
    actions matched (`matched[j]` = index into the trajectory's action steps, or None)."""

    items: list[Item] = field(default_factory=list)
    matched: list[Optional[int]] = field(default_factory=list)

    @property
    def scorable(self) -> list[Item]:
        return [i for i in self.items if i.outcome != "unscorable"]

    def score(self) -> Optional[float]:
        """Passed / scorable items, or None when no item is scorable."""
        s = self.scorable
        return sum(i.outcome == "pass" for i in s) / len(s) if s else None


def _user_text(task: Task) -> str:
    return f"{task.first_user_message}\n{task.user_scenario}".casefold()


def _literal_in_user_text(value: Any, user_text: str) -> bool:
    if isinstance(value, bool) or value is None:
        return False
    text = str(value).strip().casefold()
    return len(text) >= 3 and text in user_text


class Transposer:
    """Transposes gold values of `task` into one imagined trajectory (module docstring, steps 2–3).

    `reference[i]` is the real observation value of gold call i (`gold_reference`); `imagined[k]` the
    observation value ACT was shown for its k-th call; `matched[i]` the k that matched gold call i."""

    def __init__(self, task: Task, reference: list[Any], imagined: list[Any]):
        self.task, self.reference, self.imagined = task, reference, imagined
        self.user_text = _user_text(task)
        self.matched: list[Optional[int]] = []
        self.unscorable: set[int] = set()  # gold calls whose own arguments could not be transposed

    def value(self, gold: Any, before: int) -> tuple[Outcome, Any]:
        """The transposed form of the scalar `gold`, located in gold observations 0..before-1."""
        if _literal_in_user_text(gold, self.user_text):
            return "literal", gold
        found = locate(gold, self.reference[:before])
        if found is None:
            return "literal", gold
        i, addr = found
        k = self.matched[i] if i < len(self.matched) else None
        if k is None:  # never made: ACT's fault, unless the call itself could not be transposed
            return ("unscorable", None) if i in self.unscorable else ("missing_call", None)
        got = resolve(self.imagined[k], addr)
        return ("unscorable", None) if got is _MISSING else ("mapped", got)

    def arguments(self, args: Any, before: int) -> tuple[Outcome, Any]:
        """`args` (any JSON) with every scalar leaf transposed; the worst outcome of its leaves
        (missing_call > unscorable > mapped > literal)."""
        rank = {"literal": 0, "mapped": 1, "unscorable": 2, "missing_call": 3}
        worst: list[Outcome] = ["literal"]

        def walk(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            outcome, out = self.value(v, before)
            if rank[outcome] > rank[worst[0]]:
                worst[0] = outcome
            return out

        out = walk(args)
        return worst[0], out


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, dict):
        return isinstance(got, dict) and expected.keys() == got.keys() and all(_same(v, got[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(got, list) and len(expected) == len(got) and all(_same(a, b) for a, b in zip(expected, got))
    if isinstance(got, (dict, list)):
        return False
    return canonical(expected) == canonical(got)


def compare_args(task: Task) -> dict[str, Optional[list[str]]]:
    """{tau2 action id: the argument names tau2 compares (``compare_args``), None = all} of `task`'s gold."""
    crit = (task.source or {}).get("evaluation_criteria") or {}
    return {a.get("action_id", ""): a.get("compare_args") for a in (crit.get("actions") or [])}


def communicate_info(task: Task) -> list[str]:
    """The task's ``communicate_info`` values (tau2 ``evaluation_criteria``), as strings."""
    crit = (task.source or {}).get("evaluation_criteria") or {}
    return [str(v) for v in (crit.get("communicate_info") or [])]


def transpose_and_check(task: Task, trajectory: Trajectory, reference: list[Any]) -> Transposed:
    """Check one imagined `trajectory` against `task`'s gold transposed into its rehearsed world.

    Gold action j passes when an unused ACT call has its name and its transposed arguments (equal on
    tau2's ``compare_args`` when the task gives them, else on all arguments, leaves compared by
    `canonical`); it fails when no call does or when an argument comes from a call ACT never made;
    it is unscorable when an argument's address is missing from the imagined observation.
    A communicate_info value passes when its transposed form occurs (case-insensitive) in one of
    ACT's messages to the user (tau2's communicate check is the same substring test); its address
    comes from any gold observation; no address (a computed value) → unscorable.

    `reference`: `gold_reference(task, ...)`. Returns the items and the matched calls.
    """
    calls = [s.action for s in trajectory.steps if s.action is not None]
    imagined = [observation_value(s.observation) for s in trajectory.steps if s.action is not None]
    t = Transposer(task, reference, imagined)
    keys = compare_args(task)
    used = [False] * len(calls)
    out = Transposed()
    for j, gold in enumerate(task.gold_actions):
        outcome, expected = t.arguments(gold.arguments, j)
        hit: Optional[int] = None
        if outcome in ("literal", "mapped"):
            only = keys.get(gold.id)
            want = expected if only is None else {k: v for k, v in expected.items() if k in only}
            for k, call in enumerate(calls):
                have = call.arguments if only is None else {a: v for a, v in call.arguments.items() if a in only}
                if not used[k] and call.name == gold.name and _same(want, have):
                    used[k], hit = True, k
                    break
        t.matched.append(hit)
        if outcome == "unscorable":
            t.unscorable.add(j)
            out.items.append(Item("action", j, "unscorable", why="an argument's source is missing from the "
                                                               "imagined observation"))
        elif outcome == "missing_call":
            out.items.append(Item("action", j, "fail", why="an argument comes from a call ACT never made"))
        else:
            out.items.append(Item("action", j, "pass" if hit is not None else "fail", expected=expected,
                                  why="" if hit is not None else "no call matched"))
    messages = "\n".join(s.message for s in trajectory.steps if s.action is None and s.message).casefold()
    for n, info in enumerate(communicate_info(task)):
        outcome, expected = t.value(info, len(reference))
        if outcome == "literal" and locate(info, reference) is None and not _literal_in_user_text(info, t.user_text):
            out.items.append(Item("communicate", n, "unscorable", why="computed value: no address"))
        elif outcome == "missing_call":
            out.items.append(Item("communicate", n, "fail", why="its source call was never made"))
        elif outcome == "unscorable":
            out.items.append(Item("communicate", n, "unscorable", why="address missing from the imagined observation"))
        else:
            said = str(expected).strip().casefold()
            out.items.append(Item("communicate", n, "pass" if said and said in messages else "fail",
                                  expected=expected))
    out.matched = t.matched
    return out


def write_tools(domain: str) -> frozenset[str]:
    """Names of `domain`'s tools that change the database (tau2 ``ToolType.WRITE``); empty for a
    domain tau2 does not know. Builds one tau2 environment per call (callers cache)."""
    from tau2.environment.toolkit import ToolType

    from envace_core.envs.tau2.tasks import tau2_registry

    try:
        tools = tau2_registry().get_env_constructor(domain)().tools
    except Exception:  # noqa: BLE001 - not a tau2 domain: no known writes
        return frozenset()
    return frozenset(n for n in tools.get_tools() if tools.tool_type(n) == ToolType.WRITE)
