"""The small interface every tool environment adapter implements (tau2 domains, BFCL classes, ...)."""

from __future__ import annotations

import functools
import json
import threading
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


_THREAD_STEPS = threading.local()


def env_steps_in_thread() -> int:
    """Real tool calls executed in this thread so far by any `ToolEnvironment` (every instance, every
    subclass: the count sits on `step` itself). Callers take differences around a phase (e.g. the
    training loop: rollouts vs reward replays); a `step` that calls another `step` counts once."""
    return getattr(_THREAD_STEPS, "n", 0)


def _counted(step: Callable) -> Callable:
    @functools.wraps(step)
    def counted_step(self, *args, **kwargs):
        depth = getattr(_THREAD_STEPS, "depth", 0)
        if depth == 0:
            _THREAD_STEPS.n = getattr(_THREAD_STEPS, "n", 0) + 1
        _THREAD_STEPS.depth = depth + 1
        try:
            return step(self, *args, **kwargs)
        finally:
            _THREAD_STEPS.depth = depth

    counted_step.env_step_counted = True
    return counted_step


class ToolEnvironment(ABC):
    """A real, executable tool environment for one task at a time.

    Every instance owns private state: `reset` builds a fresh copy of the domain database, so two
    instances never share state. Rehearsal never receives an instance (it gets a `TaskContext`).
    A subclass's `step` is counted per thread (`env_steps_in_thread`).
    """

    domain: str
    calls_made: int = 0  # real tool calls executed since construction (isolation tests read it)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("step")
        if callable(own) and not getattr(own, "env_step_counted", False):
            cls.step = _counted(own)

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
