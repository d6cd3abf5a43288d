"""Our policy and our user simulator as tau2-bench participants, for tau2's own ``Orchestrator`` (METHOD.md §4, §6).

* `EnvaceTau2Agent` is a tau2 ``LocalAgent``: tau2's ``Orchestrator`` drives it exactly like its own
  ``LLMAgent``. It plays a `RehearsalAgent` (the evaluated policy: engine, ACT sampling, Private
  Rehearsal settings). Each turn it converts the tau2 history to `envace_core.types.Message`s (the
  default greeting "Hi! How can I help you today?" and any other assistant text *before* the first
  user message are dropped, so the ACT prompt starts with the user's first message as in training),
  renders our ACT prompt (`roles.act_prompt_ids` over a `TaskContext` of the domain's tools and
  policy), generates with the agent's engine at its ``act`` settings (max_new_tokens_act, temperature,
  top_p, strict) and parses (`roles.parse_act`). A tool call becomes an ``AssistantMessage`` with one
  tau2 ``ToolCall``; a plain message becomes a text ``AssistantMessage``. With the ``act`` settings'
  ``schema_errors`` (``rollout.schema_errors``), a well-formed call of an unknown tool or with invalid
  arguments is sent too, and tau2's environment answers it with its own ``"Error: ..."`` message
  (counted in ``stats["schema_errors"]``).
  **Parse failure**: the raw generated text is sent to the user as the message content (tau2's own
  ``LLMAgent`` would likewise pass a malformed reply through), or ``"(no output)"`` when it is empty
  (tau2 rejects empty messages); it is counted in ``agent.stats["parse_errors"]`` (a call in another
  family's format is one, ``ForeignToolCallFormat``, unless the ``act`` settings are ``lenient``:
  ``eval.lenient_tool_format``). Tool results in the prompt are cut to ``act.max_observation_tokens``;
  an ACT prompt that still does not fit the model's context is not generated: the agent sends
  `PROMPT_TOO_LONG`, which ends the dialogue (``is_stop``), counted in ``stats["prompt_too_long"]``.
  With a rehearsal mode other than "none" the agent rehearses before its first real ACT step (with
  ``reenter``: before each) from a `TaskContext` plus the real history only, never from the tau2
  environment (the agent holds no handle to it); the rehearsal memory goes into the ACT system prompt
  ("Notes from rehearsal").
* `EnvaceUserSimulator` subclasses tau2's ``UserSimulator``: same system prompt (tau2's global
  simulation guidelines + ``<scenario>``), same role flipping and the same stop test
  (``###STOP###``, ``###TRANSFER###``, ``###OUT-OF-SCOPE###`` via ``UserSimulator.is_stop``), but the
  reply comes from one of our `Engine`s, or from an OpenAI-compatible ``/chat/completions`` endpoint the
  user names (`roles.user.OpenAIChatClient`, ``urllib`` only; an endpoint that cannot be reached,
  answers with an error or replies with no message text raises `roles.user.EndpointError`, which ends the
  run rather than the dialogue).
  User tools (telecom) are offered as text in the
  system prompt with our ``<tool_call>`` form and parsed (`roles.act.parse_act`, text around the call
  allowed) whenever the user has tools; a reply that fails to parse, a call in another family's format
  included, is sent as a message and counted in ``stats["parse_errors"]`` (and by class in
  ``parse_error_classes``); an engine's reply that is empty becomes ``###STOP###`` (counted in
  ``stats["empty"]``) since tau2 rejects empty messages.
  `SimulatedUser` says which model plays it.

Running and scoring them is `evaluation.tau2` (the harness).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core import EnvaceError
from envace_core.engines.base import Engine, SamplingParams
from envace_core.envs.tau2.tasks import tool_spec, truncate_policy
from envace_core.rehearsal.agent import RehearsalAgent, RehearsalRound
from envace_core.roles.act import CALL_FORMAT, act_prompt_ids, parse_act
from envace_core.roles.bounds import PromptTooLong, check_prompt, prompt_limit
from envace_core.roles.constrained import ActConstraint
from envace_core.roles.errors import ParseError, format_error
from envace_core.roles.tools import format_tool_call, render_tool
from envace_core.roles.user import EndpointError, OpenAIChatClient  # noqa: F401  (their home before)
from envace_core.types import (
    Message,
    Observation,
    Step,
    TaskContext,
    ToolCall,
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
# The agent's last message when its ACT prompt no longer fits the model's context: `is_stop` ends the
# dialogue on it (tau2's AGENT_STOP), and tau2's evaluator scores what was done so far.
PROMPT_TOO_LONG = "(prompt too long: the conversation no longer fits the model's context)"


def to_envace_history(messages: Sequence[Any], _names: dict[str, str] | None = None) -> list[Message]:
    """tau2 agent-side messages -> our `Message`s (assistant text before the first user message dropped;
    an assistant message with k tool calls becomes k assistant messages, each with one call). Tool
    results get the canonical rendering real results have everywhere else (`envs.tau2.observations.
    real_observation`, by the name of the call whose id they answer), so ACT sees one format whichever
    protocol runs it."""
    from envace_core.envs.tau2.observations import real_observation

    out: list[Message] = []
    names = {} if _names is None else _names  # tool call id -> tool name
    seen_user = False
    for m in messages:
        if isinstance(m, MultiToolMessage):
            out.extend(to_envace_history(m.tool_messages, names))
        elif isinstance(m, UserMessage):
            seen_user = True
            out.append(Message(role="user", content=m.content or ""))
        elif isinstance(m, ToolMessage):
            obs = real_observation(names.get(m.id, ""), m.content or "", bool(m.error))
            out.append(Message(role="tool", content=obs.content, error=obs.error))
        elif isinstance(m, AssistantMessage):
            if m.is_tool_call():
                names.update({c.id: c.name for c in m.tool_calls})
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
        agent: the evaluated policy: its engine, ``act`` settings (max_new_tokens_act, temperature
            (0 = greedy), top_p, strict, constrained: ACT's format as a decoding constraint,
            `roles.constrained`) and Private Rehearsal settings (mode, n, memory budget,
            verifier, reenter, rehearse params); mode "none": no rehearsal.
        domain, task_id: labels of the `TaskContext` (prompt header / rehearsal bookkeeping).
        seed: ACT call i uses ``seed + i`` (None: unseeded); tau2's Orchestrator sets it (`set_seed`).
        policy_max_chars: truncate the policy text in prompts (`envs.tau2.truncate_policy`).
    Attributes:
        stats: ``act_calls``, ``tool_calls``, ``messages``, ``parse_errors``, ``prompt_too_long``,
            ``rehearsal_rounds``, ``rehearsals``, ``rejected`` (rehearsals the verifier dropped).
        parse_errors: the formatted parse errors, in order.
        rounds: every `RehearsalRound` run (its imagined trajectories, rejections and memory).
    """

    def __init__(self, tools, domain_policy: str, agent: RehearsalAgent, domain: str = "", task_id: str = "",
                 seed: int | None = 0, policy_max_chars: int | None = None):
        super().__init__(tools=tools, domain_policy=domain_policy)
        self.agent, self.engine, self.domain, self.task_id = agent, agent.engine, domain, task_id
        self.seed = seed
        self.specs = [tool_spec(t) for t in tools]
        self.policy = truncate_policy(domain_policy, policy_max_chars)
        self.stats: dict[str, int] = Counter(act_calls=0, tool_calls=0, messages=0, parse_errors=0, schema_errors=0,
                                             prompt_too_long=0, rehearsal_rounds=0, rehearsals=0, rejected=0)
        self.parse_errors: list[str] = []
        self.rounds: list[RehearsalRound] = []

    def get_init_state(self, message_history=None) -> EnvaceAgentState:
        return EnvaceAgentState(messages=list(message_history or []))

    def set_seed(self, seed: int):
        self.seed = seed

    @classmethod
    def is_stop(cls, message: AssistantMessage) -> bool:
        """True for the agent's `PROMPT_TOO_LONG` message only (our agent ends a dialogue by no token)."""
        return message.content == PROMPT_TOO_LONG

    def context(self, history: Sequence[Message]) -> TaskContext:
        first = next((m.content for m in history if m.role == "user"), "")
        return TaskContext(task_id=self.task_id, domain=self.domain, policy=self.policy,
                           tools=list(self.specs), first_user_message=first)

    def _rehearse(self, ctx: TaskContext, history: list[Message], turn: int) -> str:
        r = self.agent.rehearse_round(ctx, history, history_steps(history), turn)  # no env handle
        self.rounds.append(r)
        self.stats["rehearsal_rounds"] += 1
        self.stats["rehearsals"] += len(r.rehearsals)
        self.stats["rejected"] += len(r.rejected)
        return r.memory

    def generate_next_message(self, message: ValidAgentInputMessage, state: EnvaceAgentState):
        if isinstance(message, MultiToolMessage):
            state.messages.extend(message.tool_messages)
        elif message is not None:
            state.messages.append(message)
        history = to_envace_history(state.messages)
        ctx = self.context(history)
        turn = self.stats["act_calls"]
        if self.agent.mode != "none" and (turn == 0 or self.agent.reenter):
            state.memory = self._rehearse(ctx, history, turn)
        tok, act = self.engine.tokenizer, self.agent.act
        prompt = act_prompt_ids(tok, ctx, history, state.memory or None, act.max_observation_tokens)
        if self.agent.memory_turns == 1:  # a consensus memory serves the turn after its round only
            state.memory = ""
        try:
            check_prompt("act", prompt, prompt_limit(self.engine, act.max_new_tokens_act, act.max_prompt_tokens))
        except PromptTooLong as e:
            self.stats["prompt_too_long"] += 1
            self.parse_errors.append(format_error(e))
            msg = AssistantMessage(role="assistant", content=PROMPT_TOO_LONG, cost=0.0)
            state.messages.append(msg)
            return msg, state
        fmt = (ActConstraint(tok, [t.name for t in ctx.tools]),) if act.constrained and ctx.tools else None
        sp = SamplingParams(max_new_tokens=act.max_new_tokens_act, temperature=act.temperature,
                            top_p=act.top_p, seed=None if self.seed is None else self.seed + turn, constraints=fmt)
        c = self.engine.generate([prompt], sp)[0][0]
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        self.stats["act_calls"] += 1
        try:
            out = parse_act(text, ctx.tools, strict=act.strict, lenient=act.lenient, schema_errors=act.schema_errors)
        except ParseError as e:
            self.stats["parse_errors"] += 1
            self.parse_errors.append(format_error(e))
            msg = AssistantMessage(role="assistant", content=text.strip() or NO_OUTPUT, cost=0.0)
        else:
            if out.tool_call is not None:  # a schema error goes to tau2, which answers "Error: ..."
                self.stats["tool_calls"] += 1
                self.stats["schema_errors"] += out.schema_error is not None
                msg = AssistantMessage(role="assistant", content=None, cost=0.0, tool_calls=[Tau2ToolCall(
                    id=f"call_{uuid.uuid4().hex[:12]}", name=out.tool_call.name,
                    arguments=out.tool_call.arguments, requestor="assistant")])
            else:
                self.stats["messages"] += 1
                msg = AssistantMessage(role="assistant", content=out.message, cost=0.0)
        state.messages.append(msg)
        return msg, state


