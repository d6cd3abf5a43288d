"""Private Rehearsal at test time (METHOD.md §4): rehearse in the head, then commit once.

`RehearsalAgent.run` first unrolls N imagined trajectories of the task (parallel mode: one batched
group, sampled at temperature > 0), condenses them into a rehearsal memory m_x under a token budget,
then runs ACT once against the real environment with m_x in its context (Committed Execution).
Isolation: rehearsal receives only the `TaskContext`; the real environment is first touched by the
committed execution. `RehearsalResult.isolation` records the environment's call counter and state
hash before and after rehearsal so every run proves it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from envace_core import EnvaceError, roles
from envace_core.engines.base import Engine
from envace_core.envs.base import ToolEnvironment
from envace_core.rollout import RolloutParams, real_rollout, rehearsal_rollouts
from envace_core.types import TaskContext, Trajectory

MODES = ("none", "parallel")


class IsolationError(EnvaceError):
    """Rehearsal touched the real environment (a bug: rehearsal must never do so)."""


@dataclass
class RehearsalResult:
    committed: Trajectory
    rehearsals: list[Trajectory] = field(default_factory=list)
    memory: str = ""
    isolation: dict = field(default_factory=dict)


def summarise(traj: Trajectory, k: int) -> str:
    """One rehearsal as compact text: the calls tried, the imagined outcomes, how it ended."""
    lines = [f"Rehearsal {k}:"]
    for s in traj.steps:
        if s.action is not None:
            obs = s.observation.content if s.observation else "(no response)"
            lines.append(f"- called {s.action.name}({json.dumps(s.action.arguments, sort_keys=True)})"
                         f" -> {'ERROR ' if s.observation and s.observation.error else ''}{obs}")
        elif s.message:
            lines.append(f"- told the user: {s.message}")
    lines.append(f"- ended: {traj.termination}")
    return "\n".join(lines)


class RehearsalAgent:
    """An agent that rehearses privately before each real episode.

    Args:
        engine: the policy's generation engine (plays ACT and REHEARSE).
        mode: "none" (plain ACT) or "parallel" (N independent imagined trajectories).
        n: number of rehearsals N.
        memory_max_tokens: token budget of the rehearsal memory.
        act: rollout settings of the committed execution (temperature 0 = greedy).
        rehearse: rollout settings of the rehearsals (temperature must be > 0 for diversity).
    Raises:
        EnvaceError: unknown mode.
    """

    def __init__(self, engine: Engine, mode: str, n: int, memory_max_tokens: int,
                 act: RolloutParams, rehearse: RolloutParams, seed: Optional[int] = 0):
        if mode not in MODES:
            raise EnvaceError(f"unknown rehearsal mode {mode!r}; choose one of {MODES}")
        self.engine, self.mode, self.n = engine, mode, n
        self.memory_max_tokens, self.act, self.rehearse_params, self.seed = memory_max_tokens, act, rehearse, seed

    def rehearse(self, ctx: TaskContext) -> tuple[list[Trajectory], str]:
        """N imagined trajectories and the memory condensed from them. Touches no environment."""
        if self.mode == "none":
            return [], ""
        trajs = rehearsal_rollouts(self.engine, ctx, self.n, self.rehearse_params, seed=self.seed)
        memory = roles.memory_text([summarise(t, k + 1) for k, t in enumerate(trajs)],
                                   self.memory_max_tokens, self.engine.tokenizer)
        return trajs, memory

    def run(self, ctx: TaskContext, env: ToolEnvironment) -> RehearsalResult:
        """Rehearse, then commit one real execution in `env` (already reset to the task)."""
        before = (env.calls_made, env.snapshot())
        rehearsals, memory = self.rehearse(ctx)
        after = (env.calls_made, env.snapshot())
        if before != after:
            raise IsolationError(f"rehearsal changed the real environment: {before} -> {after}")
        committed = real_rollout(self.engine, ctx, env, self.act, seed=self.seed,
                                 memory=memory or None)
        return RehearsalResult(committed, rehearsals, memory,
                               {"real_calls_during_rehearsal": after[0] - before[0],
                                "db_hash_unchanged": before[1] == after[1]})
