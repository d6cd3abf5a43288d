"""A lightweight verifier for imagined trajectories (METHOD.md §4, "Verifier filter", an extension).

A check is a function `envs.base.Check = Callable[[Trajectory, TaskContext], list[str]]` that returns the
reasons it rejects the trajectory (an empty list: it passes). `verify` runs a list of checks over
rehearsals and splits them into kept and rejected; `RehearsalAgent(verifier=...)` drops the rejected
ones from the rehearsal memory.

Checks look at the trajectory's steps and also at its generations: with strict ACT parsing
(`roles.act.parse_act`), an unknown tool or invalid arguments never become a step; the rehearsal ends
with a `parse_error` on the ACT generation instead, and the checks report that too.

"Imagined" observations: a step whose `observation` equals its `real_observation` came from the real
environment (e.g. the real prefix of a re-entry rehearsal) and is not held to the JSON rule; real
tau2 errors are plain "Error: ..." text.
The domains' code-checkable policy rules live with the domain (`envs.tau2.rules`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.base import Check, call_text
from envace_core.envs.tau2.rules import policy_rule_checks
from envace_core.roles.errors import InvalidArguments
from envace_core.roles.strict_json import strict_json
from envace_core.roles.tools import validate_arguments
from envace_core.types import Role, Step, TaskContext, Trajectory


def _parse_errors(traj: Trajectory, role: Role, classes: tuple[str, ...]) -> list[str]:
    return [g.parse_error for g in traj.generations
            if g.role == role and g.parse_error and g.parse_error.split(":", 1)[0] in classes]


def _is_imagined(step: Step) -> bool:
    return step.observation is not None and step.observation != step.real_observation


# ------------------------------------------------------------------------------------ format checks
def unknown_tool_check(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """Calls of a tool that `ctx.tools` does not have (steps, or ACT outputs that failed as `UnknownTool`)."""
    names = {t.name for t in ctx.tools}
    out = [f"unknown tool at step {k}: {s.action.name!r}" for k, s in enumerate(traj.steps)
           if s.action is not None and s.action.name not in names]
    return out + [f"unknown tool in ACT output: {e}" for e in _parse_errors(traj, Role.ACT, ("UnknownTool",))]


def schema_check(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """Calls whose arguments do not validate against the tool's JSON schema (`roles.validate_arguments`),
    and ACT outputs that failed as `InvalidArguments`. Calls of unknown tools are left to
    `unknown_tool_check`."""
    specs = {t.name: t for t in ctx.tools}
    out = []
    for k, s in enumerate(traj.steps):
        if s.action is None or s.action.name not in specs:
            continue
        try:
            validate_arguments(s.action.arguments, specs[s.action.name])
        except InvalidArguments as e:
            out.append(f"schema violation at step {k}: {e}")
    return out + [f"schema violation in ACT output: {e}"
                  for e in _parse_errors(traj, Role.ACT, ("InvalidArguments",))]


def json_response_check(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """Imagined observations that are not one valid JSON value, and REHEARSE outputs that failed to
    parse (`InvalidRehearsal`, `EmptyOutput`). Real observations are not checked (module docstring)."""
    out = []
    for k, s in enumerate(traj.steps):
        if not _is_imagined(s):
            continue
        try:
            strict_json(s.observation.content)
        except ValueError as e:
            out.append(f"imagined response at step {k} is not JSON ({e}): {s.observation.content[:80]!r}")
    return out + [f"rehearsed response is not JSON: {e}"
                  for e in _parse_errors(traj, Role.REHEARSE, ("InvalidRehearsal", "EmptyOutput"))]


FORMAT_CHECKS: tuple[Check, ...] = (unknown_tool_check, schema_check, json_response_check)


# --------------------------------------------------------------------------------- grounding check
def _leaves(value: Any) -> list[str]:
    """The scalar values inside a tool call's arguments, as case-folded text (booleans, None and empty
    strings are left out: they name nothing the user could have stated; an integral float is written as
    an integer, 2.0 as "2", the way a person writes it)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip().casefold()
    return [text] if text else []


def _stated(value: str, text: str) -> bool:
    """`value` occurs in `text` as a whole: not inside a longer word or number ("ABC12" is not in
    "ABC123", "100" is not in "$1000"). Both are case-folded already."""
    return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", text) is not None


def grounded(arguments: Any, told: str, empty: bool = False) -> bool:
    """A call's `arguments` are grounded in `told` (case-folded text): every scalar value (`_leaves`) occurs
    there as a whole word or number (`_stated`). A call with no such value (no arguments, or only booleans
    and nulls) gives `empty`."""
    leaves = _leaves(arguments)
    return all(_stated(v, told) for v in leaves) if leaves else empty


def grounded_error_check(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """Imagined error responses to calls whose arguments all come from what the agent was told.

    A call is grounded when it has at least one argument value and every scalar value in its arguments
    (`_leaves`) occurs as a whole word or number (`_stated`, case-folded) in the user's request
    (`ctx.first_user_message`) or in a successful real tool result earlier in the trajectory (a re-entry
    rehearsal's real prefix; only the opening request counts among the user's messages). REHEARSE sees no database:
    an imagined "not found" / "cannot be retrieved" for the user's own name, zip code or reservation id is
    a guess that contradicts the task's own data, and a rehearsal continued from it shows the committed
    ACT an episode of a different world (RESULTS.md, "Private Rehearsal with a per-role policy on
    held-out tasks": the kept rehearsals that cost three solved tasks all start this way). Real
    observations and schema refusals (`Step.schema_error`: the tool list refused the call before any
    rehearsal) are not checked. Limit: a task whose user states a wrong identifier on purpose has
    its true-error rehearsals dropped too.
    """
    grounding = ctx.first_user_message.casefold()
    out = []
    for k, s in enumerate(traj.steps):
        if s.action is None or s.observation is None:
            continue
        if not _is_imagined(s):
            if not s.observation.error:  # a real error repeats the refused value: that grounds nothing
                grounding += "\n" + s.observation.content.casefold()
            continue
        if s.schema_error is None and s.observation.error and grounded(s.action.arguments, grounding):
            out.append(f"imagined error at step {k} for {call_text(s)}, whose arguments all come from the "
                       f"request or a real result: {s.observation.content[:80]!r}")
    return out


def default_checks(domain: str, grounded_errors: bool = False) -> list[Check]:
    """The format checks (`FORMAT_CHECKS`) plus `policy_rule_checks(domain)`, and `grounded_error_check`
    when `grounded_errors` is true (config ``rehearsal.grounded_errors``)."""
    return [*FORMAT_CHECKS, *policy_rule_checks(domain), *([grounded_error_check] if grounded_errors else [])]


def verify(trajectories: Sequence[Trajectory], ctx: TaskContext, checks: Sequence[Check]
           ) -> tuple[list[Trajectory], list[tuple[Trajectory, list[str]]]]:
    """Split `trajectories` into (kept, rejected) by running every check on each (METHOD.md §4).

    A trajectory is rejected when any check returns a reason; `rejected` pairs it with all reasons
    of all checks, in check order. Order within kept and rejected follows the input.
    Raises `EnvaceError` when an entry of `checks` is not callable; an exception inside a check
    propagates (a broken check is a bug, not a verdict).
    """
    for c in checks:
        if not callable(c):
            raise EnvaceError(f"verifier check {c!r} is not callable")
    kept, rejected = [], []
    for t in trajectories:
        reasons = [r for c in checks for r in c(t, ctx)]
        if reasons:
            rejected.append((t, reasons))
        else:
            kept.append(t)
    return kept, rejected
