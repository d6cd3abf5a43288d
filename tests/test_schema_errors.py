"""Well-formed calls of an unknown tool or with invalid arguments: tool errors (tau2's semantics), not parse errors."""

import json

import pytest

from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.models import load_tokenizer
from envace_core.roles.act import parse_act
from envace_core.roles.errors import InvalidArguments, MalformedToolCall, UnknownTool
from envace_core.training.loop import rollout_metrics, score
from envace_core.training.rewards import consistent_reward, row_rewards
from envace_core.training.rollout import RolloutParams, real_rollouts, rehearsal_rollouts
from envace_core.types import Role
from tests.scripted import ScriptedEngine

UNKNOWN = '<tool_call>{"name": "cancel_reservation_v7", "arguments": {"reservation_id": "ZFA04Y"}}</tool_call>'


def _call(name, arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _params(**kw):
    return RolloutParams(**{"max_turns": 3, "max_new_tokens_act": 64, "max_new_tokens_rehearse": 64,
                            "temperature": 1.0, "schema_errors": True, **kw})


@pytest.fixture(scope="module")
def airline_task():
    return next(t for t in load_tasks("airline", "test") if t.gold_actions)


def test_parse_act_returns_schema_errors_only_when_asked(airline_task):
    tools = task_context(airline_task, 300).tools
    with pytest.raises(UnknownTool):
        parse_act(UNKNOWN, tools)
    out = parse_act(UNKNOWN, tools, schema_errors=True)
    assert isinstance(out.schema_error, UnknownTool) and out.tool_call.name == "cancel_reservation_v7"
    bad_args = _call("get_reservation_details", {"reservation": "ZFA04Y"})
    with pytest.raises(InvalidArguments):
        parse_act(bad_args, tools)
    out = parse_act(bad_args, tools, schema_errors=True)
    assert isinstance(out.schema_error, InvalidArguments) and out.tool_call.arguments == {"reservation": "ZFA04Y"}
    with pytest.raises(InvalidArguments):  # arguments that are not an object stay unparseable
        parse_act(_call("get_reservation_details", ["ZFA04Y"]), tools, schema_errors=True)
    with pytest.raises(MalformedToolCall):  # format errors are never schema errors
        parse_act('<tool_call>{"name": "x", "arguments": {<user_id>}}</tool_call>', tools, schema_errors=True)
    ok = parse_act(_call("get_reservation_details", {"reservation_id": "ZFA04Y"}), tools, schema_errors=True)
    assert ok.schema_error is None


def test_imagined_rollout_answers_a_schema_error_without_rehearse_and_goes_on(tiny_model_dir, airline_task):
    tok = load_tokenizer(tiny_model_dir)
    engine = ScriptedEngine(tok, [UNKNOWN, "Sorry, I could not do that."])
    t = rehearsal_rollouts(engine, task_context(airline_task, 300), 1, _params(), seed=0)[0]
    assert [g.role for g in t.generations] == [Role.ACT, Role.ACT]  # no REHEARSE row for the refused call
    assert t.termination == "agent_message"
    step = t.steps[0]
    assert step.schema_error.startswith("UnknownTool")
    assert step.observation.error and json.loads(step.observation.content) == {
        "error": "Tool 'cancel_reservation_v7' not found."}  # tau2's own message for an unknown tool
    assert "Tool 'cancel_reservation_v7' not found." in tok.decode(t.generations[1].prompt_ids)  # ACT saw it
    m = rollout_metrics([t])
    assert m["parse_error_rate"] == 0.0 and m["schema_error_rate/act"] == 0.5
    score(airline_task, t)
    assert step.real_observation is not None and step.fidelity is None  # not rehearsed: no fidelity


def test_off_keeps_the_parse_error(tiny_model_dir, airline_task):
    tok = load_tokenizer(tiny_model_dir)
    t = rehearsal_rollouts(ScriptedEngine(tok, [UNKNOWN]), task_context(airline_task, 300), 1,
                           _params(schema_errors=False), seed=0)[0]
    assert t.termination == "parse_error" and t.generations[0].parse_error.startswith("UnknownTool")
    assert rollout_metrics([t])["schema_error_rate/act"] == 0.0


def test_rehearse_rows_pair_with_rehearsed_steps_only(tiny_model_dir, airline_task):
    """λ·F goes to the REHEARSE row of the step it imagined, skipping the schema-error step before it."""
    tok = load_tokenizer(tiny_model_dir)
    good = _call("get_reservation_details", {"reservation_id": "ZFA04Y"})
    t = rehearsal_rollouts(ScriptedEngine(tok, [UNKNOWN, good, "Done."], rehearse_text='{"reservation_id": "ZFA04Y"}'),
                           task_context(airline_task, 300), 1, _params(), seed=0)[0]
    assert [g.role for g in t.generations] == [Role.ACT, Role.ACT, Role.REHEARSE, Role.ACT]
    t.reward = 0.0
    t.steps[1].fidelity = 0.25
    assert row_rewards(t, fidelity_lambda=1.0) == [0.0, 0.0, 0.25, 0.0]


def test_a_refused_write_is_not_a_stray_write(tiny_model_dir):
    """A write tool called with invalid arguments changed nothing: the consistent reward does not zero it."""
    task = next(t for t in load_tasks("airline", "train") if t.gold_actions and t.gold_actions[0].name.startswith("get_"))
    tok = load_tokenizer(tiny_model_dir)
    refused = _call("cancel_reservation", {"reservation": "ZFA04Y"})
    t = rehearsal_rollouts(ScriptedEngine(tok, [refused, "Done."]), task_context(task, 300), 1, _params(), seed=0)[0]
    assert t.steps[0].schema_error.startswith("InvalidArguments")
    res = consistent_reward(task, t)
    assert res is not None and res.info["stray_writes"] == []
    executed = _call("cancel_reservation", {"reservation_id": "ZZZZZZ"})  # the same write, executed
    t = rehearsal_rollouts(ScriptedEngine(tok, [executed, "Done."]), task_context(task, 300), 1, _params(), seed=0)[0]
    assert consistent_reward(task, t).info["stray_writes"] == ["cancel_reservation"]


def test_real_rollout_lets_tau2_answer_the_schema_error(tiny_model_dir, airline_task):
    from envace_core.envs.tau2.environment import Tau2Environment

    tok = load_tokenizer(tiny_model_dir)
    env = Tau2Environment("airline")
    env.reset(airline_task)
    t = real_rollouts(ScriptedEngine(tok, [UNKNOWN, "Done."]), task_context(airline_task, 300), [env], _params())[0]
    assert env.calls_made == 1 and t.steps[0].schema_error.startswith("UnknownTool")
    assert t.steps[0].observation == t.steps[0].real_observation and t.steps[0].observation.error
    assert "not found" in t.steps[0].observation.content
