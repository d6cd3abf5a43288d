"""Trajectory rewards (METHOD.md §2): `replay` (verifiable, default), `actions` (gold-action match),
and the rehearsal-fidelity metric F(ô_t, o_t).

Reward functions have the signature ``fn(task, trajectory) -> RewardResult | None`` and also write
``trajectory.reward / sub_rewards / reward_info``. ``None`` (and ``trajectory.reward = None``) means
"could not be scored": the trajectory's rows are masked in training, never scored 0 (METHOD.md §3).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.envs.tau2 import Tau2Environment
from envace_core.types import Observation, Task, ToolCall, Trajectory

RewardFn = Callable[[Task, Trajectory], RewardResult | None]


# ------------------------------------------------------------------------------------ fidelity


def _leaf(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return json.dumps(v, sort_keys=True)


def flatten_json(value: Any, path: str = "") -> set[tuple[str, str]]:
    """The set of ``(path, leaf)`` pairs of a JSON value: paths join dict keys and list indices with
    ``/`` (lists are order-sensitive); leaves are scalars, empty dicts and empty lists, written as
    canonical JSON (integral floats as ints, so ``1.0 == 1``; ``true != 1``)."""
    if isinstance(value, dict) and value:
        out: set[tuple[str, str]] = set()
        for k, v in value.items():
            out |= flatten_json(v, f"{path}/{k}")
        return out
    if isinstance(value, list) and value:
        out = set()
        for i, v in enumerate(value):
            out |= flatten_json(v, f"{path}/{i}")
        return out
    return {(path, _leaf(value))}


def fidelity(imagined: Observation | None, real: Observation) -> float:
    """Rehearsal fidelity F(ô, o) in [0, 1] (METHOD.md §2: "JSON field-level F1, exact for errors vs
    non-errors").

    - ``imagined is None`` -> 0.0 (nothing was imagined).
    - Exactly one of the two is an error -> 0.0; both errors -> 1.0 (the error *class* must match
      exactly; error texts are not compared, since tau2's texts are free-form).
    - Both contents empty/whitespace -> 1.0.
    - Both parse as JSON: with I, R the `flatten_json` pair sets,
      F1 = 2|I ∩ R| / (|I| + |R|)  (= harmonic mean of precision |I∩R|/|I| and recall |I∩R|/|R|).
    - Otherwise (either is not JSON, e.g. tau2's plain-text results): exact match of the stripped
      strings, 1.0 or 0.0.
    """
    if imagined is None:
        return 0.0
    if imagined.error != real.error:
        return 0.0
    if imagined.error and real.error:
        return 1.0
    a, b = imagined.content.strip(), real.content.strip()
    if not a and not b:
        return 1.0
    try:
        ja, jb = json.loads(a), json.loads(b)
    except (json.JSONDecodeError, ValueError):
        return 1.0 if a == b else 0.0
    fa, fb = flatten_json(ja), flatten_json(jb)
    return 2.0 * len(fa & fb) / (len(fa) + len(fb))


# --------------------------------------------------------------------------------- replay reward


def replay_reward(task: Task, trajectory: Trajectory,
                  env_factory: Callable[[str], ToolEnvironment] = Tau2Environment) -> RewardResult | None:
    """Verifiable reward (METHOD.md §2 `replay`): ACT's tool calls replayed in order in a NEW private
    environment ``env_factory(task.domain)`` reset to `task`, then scored by the benchmark's own
    evaluator (``env.score``; for tau2 see `Tau2Environment.score`).

    Mutates `trajectory`: each action step gets ``real_observation``; when the trajectory is
    imagined (``trajectory.imagined``) and the step has an observation, ``fidelity`` = `fidelity`
    (imagined, real) (real rollouts keep ``fidelity=None``). ``final_message`` is the last step's
    ``message``. Trajectories ending in a parse error are scored on what they did (the format penalty
    is applied elsewhere).

    Returns the RewardResult (also written to ``trajectory.reward/sub_rewards/reward_info``), or
    ``None`` when replay or scoring raised: then ``trajectory.reward is None`` (masked, not 0) and
    ``trajectory.reward_info["error"]`` holds the error. Errors building the environment itself
    (e.g. `UnknownDomainError`) propagate: they are configuration errors.
    """
    env = env_factory(task.domain)
    try:
        env.reset(task)
        for step in trajectory.steps:
            if step.action is None:
                continue
            real = env.step(step.action)
            step.real_observation = real
            if trajectory.imagined and step.observation is not None:
                step.fidelity = fidelity(step.observation, real)
        final_message = trajectory.steps[-1].message if trajectory.steps else ""
        result = env.score(task, trajectory.steps, final_message)
    except Exception as e:  # noqa: BLE001 - any scorer failure masks the trajectory
        trajectory.reward = None
        trajectory.sub_rewards = {}
        trajectory.reward_info = {"error": f"{type(e).__name__}: {e}", "reward_fn": "replay"}
        return None
    fids = [s.fidelity for s in trajectory.steps if s.fidelity is not None]
    result.info.setdefault("reward_fn", "replay")
    result.info["mean_fidelity"] = sum(fids) / len(fids) if fids else None
    result.info["termination"] = trajectory.termination
    trajectory.reward = result.reward
    trajectory.sub_rewards = dict(result.sub_rewards)
    trajectory.reward_info = dict(result.info)
    return result


# -------------------------------------------------------------------------------- actions reward


def _compare_args(task: Task) -> dict[str, list[str] | None]:
    crit = (task.source or {}).get("evaluation_criteria") or {}
    return {a.get("action_id", ""): a.get("compare_args") for a in (crit.get("actions") or [])}


def _matches(gold: ToolCall, pred: ToolCall, keys: list[str] | None) -> bool:
    if gold.name != pred.name:
        return False
    if keys is None:
        return gold.arguments == pred.arguments
    return {k: v for k, v in gold.arguments.items() if k in keys} == \
        {k: v for k, v in pred.arguments.items() if k in keys}


def actions_reward(task: Task, trajectory: Trajectory) -> RewardResult:
    """Gold-action match without execution (METHOD.md §2 `actions`).

    Rule: each gold action (``task.gold_actions``, the assistant-side tau2 actions) is matched by at
    most one of ACT's calls, greedily in gold order over the still-unused calls; a call matches when
    the names are equal and the arguments are equal — on the action's tau2 ``compare_args`` when the
    task's source gives them, otherwise on the whole argument dict (stricter than tau2, which
    compares only the predicted call's keys). Order and extra calls are not penalised.

    ``reward`` = matched / len(gold) (1.0 when there is no gold action);
    ``sub_rewards["ACTION"]`` = 1.0 if every gold action matched else 0.0 (tau2's all-match rule).
    Also written to ``trajectory.reward/sub_rewards/reward_info``.
    """
    gold = task.gold_actions
    preds = trajectory.tool_calls()
    keys = _compare_args(task)
    used = [False] * len(preds)
    matched: list[bool] = []
    for g in gold:
        hit = False
        for j, p in enumerate(preds):
            if not used[j] and _matches(g, p, keys.get(g.id)):
                used[j] = hit = True
                break
        matched.append(hit)
    n = sum(matched)
    frac = n / len(gold) if gold else 1.0
    res = RewardResult(
        reward=frac,
        sub_rewards={"ACTION": 1.0 if n == len(gold) else 0.0},
        info={"reward_fn": "actions", "matched": n, "n_gold": len(gold), "n_calls": len(preds),
              "unmatched_gold": [g.id or g.name for g, m in zip(gold, matched) if not m]},
    )
    trajectory.reward = res.reward
    trajectory.sub_rewards = dict(res.sub_rewards)
    trajectory.reward_info = dict(res.info)
    return res


REWARDS: dict[str, RewardFn] = {"replay": replay_reward, "actions": actions_reward}


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name` in `REWARDS`; EnvaceError naming the valid ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise EnvaceError(f"unknown reward {name!r}; valid rewards: {', '.join(sorted(REWARDS))}") from None
