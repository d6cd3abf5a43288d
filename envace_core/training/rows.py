"""The one row contract between rollout → reward → advantage → loss (cf. verl's DataProto)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from envace_core.types import Generation


def role_name(role) -> str:
    return role.value if isinstance(role, Enum) else str(role)


@dataclass
class TrainingRow:
    """One generated completion to train on: the exact ids the engine saw and sampled.

    `old_logprobs` (length C = len(completion_ids)) are the behaviour log-probs (natural log, of
    logits / `temperature`); `advantage` is broadcast to every completion token.
    """

    role: str
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    temperature: float = 1.0

    @classmethod
    def from_generation(cls, gen: Generation, advantage: float) -> TrainingRow:
        return cls(role=role_name(gen.role), prompt_ids=list(gen.prompt_ids),
                   completion_ids=list(gen.completion_ids), old_logprobs=list(gen.logprobs),
                   advantage=float(advantage), temperature=float(gen.temperature))
