"""Real (history, call) → result transitions of tau2 tasks: what REHEARSE is warmed up on and grounded by.

`real_transitions` replays each task's gold actions in a private real environment
(`envs.tau2.environment.Tau2Environment`, results in their canonical rendering,
`envs.tau2.observations`): transition k has the real trajectory prefix h_k = user message ⊕
(a_1, o_1) ⊕ .. ⊕ (a_{k-1}, o_{k-1}), the gold call a_k and its real result o_k (METHOD.md §2b:
supervised training on real request/response pairs, as MirrorAPI / StableToolBench do). With
``errors=True`` each gold call is preceded by one deterministic wrong call at the same history (its
kind drawn among those that apply), replayed for real, so the real error texts are learned too:

  - ``wrong_id``: an id-like string argument (one with a digit) with its digits rotated
    (d → (d + r) mod 10, r in 1..9 from the seed and the call's position) — "not found" errors;
  - ``missing_argument``: a required argument dropped — tau2's missing-argument error;
  - ``invalid_value``: an enum argument given a value outside its enum (the tool's JSON schema,
    e.g. a cabin or a cancellation reason the policy does not allow) — the tool's refusal.

Only wrong calls whose real result is an error are kept (the kind is the result's, so a wrong call
that happened to succeed is not labelled an error); such a call may have changed the state, so the
environment is then reset and the gold prefix replayed before the next gold call.

Test-split tasks are refused (`TestSplitError`) unless the caller names no forbidden split:
warm-start data never holds a test task (METHOD.md §2b).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from envace_core import EnvaceError
from envace_core.types import Message, Observation, Task, ToolCall

if TYPE_CHECKING:
    from envace_core.envs.base import ToolEnvironment


class TestSplitError(EnvaceError):
    """A task of a forbidden (test) split was given to a builder of warm-start data."""

    __test__ = False  # not a pytest test class


@dataclass
class Transition:
    """One real step: `history` (the real trajectory prefix before `call`, starting with the user's
    first message), `call`, its real `observation` (canonical rendering) and `kind` ("success" /
    "error", = ``observation.error``). `probe` names the wrong-call kind ("" for a gold call)."""

    task_id: str
    domain: str
    tool: str
    history: list[Message]
    call: ToolCall
    observation: Observation
    kind: Literal["success", "error"]
    probe: str = field(default="")


_DIGIT = re.compile(r"\d")


def _rotate_digits(text: str, r: int) -> str:
    return _DIGIT.sub(lambda m: str((int(m.group()) + r) % 10), text)


def _schema(tools: dict[str, Any], name: str) -> dict[str, Any]:
    spec = tools.get(name)
    return spec.parameters if spec is not None else {}


def wrong_calls(call: ToolCall, parameters: dict[str, Any], rng: random.Random) -> list[tuple[str, ToolCall]]:
    """The deterministic wrong variants of `call` (kind, call), in the order wrong_id,
    missing_argument, invalid_value; those that do not apply to the call's arguments are absent.
    `parameters` is the tool's JSON schema; `rng` draws the digit rotation and the argument picked."""
    out: list[tuple[str, ToolCall]] = []
    args = call.arguments
    ids = [k for k, v in args.items() if isinstance(v, str) and _DIGIT.search(v)]
    if ids:
        k = ids[rng.randrange(len(ids))]
        out.append(("wrong_id", call.model_copy(update={"arguments": {**args, k: _rotate_digits(args[k], rng.randint(1, 9))}})))
    required = [k for k in parameters.get("required", []) if k in args]
    if required:
        k = required[rng.randrange(len(required))]
        out.append(("missing_argument", call.model_copy(update={"arguments": {a: v for a, v in args.items() if a != k}})))
    props = parameters.get("properties", {})
    enums = [k for k in args if isinstance(props.get(k), dict) and props[k].get("enum")]
    if enums:
        k = enums[rng.randrange(len(enums))]
        out.append(("invalid_value", call.model_copy(update={"arguments": {**args, k: f"not {args[k]}"}})))
    return out


def check_splits(tasks: Sequence[Task], forbid_splits: Collection[str]) -> None:
    """Raise `TestSplitError` naming the first task whose `split` is in `forbid_splits`."""
    for t in tasks:
        if t.split in forbid_splits:
            raise TestSplitError(f"task {t.id!r} is of the {t.split!r} split: warm-start and grounding "
                                 f"data never hold a test task (forbidden splits: {sorted(forbid_splits)})")


def real_transitions(tasks: Sequence[Task], *, errors: bool = True, seed: int = 0,
                     forbid_splits: Collection[str] = ("test",),
                     env_factory: Callable[[str], ToolEnvironment] | None = None,
                     max_turns: int | None = None) -> list[Transition]:
    """`iter_real_transitions` as a list (same arguments, same order)."""
    return list(iter_real_transitions(tasks, errors=errors, seed=seed, forbid_splits=forbid_splits,
                                      env_factory=env_factory, max_turns=max_turns))


def iter_real_transitions(tasks: Sequence[Task], *, errors: bool = True, seed: int = 0,
                          forbid_splits: Collection[str] = ("test",),
                          env_factory: Callable[[str], ToolEnvironment] | None = None,
                          max_turns: int | None = None) -> Iterator[Transition]:
    """The real transitions of every task's gold actions (tasks without gold actions give none),
    in task order, each gold call preceded by its wrong call (when `errors`).

    `max_turns`: only the first `max_turns` gold calls of a task; `env_factory(domain)`: the real
    environment (default `Tau2Environment`); `seed`: the wrong calls' draws (same seed, same data).
    Raises `TestSplitError` for a task of a split in `forbid_splits` (pass ``()`` to replay test
    tasks, e.g. for held-out measurement), before anything is replayed. Lazy: a task's environment
    is built only when its first transition is asked for, so taking the first few is cheap.
    """
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.tasks import domain_static

    check_splits(tasks, forbid_splits)
    factory = env_factory or Tau2Environment
    for task in tasks:
        if not task.gold_actions:
            continue
        tools = {t.name: t for t in domain_static(task.domain)[0]}
        tools.update({t.name: t for t in task.tools_added})
        rng = random.Random(f"{seed}:{task.id}")
        env = factory(task.domain)
        env.reset(task)
        history = [Message(role="user", content=task.first_user_message)]
        turns = task.gold_actions[:max_turns] if max_turns is not None else task.gold_actions
        done: list[ToolCall] = []
        for k, gold in enumerate(turns):
            call = ToolCall(name=gold.name, arguments=gold.arguments, id=f"call_{k}")
            variants = wrong_calls(call, _schema(tools, call.name), rng) if errors else []
            if variants:
                kind, wrong = variants[rng.randrange(len(variants))]
                obs = env.step(wrong)
                if obs.error:
                    yield Transition(task.id, task.domain, call.name, list(history), wrong, obs, "error", kind)
                else:  # the wrong call succeeded and may have changed the state: back to the gold prefix
                    env.reset(task)
                    for c in done:
                        env.step(c)
            obs = env.step(call)
            yield Transition(task.id, task.domain, call.name, list(history), call, obs,
                             "error" if obs.error else "success")
            done.append(call)
            history = history + [Message(role="assistant", tool_call=call),
                                 Message(role="tool", content=obs.content, error=obs.error)]
