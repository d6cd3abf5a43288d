"""The data contract shared by every stage: tasks, tool calls, messages, generations, trajectories.

All models are pydantic so they serialise to JSON/parquet unchanged between Flyte tasks.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field


class Role(str, Enum):
    """Which role of the one shared policy produced a generation (METHOD.md §1)."""

    ACT = "act"  # history -> tool call or message to the user
    REHEARSE = "rehearse"  # history + tool call -> imagined environment response (JSON)
    USER = "user"  # USER-REHEARSE: imagined user reply (multi-agent rehearsal)
    SELF_EVAL = "self_eval"  # test-time grading of an imagined trajectory


class ToolSpec(BaseModel):
    """One tool in OpenAI function format: `name`, `description`, JSON-schema `parameters`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump()}


class ToolCall(BaseModel):
    """A call of one tool with JSON arguments, as ACT emits it inside `<tool_call>` tags."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str = ""


class Observation(BaseModel):
    """An environment response to a tool call: `content` is JSON text (or an error string)."""

    content: str
    error: bool = False


class Message(BaseModel):
    """One chat message of the interaction history h_t."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_call: Optional[ToolCall] = None  # set on assistant messages that call a tool
    error: bool = False  # set on tool messages that report a tool error


class Task(BaseModel):
    """A training or evaluation task. `gold` fields are for scoring only and never enter a prompt."""

    id: str  # globally unique, "<domain>/<tau2 task id>"
    domain: str
    split: str  # "train" | "test" | ...
    first_user_message: str  # the user's opening request, built from the user scenario
    user_scenario: str = ""  # JSON of the scenario (for USER-REHEARSE); no gold in it
    gold_actions: list[ToolCall] = Field(default_factory=list)  # scoring only
    source: dict[str, Any] = Field(default_factory=dict)  # the benchmark's own task record
    # Tool learning (METHOD.md §5): tools this task's context adds (one named like a domain tool
    # replaces it) and domain tools it hides. `envs.tau2.task_context` applies both.
    tools_added: list[ToolSpec] = Field(default_factory=list)
    tools_hidden: list[str] = Field(default_factory=list)


class TaskContext(BaseModel):
    """Everything a prompt may show about a task: no gold answer, no environment handle.

    Rehearsal receives only this, which is what makes it unable to reach the real environment.
    """

    task_id: str
    domain: str
    policy: str  # the domain's policy / documentation text (possibly truncated by config)
    tools: list[ToolSpec]
    first_user_message: str


class Generation(BaseModel):
    """One engine call's output for one sample: the exact ids fed and generated, and their log-probs.

    `prompt_ids` (length P) and `completion_ids` (length C) are what the engine saw and sampled;
    `logprobs` (length C) are the behaviour policy's log-probabilities of `completion_ids`
    (natural log, computed on logits / `temperature`). Training uses these ids unchanged.
    """

    role: Role
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    temperature: float = 1.0
    text: str = ""
    finish_reason: str = "stop"  # "stop" | "length"
    parse_error: Optional[str] = None  # the typed parse error's class name and message, if any
    schema_error: Optional[str] = None  # a well-formed call's UnknownTool / InvalidArguments, answered as a tool error


class Step(BaseModel):
    """One ACT turn: the action, the observation the trajectory continued with, and the real one."""

    action: Optional[ToolCall] = None  # None when ACT spoke to the user instead
    message: str = ""  # ACT's text to the user when it did not call a tool
    observation: Optional[Observation] = None  # imagined (rehearsal) or real (real rollout)
    real_observation: Optional[Observation] = None  # filled by replay, for fidelity
    fidelity: Optional[float] = None  # F(imagined, real) in [0, 1]
    schema_error: Optional[str] = None  # the call failed the tool list / schema: observation is that error, not rehearsed


class Trajectory(BaseModel):
    """One rollout of one task. `reward` is None when scoring failed (the rows are then masked)."""

    task_id: str
    group_index: int = 0
    imagined: bool = True  # True: self-unfolded (REHEARSE answered); False: real environment
    steps: list[Step] = Field(default_factory=list)
    generations: list[Generation] = Field(default_factory=list)
    termination: str = ""  # "agent_message" | "max_turns" | "parse_error" | "length"
    reward: Optional[float] = None
    sub_rewards: dict[str, float] = Field(default_factory=dict)
    reward_info: dict[str, Any] = Field(default_factory=dict)

    def tool_calls(self) -> list[ToolCall]:
        return [s.action for s in self.steps if s.action is not None]
