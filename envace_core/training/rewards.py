"""Trajectory rewards (METHOD.md §2): `replay` (verifiable, default), `actions` (gold-action match),
`judge` (an LLM judge over the task's checklist, `envace_core.judge`), the rehearsal-fidelity metric
F(ô_t, o_t), and the per-row rewards GRPO uses (optional fidelity bonus for REHEARSE rows;
`rows.rows_from_group` puts them on the training rows).

Reward functions have the signature ``fn(task, trajectory, **resources) -> RewardResult | None`` and
also write ``trajectory.reward / sub_rewards / reward_info``. ``None`` (and ``trajectory.reward =
None``) means "could not be scored": the trajectory's rows are masked in training, never scored 0
(METHOD.md §3). `REWARDS` is the registry (name -> function); adding a reward is one function
decorated with ``@register_reward("name")``; `get_reward_fn` binds the keyword resources a function
declares (e.g. the judge's engine), and `reward_fn_from_config` builds the configured one.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from envace_core import EnvaceError
from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.training.transpose import compare_args
from envace_core.types import Observation, Role, Task, ToolCall, Trajectory

if TYPE_CHECKING:
    from envace_core.config import RunConfig
    from envace_core.engines.base import Engine


RewardFn = Callable[..., RewardResult | None]

# Terminations tau2 scores (AGENT_STOP / USER_STOP); any other keeps no reward (tau2's
# evaluate_simulation gives 0 to e.g. MAX_STEPS): see `score_trajectory`.
CLEAN_TERMINATIONS = ("agent_message", "user_stop")
# The run ended on a tool call whose result never came back (`ends_in_unanswered_call`): the agent
# did not finish, so it keeps no reward (tau2's evaluator cannot even replay such a message list).
DANGLING_TOOL_CALL = "dangling_tool_call"


def _default_env_factory(domain: str) -> ToolEnvironment:
    from envace_core.envs.tau2.environment import Tau2Environment

    return Tau2Environment(domain)


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


def replay_observations(task: Task, trajectory: Trajectory,
                        env_factory: Callable[[str], ToolEnvironment] | None = None) -> ToolEnvironment:
    """Replay ACT's tool calls, in order, in a NEW private environment ``env_factory(task.domain)``
    (default `Tau2Environment`) reset to `task`; returns that environment (for scoring).

    Mutates `trajectory`: each action step gets ``real_observation``; when the trajectory is
    imagined and the step has a rehearsed observation (not a ``schema_error`` answer), ``fidelity`` =
    `fidelity`(imagined, real). Errors
    building the environment (e.g. `UnknownDomainError`) propagate; tool errors are observations.
    """
    env = (env_factory or _default_env_factory)(task.domain)
    env.reset(task)
    for step in trajectory.steps:
        if step.action is None:
            continue
        real = env.step(step.action)
        step.real_observation = real
        if trajectory.imagined and step.observation is not None and not step.schema_error:
            step.fidelity = fidelity(step.observation, real)
    return env


def _mean_fidelity(trajectory: Trajectory) -> float | None:
    fids = [s.fidelity for s in trajectory.steps if s.fidelity is not None]
    return sum(fids) / len(fids) if fids else None


def _mask(trajectory: Trajectory, name: str, error: Exception | str, **info: Any) -> None:
    trajectory.reward = None
    trajectory.sub_rewards = {}
    msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    trajectory.reward_info = {"error": msg, "reward_fn": name, **info}


def replay_reward(task: Task, trajectory: Trajectory,
                  env_factory: Callable[[str], ToolEnvironment] | None = None) -> RewardResult | None:
    """Verifiable reward (METHOD.md §2 `replay`): ACT's tool calls replayed in order in a NEW private
    environment (`replay_observations`), then scored by the benchmark's own evaluator
    (``env.score``; for tau2 see `Tau2Environment.score`).

    Mutates `trajectory` as `replay_observations` does (real observations, fidelity; real rollouts
    keep ``fidelity=None``). ``final_message`` is the last step's ``message``. Trajectories ending
    in a parse error are scored on what they did (the format penalty is applied by
    `score_trajectory`).

    Returns the RewardResult (also written to ``trajectory.reward/sub_rewards/reward_info``), or
    ``None`` when replay or scoring raised: then ``trajectory.reward is None`` (masked, not 0) and
    ``trajectory.reward_info["error"]`` holds the error. Errors building the environment itself
    (e.g. `UnknownDomainError`) propagate: they are configuration errors.
    """
    env = (env_factory or _default_env_factory)(task.domain)
    try:
        env = replay_observations(task, trajectory, lambda _domain: env)
        final_message = trajectory.steps[-1].message if trajectory.steps else ""
        result = env.score(task, trajectory.steps, final_message)
    except Exception as e:  # noqa: BLE001 - any scorer failure masks the trajectory
        _mask(trajectory, "replay", e)
        return None
    result.info.setdefault("reward_fn", "replay")
    result.info["mean_fidelity"] = _mean_fidelity(trajectory)
    result.info["termination"] = trajectory.termination
    trajectory.reward = result.reward
    trajectory.sub_rewards = dict(result.sub_rewards)
    trajectory.reward_info = dict(result.info)
    return result


# -------------------------------------------------------------------------------- actions reward


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
    keys = compare_args(task)
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


# ------------------------------------------------------------------------------------ judge reward


def judge_reward(task: Task, trajectory: Trajectory, judge) -> RewardResult | None:
    """LLM-judge reward (METHOD.md §2 `judge`, the reference's scheme): `judge` (an
    `envace_core.training.judge.Judge`) grades the trajectory against the task's checklist (gold actions,
    communicate_info, nl_assertions). A verdict that does not parse -> ``None`` (masked, never 0).
    See `Judge.score` for the rule."""
    return judge.score(task, trajectory)


# -------------------------------------------------------------------------------------- registry

# --------------------------------------------------------------------- rehearsed-world reward

_GOLD_REFERENCE: dict[str, list[Any]] = {}  # task id -> real gold observations (default environment only)
_WRITE_TOOLS: dict[str, frozenset[str]] = {}  # domain -> tau2 WRITE tools


def consistent_reward(task: Task, trajectory: Trajectory,
                      env_factory: Callable[[str], ToolEnvironment] | None = None) -> RewardResult | None:
    """Imagination-consistent reward (METHOD.md §2, "learn to act *in* the rehearsed world"): an
    imagined trajectory is scored against the task's gold transposed into the world REHEARSE showed
    ACT (`envace_core.training.transpose`): each gold action must be made with the arguments the
    imagined observations imply, each ``communicate_info`` value must be the one the imagined record
    holds. A real trajectory (standard GRPO, evaluation) gets `replay_reward` unchanged.

    ``reward`` = passed / scorable items (gold actions + communicate_info values), 0.0 when ACT made
    a database-changing call (tau2 ``ToolType.WRITE``) that matches no gold action (tau2's DB check
    would fail it in the real world). ``sub_rewards``: "ACTION" (1.0 iff every scorable gold action
    passed), "COMMUNICATE" (the same for communicate_info). No scorable item (every address missing
    from what REHEARSE imagined, or only computed values) → ``None``: masked, not 0 (METHOD.md §3).
    Not gameable by ACT: stated values must be found where the gold value lives in an observation
    ACT was shown, and a skipped look-up fails everything that depended on it. A wrong imagined
    record does not cost ACT, but costs REHEARSE its fidelity (``reward.fidelity_lambda`` > 0).
    Real observations and fidelity are filled by `score_trajectory`'s replay, as for `actions`.
    """
    from envace_core.training.transpose import gold_reference, transpose_and_check, write_tools

    if not trajectory.imagined:
        return replay_reward(task, trajectory, env_factory)
    try:
        if env_factory is None:
            if task.id not in _GOLD_REFERENCE:
                _GOLD_REFERENCE[task.id] = gold_reference(task, _default_env_factory)
            reference = _GOLD_REFERENCE[task.id]
        else:
            reference = gold_reference(task, env_factory)
        checked = transpose_and_check(task, trajectory, reference)
        if task.domain not in _WRITE_TOOLS:
            _WRITE_TOOLS[task.domain] = write_tools(task.domain)
    except Exception as e:  # noqa: BLE001 - any scorer failure masks the trajectory
        _mask(trajectory, "consistent", e)
        return None
    steps = [s for s in trajectory.steps if s.action is not None]  # k indexes these, as in `matched`
    matched = {k for k in checked.matched if k is not None}
    stray = [s.action.name for k, s in enumerate(steps)  # a call refused by its schema changed nothing
             if k not in matched and not s.schema_error and s.action.name in _WRITE_TOOLS[task.domain]]
    score = checked.score()
    items = [{"kind": i.kind, "index": i.index, "outcome": i.outcome, "why": i.why} for i in checked.items]
    if score is None:
        _mask(trajectory, "consistent", "no scorable item in the rehearsed world", items=items)
        return None

    def all_passed(kind: str) -> float:
        s = [i for i in checked.scorable if i.kind == kind]
        return 1.0 if not stray and all(i.outcome == "pass" for i in s) else 0.0

    res = RewardResult(reward=0.0 if stray else score,
                       sub_rewards={"ACTION": all_passed("action"), "COMMUNICATE": all_passed("communicate")},
                       info={"reward_fn": "consistent", "items": items, "stray_writes": stray,
                             "n_scorable": len(checked.scorable), "n_items": len(checked.items),
                             "termination": trajectory.termination})
    trajectory.reward = res.reward
    trajectory.sub_rewards = dict(res.sub_rewards)
    trajectory.reward_info = dict(res.info)
    return res


REWARDS: dict[str, RewardFn] = {"replay": replay_reward, "actions": actions_reward, "judge": judge_reward,
                                "consistent": consistent_reward}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(task, trajectory, **resources) -> RewardResult | None`` as `name`
    (then ``reward.name=<name>`` selects it). Raises EnvaceError if `name` is taken."""
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name] is not fn:
            raise EnvaceError(f"reward {name!r} is already registered ({REWARDS[name].__name__})")
        REWARDS[name] = fn
        return fn
    return deco