# ------------------------------------------------------------------------------------- user


@dataclass(frozen=True)
class SimulatedUser:
    """Who plays tau2's user: `engine` (an `Engine`), or `client` (an OpenAI-compatible endpoint), or
    neither: the evaluated policy's own engine. Replies are at most `max_new_tokens` tokens, sampled at
    `temperature` (0 = greedy); reply i of a dialogue uses the dialogue's seed + i."""

    engine: Engine | None = None
    client: OpenAIChatClient | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    description: str = "the evaluated policy itself (its own engine)"
    lenient: bool = False  # user tool calls in another family's format: parsed (True) or parse errors

    def simulator(self, tools, instructions: str, policy_engine: Engine, seed: int | None) -> "EnvaceUserSimulator":
        """The `EnvaceUserSimulator` of one dialogue (tau2 user `tools`, the task's scenario text)."""
        if self.engine is not None and self.client is not None:
            raise EnvaceError("SimulatedUser takes at most one of engine= and client=")
        return EnvaceUserSimulator(tools=tools, instructions=instructions,
                                   engine=None if self.client is not None else (self.engine or policy_engine),
                                   client=self.client, max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, seed=seed, lenient=self.lenient)


class EnvaceUserSimulator(UserSimulator):
    """tau2's user simulator with the reply generated locally (module docstring).

    Exactly one of `engine` (an `Engine`) or `client` (e.g. `OpenAIChatClient`) must be given.
    `lenient`: `parse_act`'s lenient mode for the user's tool calls. ``stats``: ``calls``, ``empty``,
    ``tool_calls``, ``parse_errors``; ``parse_error_classes`` counts the parse errors by class
    (e.g. ``ForeignToolCallFormat``).
    """

    def __init__(self, tools=None, instructions=None, engine: Engine | None = None,
                 client: OpenAIChatClient | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, seed: int | None = 0, lenient: bool = False, **_: Any):
        super().__init__(tools=tools, instructions=instructions, llm=None, llm_args={})
        if (engine is None) == (client is None):
            raise EnvaceError("EnvaceUserSimulator needs exactly one of engine= or client=")
        self.engine, self.client = engine, client
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.specs = [tool_spec(t) for t in tools] if tools else []
        self.lenient = lenient
        self.stats: dict[str, int] = Counter(calls=0, empty=0, tool_calls=0, parse_errors=0)
        self.parse_error_classes: dict[str, int] = Counter()

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
        if self.specs and text:  # any format: a call in another family's format is counted, not sent silently
            try:
                out = parse_act(text, self.specs, strict=False, lenient=self.lenient)
            except ParseError as e:
                self.stats["parse_errors"] += 1
                self.parse_error_classes[type(e).__name__] += 1
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


