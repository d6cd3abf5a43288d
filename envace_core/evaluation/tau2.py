"""tau2-bench evaluation through tau2's OWN orchestrator and evaluator (METHOD.md §4, §6).

* `EnvaceTau2Agent` is a tau2 ``LocalAgent``: tau2's ``Orchestrator`` drives it exactly like its own
  ``LLMAgent``. Each turn it converts the tau2 history to `envace_core.types.Message`s (the default
  greeting "Hi! How can I help you today?" and any other assistant text *before* the first user message
  are dropped, so the ACT prompt starts with the user's first message as in training), renders our ACT
  prompt (`roles.act_prompt_ids` over a `TaskContext` of the domain's tools and policy), generates with
  our engine (greedy by default) and parses strictly (`roles.parse_act`). A tool call becomes an
  ``AssistantMessage`` with one tau2 ``ToolCall``; a plain message becomes a text ``AssistantMessage``.
  **Parse failure**: the raw generated text is sent to the user as the message content (tau2's own
  ``LLMAgent`` would likewise pass a malformed reply through), or ``"(no output)"`` when it is empty
  (tau2 rejects empty messages); it is counted in ``agent.stats["parse_errors"]``.
  With ``rehearsal=RehearsalAgent(...)`` (mode "parallel"/"sequential", n, memory budget, verifier,
  reenter), the agent rehearses before its first real ACT step (with ``reenter``: before each) from a
  `TaskContext` plus the real history only, never from the tau2 environment (the agent holds no handle
  to it); the rehearsal memory goes into the ACT system prompt ("Notes from rehearsal").
* `EnvaceUserSimulator` subclasses tau2's ``UserSimulator``: same system prompt (tau2's global
  simulation guidelines + ``<scenario>``), same role flipping and the same stop test
  (``###STOP###``, ``###TRANSFER###``, ``###OUT-OF-SCOPE###`` via ``UserSimulator.is_stop``), but the
  reply comes from one of our `Engine`s, or from an OpenAI-compatible ``/chat/completions`` endpoint the
  user names (`OpenAIChatClient`, ``urllib`` only). User tools (telecom) are offered as text in the
  system prompt with our ``<tool_call>`` form and parsed leniently; a reply that is empty becomes
  ``###STOP###`` (counted in ``stats["empty"]``) since tau2 rejects empty messages.
* `run_tau2` runs tau2's ``Orchestrator`` per (task, trial) and scores with tau2's
  ``evaluate_simulation(EvaluationType.ALL)``. NL assertions need an LLM judge, which is unavailable
  offline: NL_ASSERTION is dropped from the task's reward basis (``nl_assertions`` says so in the
  result); a task judged only by NL assertions is reported unscored (reward None, left out of pass^k).
  pass^k is tau2's own ``tau2.metrics.agent_metrics.pass_hat_k`` (= C(c,k)/C(n,k), tau-bench,
  arXiv:2406.12045) averaged over tasks, as in tau2's ``compute_metrics``; success is tau2's
  ``is_successful`` (reward == 1). Trial t uses seed ``seed + t``.
  Resume: with ``cache_path``, each finished (domain, task, trial) result is appended to a JSONL file and
  a rerun skips those already there (the cache is not keyed by model/config: use one file per config).
"""

from __future__ import annotations

import json
import traceback
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core import EnvaceError
from envace_core.engines.base import Engine, SamplingParams
from envace_core.envs.tau2.tasks import load_tasks, tau2_task, truncate_policy
from envace_core.rehearsal.agent import RehearsalAgent, RehearsalRound
from envace_core.roles.act import CALL_FORMAT, act_prompt_ids, parse_act
from envace_core.roles.errors import ParseError, format_error
from envace_core.roles.tools import format_tool_call, render_tool
from envace_core.store.files import read_jsonl
from envace_core.types import (
    Message,
    Observation,
    Step,
    TaskContext,
    ToolCall,
    ToolSpec,
)