def _resources_needed(fn: RewardFn) -> list[str]:
    """Keyword parameters after (task, trajectory) that have no default: resources to bind."""
    params = list(inspect.signature(fn).parameters.values())[2:]
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def get_reward_fn(name: str, **resources: Any) -> RewardFn:
    """The reward registered as `name`, with those `resources` bound that it declares as parameters.

    Returns the function itself when nothing is bound, else a ``functools.partial``.
    Raises EnvaceError naming ``reward.name`` and the valid rewards for an unknown name, or the
    missing resource (e.g. ``judge``) when the function needs one that was not given.
    """
    try:
        fn = REWARDS[name]
    except KeyError:
        raise EnvaceError(f"reward.name: unknown reward {name!r}; valid rewards: "
                          f"{', '.join(sorted(REWARDS))}") from None
    missing = [r for r in _resources_needed(fn) if r not in resources]
    if missing:
        raise EnvaceError(f"reward {name!r} needs {missing} (build it with reward_fn_from_config)")
    accepted = set(inspect.signature(fn).parameters)
    bind = {k: v for k, v in resources.items() if k in accepted}
    return functools.partial(fn, **bind) if bind else fn


def reward_fn_from_config(cfg: RunConfig, engine: Optional[Engine] = None) -> RewardFn:
    """The reward function ``cfg.reward.name`` names, ready to call as ``fn(task, trajectory)``.

    For ``judge`` the judge is `envace_core.training.judge.build_judge` (model ``cfg.reward.judge_model``;
    None = the policy's base model, served from `engine`'s own weights with the adapter off).
    """
    name = cfg.reward.name
    if name == "judge":
        from envace_core.training.judge import build_judge

        return get_reward_fn(name, judge=build_judge(cfg, engine))
    return get_reward_fn(name)


