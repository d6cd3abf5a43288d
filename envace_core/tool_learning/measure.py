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
    """Real-environment success and REHEARSE fidelity of `model_ref` on held-out `tasks` (issue 8 item 4).

    Success: per task, `trials` ACT rollouts (`rollout.real_rollouts`, greedy at ``eval.temperature``,
    ``eval.max_turns``; the opening request is the whole user side), each against its own private
    `Tau2Environment` reset to the task, scored by the `replay` reward (tau2's evaluator,
    `stages.score`); a trial succeeds iff reward >= 1, the task's value is its trials' mean.
    Fidelity: the tasks' gold actions replayed for real (`stages.held_out_transitions`); for each
    transition whose call is one of `tools`, REHEARSE predicts the observation greedily
    (`stages.rehearse_rows`: F(ô, o) of METHOD.md §2, 0 when unparseable); the task's value is its
    transitions' mean. Each metric: mean over tasks and a 95% percentile-bootstrap CI over tasks
    (`stats.mean_ci`, seed `seed`); n = tasks measured.

    Returns {"success": {"mean", "ci95", "n", "method"}, "fidelity": {... , "transitions"},
    "per_task": [{"task_id", "success", "rewards", "terminations", "fidelity", "transitions"}],
    "model", "trials", "protocol"}. Raises AdaptationError for a task without a tau2 record
    (example-built tasks cannot be scored in the real environment) or trials < 1, and
    `eval_run.ModelRefError` for a bad model ref. `registry`: where a ``registry:`` ref lives
    (default ``store.registry``).
    """
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.evaluation.stats import mean_ci
    from envace_core.models import resolve_model_ref
    from envace_core.stages.validate import held_out_transitions, rehearse_rows
    from envace_core.training.loop import score
    from envace_core.training.policy import load_engine, rollout_params
    from envace_core.training.rollout import real_rollouts
    from envace_core.types import Message

    if trials < 1:
        raise AdaptationError(f"trials={trials}: need at least 1")
    bad = [t.id for t in tasks if not (t.source or {}).get("evaluation_criteria") and not implementation_of(t)]
    if bad:
        raise AdaptationError(f"tasks {bad[:3]} have no tau2 record and no tool implementation, so they cannot "
                              "be scored in a real environment (example-built tasks are train-only unless the "
                              "tool has an \"implementation\")")
    engine, _ = load_engine(cfg, resolve_model_ref(model_ref, registry or cfg.store.registry))
    p = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=cfg.eval.max_turns)
    per_task = []
    from envace_core.training.rewards import actions_reward, score_trajectory

    for i, task in enumerate(tasks):
        impl = implementation_of(task)
        envs = [ImplementationEnvironment(impl) if impl else Tau2Environment(task.domain) for _ in range(trials)]
        for env in envs:
            env.reset(task)
        trajs = real_rollouts(engine, task_context(task, cfg.data.policy_max_chars), envs, p, seed=seed * 100003 + i)
        # tau2 tasks: tau2's evaluator on a replay; implemented tools: every gold call made (actions
        # reward, tau2's all-match rule) and a clean end, as tau2 requires
        trajs = [score_trajectory(task, t, actions_reward, replay_fidelity=False) if impl else score(task, t)
                 for t in trajs]
        rewards = [t.reward for t in trajs]
        per_task.append({"task_id": task.id, "success": statistics.fmean(float((r or 0) >= 1.0) for r in rewards),
                         "rewards": rewards, "terminations": [t.termination for t in trajs],
                         "fidelity": None, "transitions": 0})
    wanted = set(tools)
    trans = [tr for tr in held_out_transitions([t for t in tasks if not implementation_of(t)], 1 << 30)
             if tr[2].name in wanted]
    for task in (t for t in tasks if implementation_of(t)):  # the example's call, executed by its implementation
        env = ImplementationEnvironment(implementation_of(task))
        call = task.gold_actions[0].model_copy(update={"id": "call_1"})
        trans.append((task, [Message(role="user", content=task.first_user_message)], call, env.step(call)))
    by_task: dict[str, list[float]] = {}
    for (task, *_), row in zip(trans, rehearse_rows(cfg, engine, trans)):
        by_task.setdefault(task.id, []).append(row["fidelity"])
    for rec in per_task:
        f = by_task.get(rec["task_id"], [])
        rec.update(fidelity=statistics.fmean(f) if f else None, transitions=len(f))
    fid = mean_ci([r["fidelity"] for r in per_task if r["fidelity"] is not None], seed=seed)
    return {"success": mean_ci([r["success"] for r in per_task], seed=seed),
            "fidelity": {**fid, "transitions": len(trans)}, "per_task": per_task,
            "model": model_ref, "trials": trials, "tools": sorted(wanted),
            "protocol": {"user": "opening request only (no simulated follow-ups)",
                         "success": "tau2 replay reward == 1 in a private real environment",
                         "fidelity": "REHEARSE on held-out real transitions of the new tools, greedy",
                         "ci": "95% percentile bootstrap over tasks"}}