# isort: off
# tau2 only after envace_core (offline environment variables)
from tau2.agent.base import LocalAgent, ValidAgentInputMessage
from tau2.data_model.message import (
    APICompatibleMessage,
    AssistantMessage,
    MultiToolMessage,
    ToolMessage,
    UserMessage,
)
from tau2.data_model.message import ToolCall as Tau2ToolCall
from tau2.user.base import STOP
from tau2.user.user_simulator import UserSimulator
# isort: on

AGENT_NAME = "envace_agent"
USER_NAME = "envace_user_simulator"
NO_OUTPUT = "(no output)"
NL_SKIPPED = "skipped: no judge offline"


def tool_spec(tool: Any) -> ToolSpec:
    """Our `ToolSpec` of a tau2 ``Tool`` (its OpenAI schema)."""
    fn = tool.openai_schema["function"]
    return ToolSpec(name=fn["name"], description=fn.get("description", "") or "",
                    parameters=fn.get("parameters") or {"type": "object", "properties": {}})


def to_envace_history(messages: Sequence[Any]) -> list[Message]:
    """tau2 agent-side messages -> our `Message`s (assistant text before the first user message dropped;
    an assistant message with k tool calls becomes k assistant messages, each with one call)."""
    out: list[Message] = []
    seen_user = False
    for m in messages:
        if isinstance(m, MultiToolMessage):
            out.extend(to_envace_history(m.tool_messages))
        elif isinstance(m, UserMessage):
            seen_user = True
            out.append(Message(role="user", content=m.content or ""))
        elif isinstance(m, ToolMessage):
            out.append(Message(role="tool", content=m.content or "", error=bool(m.error)))
        elif isinstance(m, AssistantMessage):
            if m.is_tool_call():
                for c in m.tool_calls:
                    out.append(Message(role="assistant", tool_call=ToolCall(
                        name=c.name, arguments=dict(c.arguments), id=c.id)))
            elif seen_user and m.has_text_content():
                out.append(Message(role="assistant", content=m.content))
    return out


def history_steps(history: Sequence[Message]) -> list[Step]:
    """The real `Step`s behind an envace history (for rehearsal re-entry's `prefix`)."""
    steps: list[Step] = []
    for m in history:
        if m.role == "assistant" and m.tool_call is not None:
            steps.append(Step(action=m.tool_call))
        elif m.role == "assistant":
            steps.append(Step(message=m.content))
        elif m.role == "tool" and steps and steps[-1].action is not None and steps[-1].observation is None:
            obs = Observation(content=m.content, error=m.error)
            steps[-1].observation = obs
            steps[-1].real_observation = obs
    return steps