# ------------------------------------------------------------------------ termination, row rewards


def ends_in_unanswered_call(trajectory: Trajectory) -> bool:
    """True when the last step is a tool call with no observation: the run stopped before the call's
    result (imagined or real) came back to the agent."""
    last = trajectory.steps[-1] if trajectory.steps else None
    return last is not None and last.action is not None and last.observation is None


def score_trajectory(task: Task, trajectory: Trajectory, reward_fn: RewardFn | None = None,
                     format_penalty: float = 0.0, replay_fidelity: bool = True) -> Trajectory:
    """Score `trajectory` with `reward_fn` (default `replay_reward`) and apply tau2's termination rule.

    As in tau2's `evaluate_simulation`, only a trajectory that ended cleanly (`CLEAN_TERMINATIONS`:
    the agent's message, or the rehearsed user's stop token) keeps its score: one stopped by the turn
    limit gets 0, one stopped by an unparseable output gets `format_penalty` (METHOD.md §2, format).
    A trajectory whose termination is clean or unset but that ends in a tool call without a result
    (`ends_in_unanswered_call`) is renamed `DANGLING_TOOL_CALL` and gets 0; one that ended in a parse
    error keeps "parse_error" (an unparseable REHEARSE output also leaves its call unanswered). When
    the rule overrides the score, every sub-reward becomes 0.0 too (they must agree with the reward);
    the function's own score and sub-rewards are kept in ``reward_info["<fn>_reward"]`` and
    ``reward_info["<fn>_sub_rewards"]``. A scoring failure leaves ``reward=None`` (masked).
    When the function did not replay (e.g. `actions`, `judge`), the tool
    calls are replayed privately anyway to fill real observations and fidelity (METHOD.md §2:
    fidelity is logged always); a failure there only leaves fidelity unset. `replay_fidelity=False`
    (``reward.replay_fidelity``; tool learning: no real call to the new tools during training) skips
    that replay: no environment is built, real observations and fidelity stay unset.
    """
    if trajectory.termination in (*CLEAN_TERMINATIONS, "") and ends_in_unanswered_call(trajectory):
        trajectory.termination = DANGLING_TOOL_CALL
    fn = reward_fn or replay_reward
    fn(task, trajectory)
    name = trajectory.reward_info.get("reward_fn", getattr(fn, "__name__", "reward"))
    needs_replay = replay_fidelity and any(s.action is not None and s.real_observation is None
                                           for s in trajectory.steps)
    if needs_replay:
        try:
            replay_observations(task, trajectory)
            trajectory.reward_info["mean_fidelity"] = _mean_fidelity(trajectory)
        except Exception as e:  # noqa: BLE001 - fidelity is a metric here, not the reward
            trajectory.reward_info["fidelity_error"] = f"{type(e).__name__}: {e}"
    if trajectory.reward is not None and trajectory.termination not in CLEAN_TERMINATIONS:
        trajectory.reward_info[f"{name}_reward"] = trajectory.reward
        trajectory.reward_info[f"{name}_sub_rewards"] = dict(trajectory.sub_rewards)
        trajectory.reward = format_penalty if trajectory.termination == "parse_error" else 0.0
        trajectory.sub_rewards = {k: 0.0 for k in trajectory.sub_rewards}
    return trajectory


