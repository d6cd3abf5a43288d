"""`ImplementationEnvironment`: a new tool backed by the user's Python implementation, for held-out measurement only."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from envace_core.types import Task, ToolCall, ToolSpec

if TYPE_CHECKING:
    pass
from envace_core.tool_learning.inputs import NewTool


class ImplementationEnvironment:
    """A real environment for tools no tau2 domain executes: each call runs the tool's
    `implementation` (``"module:function"``, called with the call's arguments as keywords) and the
    JSON of its return value is the observation; an exception or an unknown tool is an error
    observation. Used only to score held-out tasks (`measure`), never during adaptation.

    Args:
        implementations: {tool name: "module:function"}.
    Raises:
        ToolSchemaError: an implementation cannot be imported.
    """

    def __init__(self, implementations: dict[str, str]):
        self.fns = {n: NewTool(ToolSpec(name=n), "", path).load_implementation()
                    for n, path in implementations.items()}
        self.calls_made = 0

    def reset(self, task: Task) -> None:
        self.calls_made = 0

    def step(self, call: ToolCall):
        from envace_core.types import Observation

        self.calls_made += 1
        fn = self.fns.get(call.name)
        if fn is None:
            return Observation(content=f"Error: unknown tool {call.name!r}", error=True)
        try:
            return Observation(content=json.dumps(fn(**call.arguments), default=str))
        except Exception as e:  # noqa: BLE001 - a tool error is an observation, as in tau2
            return Observation(content=f"Error: {type(e).__name__}: {e}", error=True)