class EnvaceAgentState(BaseModel):
    """The agent's conversation (tau2 messages) and the rehearsal memory it currently acts with."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    messages: list[APICompatibleMessage] = Field(default_factory=list)
    memory: str = ""


class EnvaceTau2Agent(LocalAgent[EnvaceAgentState]):
    """Our policy as a tau2 agent (module docstring).

    Args:
        tools, domain_policy: as tau2 gives every ``LocalAgent`` (``env.get_tools()``, ``env.get_policy()``).
        engine: the policy's `Engine`.
        domain, task_id: labels of the `TaskContext` (prompt header / rehearsal bookkeeping).
        max_new_tokens, temperature (0 = greedy), top_p, seed: ACT sampling; call i uses ``seed + i``.
        strict: strict ACT parsing (`roles.parse_act`).
        rehearsal: a `RehearsalAgent` whose settings (mode, n, memory budget, verifier, reenter,
            rehearse params, seed) drive Private Rehearsal; None or mode "none": no rehearsal.
        policy_max_chars: truncate the policy text in prompts (`envs.tau2.truncate_policy`).
    Attributes:
        stats: ``act_calls``, ``tool_calls``, ``messages``, ``parse_errors``, ``rehearsal_rounds``, ``rehearsals``.
        parse_errors: the formatted parse errors, in order.
        rounds: every `RehearsalRound` run (its imagined trajectories, rejections and memory).
    """

    def __init__(self, tools, domain_policy: str, engine: Engine, domain: str = "", task_id: str = "",
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = 0, strict: bool = True, rehearsal: RehearsalAgent | None = None,
                 policy_max_chars: int | None = None):
        super().__init__(tools=tools, domain_policy=domain_policy)
        self.engine, self.domain, self.task_id = engine, domain, task_id
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.seed, self.strict, self.rehearsal = seed, strict, rehearsal
        self.specs = [tool_spec(t) for t in tools]
        self.policy = truncate_policy(domain_policy, policy_max_chars)
        self.stats: dict[str, int] = Counter(act_calls=0, tool_calls=0, messages=0, parse_errors=0,
                                             rehearsal_rounds=0, rehearsals=0)
        self.parse_errors: list[str] = []
        self.rounds: list[RehearsalRound] = []

    def get_init_state(self, message_history=None) -> EnvaceAgentState:
        return EnvaceAgentState(messages=list(message_history or []))

    def set_seed(self, seed: int):
        self.seed = seed

    def context(self, history: Sequence[Message]) -> TaskContext:
        first = next((m.content for m in history if m.role == "user"), "")
        return TaskContext(task_id=self.task_id, domain=self.domain, policy=self.policy,
                           tools=list(self.specs), first_user_message=first)

    def _rehearse(self, ctx: TaskContext, history: list[Message], turn: int) -> str:
        r = self.rehearsal.rehearse_round(ctx, history, history_steps(history), turn)  # no env handle
        self.rounds.append(r)
        self.stats["rehearsal_rounds"] += 1
        self.stats["rehearsals"] += len(r.rehearsals)
        return r.memory

    def generate_next_message(self, message: ValidAgentInputMessage, state: EnvaceAgentState):
        if isinstance(message, MultiToolMessage):
            state.messages.extend(message.tool_messages)
        elif message is not None:
            state.messages.append(message)
        history = to_envace_history(state.messages)
        ctx = self.context(history)
        turn = self.stats["act_calls"]
        if self.rehearsal is not None and self.rehearsal.mode != "none" and \
                (turn == 0 or self.rehearsal.reenter):
            state.memory = self._rehearse(ctx, history, turn)
        tok = self.engine.tokenizer
        prompt = act_prompt_ids(tok, ctx, history, state.memory or None)
        sp = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                            top_p=self.top_p, seed=None if self.seed is None else self.seed + turn)
        c = self.engine.generate([prompt], sp)[0][0]
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        self.stats["act_calls"] += 1
        try:
            out = parse_act(text, ctx.tools, strict=self.strict)
        except ParseError as e:
            self.stats["parse_errors"] += 1
            self.parse_errors.append(format_error(e))
            msg = AssistantMessage(role="assistant", content=text.strip() or NO_OUTPUT, cost=0.0)
        else:
            if out.tool_call is not None:
                self.stats["tool_calls"] += 1
                msg = AssistantMessage(role="assistant", content=None, cost=0.0, tool_calls=[Tau2ToolCall(
                    id=f"call_{uuid.uuid4().hex[:12]}", name=out.tool_call.name,
                    arguments=out.tool_call.arguments, requestor="assistant")])
            else:
                self.stats["messages"] += 1
                msg = AssistantMessage(role="assistant", content=out.message, cost=0.0)
        state.messages.append(msg)
        return msg, state


# ------------------------------------------------------------------------------------- user


class OpenAIChatClient:
    """A minimal OpenAI-compatible chat client (``POST {base_url}/chat/completions``, urllib only)."""

    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY", timeout: float = 120.0):
        self.base_url, self.model, self.api_key, self.timeout = base_url.rstrip("/"), model, api_key, timeout

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, seed: int | None) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        req = urllib.request.Request(f"{self.base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            data = json.loads(r.read().decode())
        return data["choices"][0]["message"].get("content") or ""


class EnvaceUserSimulator(UserSimulator):
    """tau2's user simulator with the reply generated locally (module docstring).

    Exactly one of `engine` (an `Engine`) or `client` (e.g. `OpenAIChatClient`) must be given.
    """

    def __init__(self, tools=None, instructions=None, engine: Engine | None = None,
                 client: OpenAIChatClient | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, seed: int | None = 0, **_: Any):
        super().__init__(tools=tools, instructions=instructions, llm=None, llm_args={})
        if (engine is None) == (client is None):
            raise EnvaceError("EnvaceUserSimulator needs exactly one of engine= or client=")
        self.engine, self.client = engine, client
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.specs = [tool_spec(t) for t in tools] if tools else []
        self.stats: dict[str, int] = Counter(calls=0, empty=0, tool_calls=0)

    def set_seed(self, seed: int):
        self.seed = seed

    @property
    def system_prompt(self) -> str:
        base = super().system_prompt
        if not self.specs:
            return base
        tools = "\n".join(render_tool(t) for t in self.specs)
        return f"{base}\n\n# Your tools\n{tools}\n\n{CALL_FORMAT}"

    @staticmethod
    def _chat(messages) -> list[dict]:
        out = []
        for m in messages:
            content = m.content or ""
            if getattr(m, "tool_calls", None):
                calls = "\n".join(format_tool_call(ToolCall(name=c.name, arguments=dict(c.arguments)))
                                  for c in m.tool_calls)
                content = f"{content}\n{calls}".strip()
            out.append({"role": m.role, "content": content})
        return out

    def _reply(self, chat: list[dict]) -> str:
        seed = None if self.seed is None else self.seed + self.stats["calls"]
        self.stats["calls"] += 1
        if self.client is not None:
            return self.client.chat(chat, self.max_new_tokens, self.temperature, seed)
        tok = self.engine.tokenizer
        prompt = [int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)]
        sp = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=seed)
        c = self.engine.generate([prompt], sp)[0][0]
        return tok.decode(c.token_ids, skip_special_tokens=True)

    def _generate_next_message(self, message, state):
        if isinstance(message, MultiToolMessage):
            state.messages.extend(message.tool_messages)
        else:
            state.messages.append(message)
        text = self._reply(self._chat(state.system_messages + state.flip_roles())).strip()
        msg = None
        if self.specs and "<tool_call" in text:
            try:
                out = parse_act(text, self.specs, strict=False)
            except ParseError:
                out = None
            if out is not None and out.tool_call is not None:
                self.stats["tool_calls"] += 1
                msg = UserMessage(role="user", content=None, cost=0.0, tool_calls=[Tau2ToolCall(
                    id=f"call_{uuid.uuid4().hex[:12]}", name=out.tool_call.name,
                    arguments=out.tool_call.arguments, requestor="user")])
        if msg is None:
            if not text:
                self.stats["empty"] += 1
                text = STOP
            msg = UserMessage(role="user", content=text, cost=0.0)
        state.messages.append(msg)
        return msg, state


def register(registry=None) -> None:
    """Register `EnvaceTau2Agent` as ``"envace_agent"`` and `EnvaceUserSimulator` as
    ``"envace_user_simulator"`` in tau2's registry (idempotent). The orchestrator itself does not need
    it; it makes the classes visible to tau2's own listings."""
    if registry is None:
        from tau2.registry import registry
    if AGENT_NAME not in registry.get_agents():
        registry.register_agent(EnvaceTau2Agent, AGENT_NAME)
    if USER_NAME not in registry.get_users():
        registry.register_user(EnvaceUserSimulator, USER_NAME)


