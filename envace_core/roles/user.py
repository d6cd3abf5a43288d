"""The USER-REHEARSE role (METHOD.md §1): the user scenario → prompt, and the parser of the imagined user turn;
and `OpenAIChatClient`, the client of a user simulator (or judge) behind an OpenAI-compatible endpoint
(``envace eval --user-url``), with `EndpointError` for an endpoint that fails. Nothing here imports tau2
at module import, so `evaluation.harness` probes an endpoint in well under a second."""

from __future__ import annotations

import functools
import http.client
import json
import urllib.error
import urllib.request
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


# ------------------------------------------------------------------- OpenAI-compatible endpoint
class EndpointError(EnvaceError):
    """An OpenAI-compatible endpoint (``--user-url``, ``--judge-url``) that cannot be reached, or that does
    not answer a request with an OpenAI chat completion. It is the run's infrastructure failing, not the
    task: `evaluation.tau2.run_tau2` lets it through instead of recording the trial as an error, so
    nothing is cached for that trial and a rerun plays it."""


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _why(e: BaseException, timeout: float) -> str:
    """The underlying failure of an HTTP request, in one line: ``HTTP 404 Not Found: <body start>``,
    ``ConnectionRefusedError: [Errno 111] Connection refused``, ``timed out after 5s``, ..."""
    if isinstance(e, urllib.error.HTTPError):
        try:
            body = e.read(300).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the status alone is enough
            body = ""
        return _one_line(f"HTTP {e.code} {e.reason}" + (f": {body}" if body.strip() else ""))
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, TimeoutError):  # socket.timeout is TimeoutError
        return f"timed out after {timeout:g}s"
    return _one_line(f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason))


class OpenAIChatClient:
    """A minimal OpenAI-compatible chat client (``POST {base_url}/chat/completions``, urllib only).

    `name` labels the endpoint in errors (`harness` passes the flag, ``--user-url`` / ``--judge-url``);
    `timeout`: seconds per request; `probe_timeout`: seconds for `probe`'s ``GET {base_url}/models``.
    """

    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY", timeout: float = 120.0,
                 name: str = "OpenAI-compatible endpoint", probe_timeout: float = 5.0):
        self.base_url, self.model, self.api_key, self.timeout = base_url.rstrip("/"), model, api_key, timeout
        self.name, self.probe_timeout = name, probe_timeout

    def _fail(self, what: str, why: str) -> EndpointError:
        return EndpointError(f"{self.name} {self.base_url}: {what} failed ({why}); check that an OpenAI-compatible "
                             "server answers there (base URL usually ending in /v1), or fix the URL")

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, seed: int | None,
             timeout: float | None = None) -> str:
        """The reply text of one chat completion (``choices[0].message.content``).

        Raises `EndpointError` (naming `name`, the URL and the underlying error) when the request gets no
        answer within `timeout` (default: the client's), an HTTP error status, a body that is not an
        OpenAI chat completion, or one whose message has no text (content null, not a string, or blank):
        a reply without text is the endpoint failing, not the user (or judge) choosing to stop."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        url = f"{self.base_url}/chat/completions"
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.api_key}"})
        limit = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=limit) as r:
                raw = r.read()
        except (OSError, http.client.HTTPException) as e:  # URLError / HTTPError / timeouts are OSErrors
            raise self._fail(f"POST {url}", _why(e, limit)) from None
        try:
            content = json.loads(raw.decode())["choices"][0]["message"].get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise self._fail(f"POST {url}", f"the answer is not an OpenAI chat completion ({type(e).__name__}: "
                             f"{_one_line(e, 80)}): {_one_line(raw.decode(errors='replace'), 160)}") from None
        if not isinstance(content, str) or not content.strip():
            raise self._fail(f"POST {url}", f"the reply has no message text (content {_one_line(repr(content), 60)}): "
                             f"{_one_line(raw.decode(errors='replace'), 160)}")
        return content

    def probe(self) -> None:
        """A cheap check that the endpoint answers, before any model loads: ``GET {base_url}/models`` within
        `probe_timeout` seconds. An OpenAI models list (a JSON object with a ``data`` list) passes; any other
        answer (another HTTP status, as from a server without ``/models``, or a 2xx body that is not a models
        list, as from a plain file server) is followed by a one-token `chat` (``max_tokens=1``, the
        client's `timeout`), which must return a chat completion with message text.

        Raises `EndpointError` naming `name`, the URL and the underlying error (connection refused, unknown
        host, timeout, or the chat request failing)."""
        url = f"{self.base_url}/models"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=self.probe_timeout) as r:
                raw = r.read(1 << 20)
            try:
                if isinstance(json.loads(raw.decode()).get("data"), list):
                    return
            except (ValueError, AttributeError):  # not JSON, or JSON but not an object: not a models list
                pass
        except urllib.error.HTTPError as e:  # an answer, but not to /models: the chat route must work
            e.close()
        except (OSError, http.client.HTTPException) as e:  # no answer at all
            raise self._fail(f"GET {url}", _why(e, self.probe_timeout)) from None
        self.chat([{"role": "user", "content": "Hi"}], 1, 0.0, None)
