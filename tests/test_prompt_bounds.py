"""Every prompt renderer stays within its token budget, whatever a tool returns: huge, deeply nested,
non-UTF-8-ish (bytes decoded with surrogateescape / latin-1) or binary-looking results are cut with the
visible marker of `roles.bounds.bound_text`, for ACT, REHEARSE (history and grounding examples), USER
(which never shows tool results), SELF-EVAL, the rehearsal memory and the judge."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envace_core.rehearsal.agent import summarise
from envace_core.roles.act import act_prompt_ids
from envace_core.roles.bounds import bound_text, clean_text, n_tokens
from envace_core.roles.chat import chat_ids
from envace_core.roles.memory import memory_text
from envace_core.roles.rehearse import rehearse_prompt_ids
from envace_core.roles.self_eval import self_eval_prompt_ids
from envace_core.roles.user import user_instructions, user_prompt_ids
from envace_core.training.judge import checklist, judge_messages
from envace_core.types import Message, Observation, Step, TaskContext, ToolCall, ToolSpec, Trajectory

BUDGET = 64  # tokens per tool result
SLACK = 8  # seam tokens: a cut text's first/last token may merge with its neighbours in the prompt
MARKER = "tool result truncated: "
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOOLS = [ToolSpec(name="search_flights", description="Search flights.",
                  parameters={"type": "object", "properties": {"origin": {"type": "string"}}, "required": ["origin"]})]
CTX = TaskContext(task_id="t/1", domain="airline", policy="Be helpful. Check the user id first.", tools=TOOLS,
                  first_user_message="Find me a flight from JFK.")
CALL = ToolCall(name="search_flights", arguments={"origin": "JFK"}, id="call_0")


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


huge = st.text(min_size=1, max_size=40).map(lambda s: s * (6000 // len(s) + 1))
deep = st.integers(200, 3000).flatmap(lambda d: st.sampled_from([_nested(d), "[" * d + "]" * d, "[" * d]))
not_utf8 = st.binary(min_size=2000, max_size=8000).flatmap(lambda b: st.sampled_from(
    [b.decode("utf-8", "surrogateescape"), b.decode("latin-1"), b.decode("utf-16-le", "surrogatepass")
     if len(b) % 2 == 0 else b.decode("latin-1")]))
binary_looking = st.binary(min_size=1500, max_size=6000).flatmap(lambda b: st.sampled_from(
    [base64.b64encode(b).decode(), b.hex(), "".join(chr(x % 32) for x in b), "\x00" * len(b),
     json.dumps({"blob": b.decode("latin-1")})]))
tool_results = st.one_of(huge, deep, not_utf8, binary_looking)


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


def _history(result: str) -> list[Message]:
    return [Message(role="user", content=CTX.first_user_message), Message(role="assistant", tool_call=CALL),
            Message(role="tool", content=result)]


def _traj(result: str) -> Trajectory:
    return Trajectory(task_id="t/1", steps=[Step(action=CALL, observation=Observation(content=result)),
                                            Step(message="Here are the flights.")], termination="agent_message")


def _long(tok, result: str) -> bool:
    return n_tokens(tok, clean_text(result)) > BUDGET


def _within(tok, prompt: list[int], baseline: list[int], cuts: int, result: str) -> None:
    """`prompt` grows over the empty-result `baseline` by at most `cuts` budgets, and shows the marker
    exactly when the result was longer than the budget."""
    assert len(prompt) <= len(baseline) + cuts * (BUDGET + SLACK)
    assert (MARKER in tok.decode(prompt)) == _long(tok, result)


@SETTINGS
@given(tool_results)
def test_bound_text_fits_the_budget_and_marks_the_cut(tok, result):
    out = bound_text(result, tok, BUDGET)
    assert n_tokens(tok, out) <= BUDGET
    assert (MARKER in out) == _long(tok, result)
    if not _long(tok, result):
        assert out == clean_text(result)
    else:
        assert out.endswith(" tokens shown]") and clean_text(result).startswith(out.split("…[")[0])


@SETTINGS
@given(tool_results)
def test_act_prompt(tok, result):
    base = act_prompt_ids(tok, CTX, _history(""), max_observation_tokens=BUDGET)
    _within(tok, act_prompt_ids(tok, CTX, _history(result), max_observation_tokens=BUDGET), base, 1, result)


@SETTINGS
@given(tool_results)
def test_rehearse_prompt_history_and_examples(tok, result):
    nxt = ToolCall(name="search_flights", arguments={"origin": "SFO"})

    def prompt(r: str) -> list[int]:
        return rehearse_prompt_ids(tok, CTX, _history(r), nxt, examples=[(CALL, Observation(content=r))],
                                   max_observation_tokens=BUDGET)

    _within(tok, prompt(result), prompt(""), 2, result)


@SETTINGS
@given(tool_results)
def test_user_prompt_never_shows_tool_results(tok, one_scenario, result):
    history = _history(result) + [Message(role="assistant", content="I found flights.")]
    assert user_prompt_ids(tok, one_scenario, history) == \
        user_prompt_ids(tok, one_scenario, _history("") + [Message(role="assistant", content="I found flights.")])


@SETTINGS
@given(tool_results)
def test_self_eval_prompt_and_memory(tok, result):
    def prompt(r: str) -> list[int]:
        return self_eval_prompt_ids(tok, CTX, summarise(_traj(r), 1, tok, BUDGET))

    _within(tok, prompt(result), prompt(""), 1, result)
    summary = summarise(_traj(result), 1, tok, BUDGET)
    for budget in (16, 200):
        memory = memory_text([summary, summarise(_traj(result), 2, tok, BUDGET)], budget, tok)
        assert n_tokens(tok, memory) <= budget
    assert (MARKER in memory_text([summary], 400, tok)) == _long(tok, result)


@SETTINGS
@given(tool_results)
def test_judge_prompt(tok, judged_task, result):
    items = checklist(judged_task)

    def prompt(r: str) -> list[int]:
        return chat_ids(tok, judge_messages(judged_task, _traj(r), items, tok, BUDGET))

    _within(tok, prompt(result), prompt(""), 1, result)


@pytest.fixture(scope="module")
def judged_task():
    from envace_core.envs.tau2.tasks import load_tasks

    return next(t for t in load_tasks("airline", "test") if t.gold_actions)


@pytest.fixture(scope="module")
def one_scenario(judged_task):
    return user_instructions(judged_task.user_scenario)


def test_a_result_under_the_budget_is_shown_unchanged(tok):
    result = json.dumps({"flight_number": "HAT001", "status": "available"})
    assert bound_text(result, tok, BUDGET) == result
    assert result in tok.decode(act_prompt_ids(tok, CTX, _history(result), max_observation_tokens=BUDGET))
    assert bound_text("x" * 10_000, tok, None) == "x" * 10_000  # None: never cut
