"""The small interface every tool environment adapter implements (tau2 domains, BFCL classes, ...)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from envace_core.types import (
    Observation,
    Step,
    Task,
    TaskContext,
    ToolCall,
    ToolSpec,
    Trajectory,
)


class RewardResult(BaseModel):
    """A scored trajectory. `reward` in [0, 1]; `sub_rewards` per criterion (e.g. DB, COMMUNICATE)."""

    reward: float
    sub_rewards: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)


class ToolEnvironment(ABC):
    """A real, executable tool environment for one task at a time.

    Every instance owns private state: `reset` builds a fresh copy of the domain database, so two
    instances never share state. Rehearsal never receives an instance (it gets a `TaskContext`).
    """

    domain: str
    calls_made: int = 0  # real tool calls executed since construction (isolation tests read it)

    @abstractmethod
    def tools(self) -> list[ToolSpec]:
        """The agent-side tools of the domain."""

    @abstractmethod
    def policy(self) -> str:
        """The domain's policy / documentation text."""

    @abstractmethod
    def reset(self, task: Task) -> None:
        """Start `task` on a fresh private copy of the domain state."""

    @abstractmethod
    def step(self, call: ToolCall) -> Observation:
        """Execute one tool call for real; tool errors come back as `Observation(error=True)`."""

    @abstractmethod
    def snapshot(self) -> str:
        """A hash of the current state (DB hash), to prove what did or did not change."""

    @abstractmethod
    def score(self, task: Task, steps: list[Step], final_message: str) -> RewardResult:
        """Score a finished trajectory with the benchmark's own evaluator."""


Check = Callable[[Trajectory, TaskContext], list[str]]


def call_text(step: Step) -> str:
    a = step.action
    return f"{a.name}({json.dumps(a.arguments, sort_keys=True, ensure_ascii=False)})" if a else ""