register()


# ------------------------------------------------------------------------------------ running


def build_orchestrator(domain: str, task, engine: Engine, user_engine: Engine | None = None, *,
                       user_client: OpenAIChatClient | None = None, rehearsal: RehearsalAgent | None = None,
                       environment=None, max_steps: int = 100, max_errors: int = 10, seed: int | None = 0,
                       agent_kwargs: dict | None = None, user_kwargs: dict | None = None):
    """tau2's ``Orchestrator`` for one tau2 ``task`` with our agent and user (as tau2's ``run_task`` builds
    it). `environment`: a tau2 ``Environment`` (default: a fresh one from the registry)."""
    from tau2.orchestrator.orchestrator import Orchestrator
    from tau2.registry import registry

    env = environment if environment is not None else registry.get_env_constructor(domain)()
    agent = EnvaceTau2Agent(tools=env.get_tools(), domain_policy=env.get_policy(), engine=engine, domain=domain,
                            task_id=f"{domain}/{task.id}", rehearsal=rehearsal, seed=seed, **(agent_kwargs or {}))
    try:
        user_tools = env.get_user_tools()
    except ValueError:  # tau2: "User tools not available"
        user_tools = None
    user = EnvaceUserSimulator(tools=user_tools or None, instructions=str(task.user_scenario),
                               engine=None if user_client is not None else (user_engine or engine),
                               client=user_client, seed=seed, **(user_kwargs or {}))
    orch = Orchestrator(domain=domain, agent=agent, user=user, environment=env, task=task,
                        max_steps=max_steps, max_errors=max_errors, seed=seed)
    return orch, agent, user


