"""Tool learning's measurement (METHOD.md §5): real-environment success and REHEARSE fidelity on the new tools, before and after."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from envace_core.types import Task

if TYPE_CHECKING:
    from envace_core.config import RunConfig
from envace_core.envs.implemented import ImplementationEnvironment
from envace_core.tool_learning.tasks import AdaptationError, implementation_of


# ------------------------------------------------------------------------------------ measurement
def measure(cfg: RunConfig, model_ref: str, tasks: Sequence[Task], *, tools: Sequence[str],
            trials: int = 1, seed: int = 0, registry: str | None = None) -> dict[str, Any]:
    """Real-environment success and REHEARSE fidelity of `model_ref` on held-out `tasks` (METHOD.md §5).

    Success: the tau2 evaluation harness (`evaluation.tau2.evaluate_policy`, no rehearsal, protocol
    ``eval.protocol``; `evaluation.protocols` says what each runs and skips), `trials` trials per task,
    trial t with seed ``seed + t``. Under opening_request a task whose new tool only its implementation
    runs is played against an `ImplementationEnvironment` and scored by the `actions` reward (every gold
    call made, tau2's all-match rule) with tau2's termination rule; tau2 tasks by the replay reward (tau2's
    evaluator). A task's value is the mean success of its scored trials (tau2's ``is_successful``).
    Fidelity: the tasks' gold actions replayed for real (`stages.validate.held_out_transitions`); for each
    transition whose call is one of `tools`, REHEARSE predicts the observation greedily
    (`stages.validate.rehearse_rows`: F(ô, o) of METHOD.md §2, 0 when unparseable); the task's value is
    its transitions' mean. Each metric: mean over tasks and a 95% percentile-bootstrap CI over tasks
    (`stats.mean_ci`, seed `seed`); n = tasks measured (with a value).

    Returns {"success": {"mean", "ci95", "n", "method"}, "fidelity": {... , "transitions"},
    "per_task": [{"task_id", "success", "rewards", "terminations", "fidelity", "transitions"}],
    "model", "trials", "tools", "protocol"}. Raises AdaptationError for a task without a tau2 record
    (example-built tasks cannot be scored in the real environment), for implementation-scored tasks
    under tau2_orchestrator (tau2's Orchestrator runs only tau2's own tools), or trials < 1, and
    `models.ModelRefError` for a bad model ref. `registry`: where a ``registry:`` ref lives (default
    ``store.registry``).
    """
    from envace_core.evaluation.protocols import MAX_STEPS, TAU2_ORCHESTRATOR, describe
    from envace_core.evaluation.stats import mean_ci
    from envace_core.evaluation.tau2 import evaluate_policy
    from envace_core.models import resolve_model_ref
    from envace_core.training.policy import load_engine

    if trials < 1:
        raise AdaptationError(f"trials={trials}: need at least 1")
    bad = [t.id for t in tasks if not (t.source or {}).get("evaluation_criteria") and not implementation_of(t)]
    if bad:
        raise AdaptationError(f"tasks {bad[:3]} have no tau2 record and no tool implementation, so they cannot "
                              "be scored in a real environment (example-built tasks are train-only unless the "
                              "tool has an \"implementation\")")
    protocol = cfg.eval.protocol
    implemented = [t.id for t in tasks if implementation_of(t)]
    if implemented and protocol == TAU2_ORCHESTRATOR:
        raise AdaptationError(f"tasks {implemented[:3]} are scored by running a tool implementation, which "
                              "tau2's Orchestrator cannot execute: measure them with eval.protocol=opening_request")
    engine, _ = load_engine(cfg, resolve_model_ref(model_ref, registry or cfg.store.registry))
    hooks = {} if protocol == TAU2_ORCHESTRATOR else {"environment": _environment, "score": _score}
    run = evaluate_policy(cfg, engine, tasks, protocol, trials=trials, seed=seed, raise_errors=True, **hooks)
    per_task = []
    for task in tasks:
        recs = [r for r in run["results"] if r["task_id"] == task.id]
        scored = [r["success"] for r in recs if r["success"] is not None]
        per_task.append({"task_id": task.id, "success": statistics.fmean(scored) if scored else None,
                         "rewards": [r["reward"] for r in recs],
                         "terminations": [r["termination_reason"] for r in recs],
                         "fidelity": None, "transitions": 0})
    trans, fid_rows = _fidelity(cfg, engine, tasks, set(tools))
    for rec in per_task:
        f = fid_rows.get(rec["task_id"], [])
        rec.update(fidelity=statistics.fmean(f) if f else None, transitions=len(f))
    fid = mean_ci([r["fidelity"] for r in per_task if r["fidelity"] is not None], seed=seed)
    limit = {"max_steps": MAX_STEPS} if protocol == TAU2_ORCHESTRATOR else {"max_turns": cfg.eval.max_turns}
    return {"success": mean_ci([r["success"] for r in per_task if r["success"] is not None], seed=seed),
            "fidelity": {**fid, "transitions": trans}, "per_task": per_task,
            "model": model_ref, "trials": trials, "tools": sorted(set(tools)),
            "protocol": {"success": describe(protocol, trials=trials, seed=seed, **limit),
                         "implemented_tools": "opening_request against the implementation, actions reward",
                         "fidelity": "REHEARSE on held-out real transitions of the new tools, greedy",
                         "ci": "95% percentile bootstrap over tasks"}}


def _environment(task: Task):
    """The real environment of a held-out task: its tools' implementations, else its tau2 domain."""
    from envace_core.envs.tau2.environment import Tau2Environment

    impl = implementation_of(task)
    return ImplementationEnvironment(impl) if impl else Tau2Environment(task.domain)


def _score(task: Task, traj):
    """Implemented tools: every gold call made (actions reward, tau2's all-match rule) and a clean end, as
    tau2 requires, with no replay (no tau2 environment runs them); tau2 tasks: the replay reward."""
    from envace_core.training.rewards import actions_reward, score_trajectory

    if implementation_of(task):
        return score_trajectory(task, traj, actions_reward, replay_fidelity=False)
    return score_trajectory(task, traj)


def _fidelity(cfg: RunConfig, engine, tasks: Sequence[Task], wanted: set[str]) -> tuple[int, dict[str, list[float]]]:
    """(transitions rehearsed, {task id: per-transition fidelity}) over the tasks' real transitions whose
    call is one of `wanted`: tau2 tasks' gold actions replayed (`held_out_transitions`), implemented tools'
    example call executed by the implementation."""
    from envace_core.stages.validate import held_out_transitions, rehearse_rows
    from envace_core.types import Message

    trans = [tr for tr in held_out_transitions([t for t in tasks if not implementation_of(t)], 1 << 30)
             if tr[2].name in wanted]
    for task in (t for t in tasks if implementation_of(t)):  # the example's call, executed by its implementation
        env = ImplementationEnvironment(implementation_of(task))
        call = task.gold_actions[0].model_copy(update={"id": "call_1"})
        trans.append((task, [Message(role="user", content=task.first_user_message)], call, env.step(call)))
    by_task: dict[str, list[float]] = {}
    for (task, *_), row in zip(trans, rehearse_rows(cfg, engine, trans)):
        by_task.setdefault(task.id, []).append(row["fidelity"])
    return len(trans), by_task
