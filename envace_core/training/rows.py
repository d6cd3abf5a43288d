"""The one row contract between rollout → reward → advantage → loss (cf. verl's DataProto).

A rollout produces `Trajectory`s; `rows_from_group` turns one GRPO group's scored trajectories into
`TrainingRow`s (one per generation, reward and `valid` set); an advantage estimator
(`grpo.ADVANTAGE_ESTIMATORS`) fills `advantage`; `trainer.PolicyTrainer.update` takes the rows that
`trainable_rows` keeps. Nothing between those steps changes the data's shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from enum import Enum

from envace_core.training.rewards import row_rewards
from envace_core.types import Generation, Trajectory


def role_name(role) -> str:
    return role.value if isinstance(role, Enum) else str(role)


@dataclass
class TrainingRow:
    """One generated completion: the exact ids the engine saw and sampled, its reward and advantage.

    Fields:
        role: the generating role's name ("act", "rehearse", "user", ...).
        prompt_ids: the P ids the engine was given.
        completion_ids: the C ids it sampled (trained exactly as generated: no re-tokenization).
        old_logprobs: C behaviour log-probs (natural log, of logits / `temperature`).
        advantage: A, broadcast to every completion token; 0 until an estimator fills it.
        temperature: the sampling temperature (> 0) the log-probs were taken at.
        group_id: the GRPO group (G rollouts of one task drawn once); baselines never cross groups.
            "" for rows built outside a group (e.g. a benchmark's hand-made batch).
        trajectory_index: the trajectory's place g in its group (0 .. G-1).
        reward: the row's reward R (METHOD.md §2: the trajectory's R, + λ·F on REHEARSE rows), or
            None where scoring failed.
        valid: False where `reward` is None or not finite: the row takes no part in a baseline and
            carries no loss (masked, never scored 0; METHOD.md §3).
    """

    role: str
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float = 0.0
    temperature: float = 1.0
    _: KW_ONLY
    group_id: str = ""
    trajectory_index: int = 0
    reward: float | None = None
    valid: bool = True

    @classmethod
    def from_generation(cls, gen: Generation, advantage: float = 0.0, *, group_id: str = "",
                        trajectory_index: int = 0, reward: float | None = None,
                        valid: bool = True) -> TrainingRow:
        """The row of `gen`: its ids and log-probs copied unchanged."""
        return cls(role=role_name(gen.role), prompt_ids=list(gen.prompt_ids),
                   completion_ids=list(gen.completion_ids), old_logprobs=list(gen.logprobs),
                   advantage=float(advantage), temperature=float(gen.temperature), group_id=group_id,
                   trajectory_index=trajectory_index, reward=reward, valid=valid)


def rows_from_group(group_id: str, trajectories: Sequence[Trajectory],
                    fidelity_lambda: float = 0.0) -> list[TrainingRow]:
    """One row per generation of a group's scored trajectories, in order (trajectory, then turn).

    Each row gets its reward from `rewards.row_rewards` (R, or R + λ·F_k on the k-th REHEARSE row);
    a None or non-finite reward gives `valid=False` and reward None. Advantages are left at 0.
    """
    rows = []
    for g, traj in enumerate(trajectories):
        for gen, r in zip(traj.generations, row_rewards(traj, fidelity_lambda)):
            ok = r is not None and math.isfinite(float(r))
            rows.append(TrainingRow.from_generation(gen, group_id=group_id, trajectory_index=g,
                                                    reward=float(r) if ok else None, valid=ok))
    return rows


def trainable_rows(rows: Iterable[TrainingRow], trained_roles: Iterable) -> list[TrainingRow]:
    """The rows a policy update trains on: valid, of a role in `trained_roles`, with a non-empty
    completion (METHOD.md §3: only generated tokens of the trained roles carry loss)."""
    roles = {role_name(r) for r in trained_roles}
    return [r for r in rows if r.valid and r.role in roles and r.completion_ids]