def evaluate(domain: str, task, simulation) -> dict:
    """tau2's ``evaluate_simulation(EvaluationType.ALL)`` with NL_ASSERTION dropped from the basis
    (module docstring). Returns reward (None if unscorable offline), breakdown, notes."""
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    out: dict[str, Any] = {"nl_assertions": None}
    ec = task.evaluation_criteria
    if ec is not None and RewardType.NL_ASSERTION in ec.reward_basis:
        basis = [b for b in ec.reward_basis if b != RewardType.NL_ASSERTION]
        out["nl_assertions"] = NL_SKIPPED
        if not basis:
            return {**out, "reward": None, "reward_breakdown": {}, "db_match": None,
                    "note": f"judged only by NL assertions: {NL_SKIPPED}"}
        task = task.model_copy(deep=True)
        task.evaluation_criteria.reward_basis = basis
    ri = evaluate_simulation(simulation=simulation, task=task, evaluation_type=EvaluationType.ALL,
                             solo_mode=False, domain=domain)
    return {**out, "reward": float(ri.reward),
            "reward_breakdown": {(k.value if hasattr(k, "value") else str(k)): float(v)
                                 for k, v in (ri.reward_breakdown or {}).items()},
            "db_match": ri.db_check.db_match if ri.db_check is not None else None,
            "note": (ri.info or {}).get("note")}


def pass_hat_ks(successes: dict[str, list[bool]], max_k: int) -> dict[int, float]:
    """Mean over tasks of tau2's ``pass_hat_k(n, c, k)`` for k = 1..max_k (tasks with < k trials skipped)."""
    from tau2.metrics.agent_metrics import pass_hat_k

    out = {}
    for k in range(1, max_k + 1):
        vals = [pass_hat_k(len(s), sum(s), k) for s in successes.values() if len(s) >= k]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def summarize(results: list[dict], trials: int) -> dict:
    """Per-domain report of result records (see `run_tau2`)."""
    from tau2.metrics.agent_metrics import is_successful

    report: dict[str, Any] = {}
    by_domain: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_domain[r["domain"]].append(r)
    for dom, rs in by_domain.items():
        scored = [r for r in rs if r.get("reward") is not None]
        succ: dict[str, list[bool]] = defaultdict(list)
        for r in scored:
            succ[r["task_id"]].append(is_successful(r["reward"]))
        keys = sorted({k for r in scored for k in r.get("reward_breakdown", {})})
        report[dom] = {
            "n_tasks": len({r["task_id"] for r in rs}), "n_results": len(rs), "n_scored": len(scored),
            "pass_hat_k": pass_hat_ks(succ, trials),
            "avg_reward": sum(r["reward"] for r in scored) / len(scored) if scored else None,
            "reward_breakdown": {k: sum(r["reward_breakdown"][k] for r in scored if k in r["reward_breakdown"])
                                 / sum(1 for r in scored if k in r["reward_breakdown"]) for k in keys},
            "termination_reasons": dict(Counter(r["termination_reason"] for r in rs)),
            "nl_assertions_skipped": sum(1 for r in rs if r.get("nl_assertions")),
            "errors": sum(1 for r in rs if r.get("error")),
            "parse_errors": sum(r.get("agent_stats", {}).get("parse_errors", 0) for r in rs),
        }
    return report


_CACHE_FIELDS = {"domain": str, "task_id": str, "trial": int, "termination_reason": str}


