"""The USER-REHEARSE role (METHOD.md §1): the user scenario → prompt, and the parser of the imagined user turn."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from envace_core import EnvaceError
from envace_core.roles.chat import chat_ids
from envace_core.roles.errors import EmptyOutput, InvalidUserTurn
from envace_core.roles.foreign import find_foreign_call
from envace_core.roles.tools import TOOL_CALL_CLOSE
from envace_core.types import Message

# ---------------------------------------------------------------------------------- USER-REHEARSE
# tau2's own user-simulator constants (tau2.user.base / tau2.orchestrator.orchestrator); copied so that
# importing roles does not import tau2, and checked against tau2 in tests/test_roles.py.
USER_STOP_TOKENS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")
AGENT_GREETING = "Hi! How can I help you today?"


def user_instructions(user_scenario: str) -> str:
    """The user's instructions as tau2's user simulator shows them: ``str(tau2 UserScenario)`` of the
    task's `user_scenario` JSON (persona, reason for call, known / unknown info, task instructions).

    Raises `EnvaceError` naming `Task.user_scenario` when it is not a tau2 user-scenario JSON.
    """
    from tau2.data_model.tasks import UserScenario

    try:
        return str(UserScenario.model_validate(json.loads(user_scenario)))
    except Exception as e:  # noqa: BLE001 - json and pydantic errors alike: not a tau2 scenario
        raise EnvaceError(f"Task.user_scenario is not a tau2 user-scenario JSON ({type(e).__name__}: "
                          f"{str(e)[:120]}); load tau2 tasks with envs.tau2.load_tasks") from None


@functools.cache
def _user_system(instructions: str) -> str:
    """tau2's user-simulator system prompt, built by tau2's own template and guidelines file."""
    from tau2.user.user_simulator import SYSTEM_PROMPT, get_global_user_sim_guidelines

    return SYSTEM_PROMPT.format(global_user_sim_guidelines=get_global_user_sim_guidelines(use_tools=False),
                                instructions=instructions)


def user_messages(instructions: str, history: list[Message]) -> list[dict]:
    """USER-REHEARSE's chat messages (METHOD.md §1, multi-agent rehearsal): the policy plays the user.

    The same prompt tau2's `UserSimulator` builds, so a policy trained in this role can serve as the
    evaluation user simulator (`evaluation.tau2.EnvaceUserSimulator`): a system message with tau2's
    global simulation guidelines (no-tools variant) and ``<scenario>{instructions}</scenario>``
    (`instructions` from `user_instructions`), then the conversation with roles flipped as in tau2's
    ``UserState.flip_roles``: tau2's agent greeting and the agent's text messages become "user"
    messages, the user's own messages "assistant" ones. The agent's tool calls and tool results are
    not shown: a real user does not see them.
    """
    out = [{"role": "system", "content": _user_system(instructions)},
           {"role": "user", "content": AGENT_GREETING}]
    for m in history:
        if m.role == "user":
            out.append({"role": "assistant", "content": m.content})
        elif m.role == "assistant" and m.tool_call is None:
            out.append({"role": "user", "content": m.content})
    return out


def user_prompt_ids(tokenizer, instructions: str, history: list[Message]) -> list[int]:
    """Token ids of the USER-REHEARSE prompt (`user_messages`), ending with the generation prompt."""
    return chat_ids(tokenizer, user_messages(instructions, history))


@dataclass
class UserTurn:
    """USER-REHEARSE's parsed output: the user's message and whether it ends the conversation."""

    message: str
    stop: bool


def parse_user(text: str, strict: bool = True) -> UserTurn:
    """Parse one USER-REHEARSE output: the imagined user's next message (plain text).

    `stop` is True when the text holds one of `USER_STOP_TOKENS` (tau2's ``UserSimulator.is_stop``
    rule); with `strict`, nothing but whitespace may follow the first stop token. `message` is the
    stripped text (stop token included, as tau2 keeps it).

    Raises (all `ParseError`): `EmptyOutput`; `InvalidUserTurn` when the text holds a `<tool_call`
    tag or a call in another family's tool-call markup or JSON form (`roles.foreign.find_foreign_call`
    without tool names: the rehearsed user has no tools) or, with `strict`, text after a stop token.
    """
    if not isinstance(text, str) or not text.strip():
        raise EmptyOutput("empty user turn", text if isinstance(text, str) else "")
    if "<tool_call" in text or TOOL_CALL_CLOSE in text:
        raise InvalidUserTurn("the rehearsed user has no tools: a user turn cannot hold a tool call", text)
    foreign = find_foreign_call(text)
    if foreign is not None:
        raise InvalidUserTurn(f"the rehearsed user has no tools: a user turn cannot hold a tool call "
                              f"(found one in the {foreign.format} format)", text)
    body = text.strip()
    hits = [(body.find(tok), tok) for tok in USER_STOP_TOKENS if tok in body]
    if not hits:
        return UserTurn(message=body, stop=False)
    at, tok = min(hits)
    if strict and body[at + len(tok):].strip():
        raise InvalidUserTurn(f"text after the stop token {tok}: end the message with it", text)
    return UserTurn(message=body, stop=True)