def _step_fidelity(step) -> float | None:
    if step.fidelity is not None:
        return step.fidelity
    if step.real_observation is not None:  # nothing was imagined (unparseable REHEARSE output): F = 0
        return fidelity(step.observation, step.real_observation)
    return None


def row_rewards(trajectory: Trajectory, fidelity_lambda: float = 0.0) -> list[float | None]:
    """The reward of each of `trajectory.generations` (same order) for role-wise GRPO (METHOD.md §2-3).

    Every row gets the trajectory reward R (ACT, USER-REHEARSE and REHEARSE alike); with
    `fidelity_lambda` λ > 0, the k-th REHEARSE row gets R + λ·F_k, where F_k = F(ô_k, o_k) is the
    fidelity of the k-th rehearsed action step (calls answered by their schema error have no REHEARSE
    row) (METHOD.md §2: "optionally added to REHEARSE rows'
    reward with weight λ (off by default, an ablation)"; an unparseable rehearsal has F = 0). R None
    (failed score) -> None for every row; λ > 0 with F_k unknown (no real observation) -> None.
    SELF_EVAL rows get R too (they are not trained by role-wise GRPO).
    """
    R = trajectory.reward
    if R is None:
        return [None] * len(trajectory.generations)
    if fidelity_lambda == 0:
        return [R] * len(trajectory.generations)
    action_steps = iter([s for s in trajectory.steps if s.action is not None and not s.schema_error])
    out: list[float | None] = []
    for g in trajectory.generations:
        if g.role != Role.REHEARSE:
            out.append(R)
            continue
        step = next(action_steps, None)  # REHEARSE row k imagined the k-th action step
        f = _step_fidelity(step) if step is not None else None
        out.append(None if f is None else R + fidelity_lambda * f)
    return out