def _cache_record(r: Any) -> dict:
    """`r` if a cache line holds a record `summarize` can use (the fields it reads, with their types),
    else TypeError (`storage.read_jsonl` then skips it)."""
    num = (int, float)
    if not (isinstance(r, dict) and all(isinstance(r.get(k), t) for k, t in _CACHE_FIELDS.items())
            and (r.get("reward") is None or isinstance(r["reward"], num))
            and isinstance(r.get("reward_breakdown"), dict)
            and all(isinstance(v, num) for v in r["reward_breakdown"].values())
            and isinstance(r.get("agent_stats", {}), dict)):
        raise TypeError("not a tau2 cache record")
    return r


def _load_cache(path: Path | None) -> dict[tuple, dict]:
    """{(domain, task_id, trial): record} from a `run_tau2` cache. A line that is not JSON (cut by a kill
    mid-write) or not a record (`_cache_record`) is skipped, so that (task, trial) runs again; one
    warning per file names it (`storage.read_jsonl`)."""
    if path is None:
        return {}
    return {(r["domain"], r["task_id"], r["trial"]): r for r in read_jsonl(path, _cache_record)}


def run_tau2(engine: Engine, domain: str, task_ids: Sequence[str] | None = None, split: str = "test",
             trials: int = 1, user_engine: Engine | None = None, rehearsal: RehearsalAgent | None = None,
             max_steps: int = 100, max_errors: int = 10, seed: int = 0, cache_path: str | Path | None = None,
             user_client: OpenAIChatClient | None = None, agent_kwargs: dict | None = None,
             user_kwargs: dict | None = None, raise_errors: bool = False) -> dict:
    """Run tau2's orchestrator on `domain`'s `split` tasks (or `task_ids`, tau2 ids or "<domain>/<id>")
    `trials` times each and score with tau2's evaluator.

    The user is `user_engine` (default: `engine`) or `user_client`. A (task, trial) that raises is
    recorded with ``error`` and reward 0 (or re-raised with `raise_errors`).

    Returns ``{"domains": summarize(...), "results": [records], "skipped": n_from_cache}``; a record has
    domain, task_id, trial, seed, reward, reward_breakdown, db_match, termination_reason, nl_assertions,
    note, agent_stats, user_stats, n_messages, error.
    """
    if trials < 1:
        raise EnvaceError(f"trials must be >= 1, got {trials}")
    tasks = load_tasks(domain, split)
    if task_ids is not None:
        want = [str(t).split("/", 1)[1] if str(t).startswith(f"{domain}/") else str(t) for t in task_ids]
        by_id = {t.id.split("/", 1)[1]: t for t in tasks}
        missing = [w for w in want if w not in by_id]
        if missing:
            raise EnvaceError(f"unknown {domain}/{split} task ids: {missing}")
        tasks = [by_id[w] for w in want]
    path = Path(cache_path) if cache_path is not None else None
    cache = _load_cache(path)
    results, skipped = [], 0
    for task in tasks:
        t2 = tau2_task(task)
        for trial in range(trials):
            key = (domain, t2.id, trial)
            if key in cache:
                results.append(cache[key])
                skipped += 1
                continue
            rec: dict[str, Any] = {"domain": domain, "task_id": t2.id, "trial": trial, "seed": seed + trial,
                                   "error": None}
            try:
                orch, agent, user = build_orchestrator(
                    domain, t2, engine, user_engine, user_client=user_client, rehearsal=rehearsal,
                    max_steps=max_steps, max_errors=max_errors, seed=seed + trial,
                    agent_kwargs=agent_kwargs, user_kwargs=user_kwargs)
                sim = orch.run()
                rec.update(evaluate(domain, t2, sim))
                rec.update(termination_reason=str(getattr(sim.termination_reason, "value", sim.termination_reason)),
                           agent_stats=dict(agent.stats), user_stats=dict(user.stats), n_messages=len(sim.messages))
            except Exception as e:
                if raise_errors:
                    raise
                rec.update(reward=0.0, reward_breakdown={}, termination_reason="error",
                           error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
            results.append(rec)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps(rec, sort_keys=True, default=str) + "\n")
    return {"domains": summarize(results, trials), "results": results, "skipped": skipped}
