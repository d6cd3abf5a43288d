"""`Tau2Environment`: a private deep copy of a tau2 domain's environment, stepped by tool calls and scored by tau2's evaluator."""

from __future__ import annotations

import uuid
from typing import Any

import envace_core  # noqa: F401  (offline environment variables before tau2 is imported)
from envace_core import EnvaceError
from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.envs.tau2.observations import real_observation, tau2_content
from envace_core.envs.tau2.tasks import (
    NL_SKIPPED,
    check_domain,
    domain_static,
    tau2_registry,
    tau2_task,
)
from envace_core.types import Observation, Step, Task, ToolCall, ToolSpec

# ------------------------------------------------------------------------------ message lists


def unanswered_tool_calls(messages: list[Any]) -> list[str]:
    """Ids of the tool calls in a tau2 message list that no ToolMessage answers, in order.

    tau2's pairing rule (``Environment.set_state``, which ``EnvironmentEvaluator`` runs on the whole
    message list): each tool call of an assistant or user message is followed at once by the
    ToolMessage with its id. A list that ends in a call (the run stopped before its result came back)
    makes tau2's evaluator raise ``ValueError("Tool message expected ...")``; scorers check this first.
    """
    from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage

    out: list[str] = []
    for i, m in enumerate(messages):
        if isinstance(m, (AssistantMessage, UserMessage)) and m.is_tool_call():
            after = messages[i + 1:i + 1 + len(m.tool_calls)]
            for k, tc in enumerate(m.tool_calls):
                answer = after[k] if k < len(after) else None
                if not (isinstance(answer, ToolMessage) and answer.id == tc.id):
                    out.append(tc.id)
    return out


# ---------------------------------------------------------------------------------- environment


class Tau2Environment(ToolEnvironment):
    """One private, executable tau2 domain environment (see `ToolEnvironment`).

    `step` executes for real through tau2's ``Environment.get_response`` as the assistant; tool
    errors (including unknown tools and bad arguments) come back as ``Observation(error=True)`` whose
    content is ``{"error":"<tau2's message>"}`` (`observations.real_observation`), never as exceptions.
    """

    def __init__(self, domain: str):
        self.domain = check_domain(domain)
        self.calls_made = 0
        self._task: Task | None = None
        self._env_obj = None  # built on first use (reset, or step/snapshot before any reset)

    def _fresh_env(self):
        # The constructor loads the domain DB from the package's data file: a new private copy.
        return tau2_registry().get_env_constructor(self.domain)()

    @property
    def _env(self):
        if self._env_obj is None:
            self._env_obj = self._fresh_env()
        return self._env_obj

    def tools(self) -> list[ToolSpec]:
        return [t.model_copy(deep=True) for t in domain_static(self.domain)[0]]

    def policy(self) -> str:
        return domain_static(self.domain)[1]

    def reset(self, task: Task) -> None:
        """Fresh domain state with the task's ``initial_state`` applied (``initialization_data``,
        ``initialization_actions``, ``message_history``) via tau2's ``set_state``. Raises EnvaceError
        if `task` belongs to another domain or has no tau2 source."""
        if task.domain != self.domain:
            raise EnvaceError(f"task {task.id!r} is of domain {task.domain!r}, environment is {self.domain!r}")
        t = tau2_task(task)
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
        """Execute `call` for real (counts in `calls_made`, whatever the outcome); the result in its
        canonical rendering (`observations.real_observation`: compact JSON, the tool's view, an
        error as ``{"error": "<message>"}``), the text ACT's history and fidelity see."""
        msg = self._raw_step(call)
        return real_observation(call.name, msg.content if msg.content is not None else "", bool(msg.error))

    def _raw_step(self, call: ToolCall):
        """tau2's own ``ToolMessage`` of `call` executed for real (counts in `calls_made`)."""
        from tau2.data_model.message import ToolCall as Tau2ToolCall
        from tau2.data_model.message import ToolMessage

        self.calls_made += 1
        if not isinstance(call.arguments, dict):  # pragma: no cover - pydantic already enforces
            return ToolMessage(id=call.id or "call", role="tool", requestor="assistant", error=True,
                               content=f"Error: arguments of {call.name!r} must be a JSON object")
        tc = Tau2ToolCall(id=call.id or "call", name=call.name, arguments=call.arguments,
                          requestor="assistant")
        return self._env.get_response(tc)  # never raises: tau2 turns exceptions into "Error: ..."

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
        ToolMessage with the real observation in tau2's own text (`observations.tau2_content`; tau2's
        evaluator compares it with its own replay) (or an AssistantMessage with the step's text when
        it has no action), then a final AssistantMessage with `final_message` (omitted when empty or
        equal to the last action-less step's text). Tool-call ids are ``call_<i>`` (i = step index)
        so each ToolMessage pairs with its call."""
        from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage
        from tau2.data_model.message import ToolCall as Tau2ToolCall

        t = tau2_task(task)
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
                msgs.append(ToolMessage(id=cid, role="tool", content=tau2_content(s.action.name, obs),
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
        t = tau2_task(task)
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
