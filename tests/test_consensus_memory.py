"""The consensus memory (`rehearsal.consensus`, rehearsal.memory_content="consensus"): the grounded first
call most rehearsals made, eligible only when the verifier passes that call and every argument value was
stated to the agent; an ungrounded call cannot win by numbers."""

from __future__ import annotations

import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.envs.tau2.synth import synthesize
from envace_core.envs.tau2.tasks import task_context
from envace_core.models import load_tokenizer
from envace_core.rehearsal.agent import RehearsalAgent
from envace_core.rehearsal.consensus import consensus_memory, first_call_consensus
from envace_core.rehearsal.verifier import default_checks
from envace_core.training.rollout import RolloutParams
from envace_core.types import Observation, Step, ToolCall, Trajectory
from tests.scripted import ScriptedEngine

P = RolloutParams(max_turns=2, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0)


@pytest.fixture(scope="module")
def task():
    t = next(t for t in synthesize("retail", 6, levels=[1], seed=0) if t.gold_actions[0].name == "find_user_id_by_email")
    return t, task_context(t, 300)


def rehearsal(name, schema_error=None, **args) -> Trajectory:
    step = Step(action=ToolCall(name=name, arguments=args), observation=Observation(content='{"error": "x"}', error=True),
                schema_error=schema_error)
    return Trajectory(task_id="t", imagined=True, steps=[step, Step(message="Done.")], termination="agent_message")


def test_the_grounded_call_wins_over_a_more_frequent_made_up_one(task):
    t, ctx = task
    email = t.gold_actions[0].arguments["email"]
    made_up = [rehearsal("find_user_id_by_name_zip", first_name="Emma", last_name="Lopez", zip="12345")] * 3
    right = [rehearsal("find_user_id_by_email", email=email)] * 2
    call, votes = first_call_consensus([*made_up, *right], ctx)
    assert (call.name, call.arguments, votes) == ("find_user_id_by_email", {"email": email}, 2)
    memory = consensus_memory([*made_up, *right], ctx)
    assert memory == (f"Rehearsal consensus: 2 of 5 rehearsals began with\n"
                      f"- called find_user_id_by_email({json.dumps({'email': email})})")
    # nothing eligible: a made-up value, a schema refusal, a rehearsal that spoke first, no rehearsal at all
    spoke = Trajectory(task_id="t", imagined=True, steps=[Step(message="Hello")], termination="agent_message")
    refused = rehearsal("find_user_id_by_email", schema_error="arguments: bad", email=email)
    for none in ([*made_up], [refused, spoke], []):
        assert first_call_consensus(none, ctx) is None and consensus_memory(none, ctx) == ""


def test_a_tie_goes_to_the_call_made_first_and_the_verifier_sees_the_call_alone(task):
    t, ctx = task
    email = t.gold_actions[0].arguments["email"]
    first = rehearsal("find_user_id_by_email", email=email)
    other = rehearsal("get_user_details", user_id=email)
    assert first_call_consensus([first, other], ctx)[0].name == "find_user_id_by_email"
    assert first_call_consensus([other, first], ctx)[0].name == "get_user_details"
    # a grounded call of a tool the task does not have is refused by the verifier's own checks
    unknown = rehearsal("delete_all_users", email=email)
    checks = default_checks("retail")
    assert first_call_consensus([unknown, unknown, first], ctx, checks=checks)[0].name == "find_user_id_by_email"
    assert first_call_consensus([unknown], ctx, checks=checks) is None
    assert first_call_consensus([unknown], ctx)[0].name == "delete_all_users"  # no verifier: grounding only


def test_a_value_from_a_real_prefix_result_grounds_a_later_call(task):
    _, ctx = task
    prefix = [Step(action=ToolCall(name="find_user_id_by_email", arguments={"email": "a@b.c"}),
                   observation=Observation(content="olivia_smith_1234"))]
    later = rehearsal("get_user_details", user_id="olivia_smith_1234")
    assert first_call_consensus([later], ctx) is None
    assert first_call_consensus([later], ctx, prefix)[0].arguments == {"user_id": "olivia_smith_1234"}


def test_the_agent_commits_with_the_consensus_in_acts_prompt(task, tiny_model_dir):
    from envace_core.config import load_config
    from envace_core.envs.tau2.environment import Tau2Environment

    t, ctx = task
    email = t.gold_actions[0].arguments["email"]
    text = "<tool_call>" + json.dumps({"name": "find_user_id_by_email", "arguments": {"email": email}}) + "</tool_call>"
    tok = load_tokenizer(tiny_model_dir)

    class Recording(ScriptedEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.prompts: list[str] = []

        def generate(self, prompts, params):
            self.prompts += [self.tokenizer.decode(p) for p in prompts]
            return super().generate(prompts, params)

    engine = Recording(tok, [text, "Your user id is on file."])
    agent = RehearsalAgent(engine, "parallel", 3, 256, act=P, rehearse=P, seed=0, memory_content="consensus",
                           verifier=default_checks("retail"))
    env = Tau2Environment("retail")
    env.reset(t)
    res = agent.run(ctx, env)
    assert res.memory.startswith("Rehearsal consensus: 3 of 3 rehearsals began with\n- called find_user_id_by_email(")
    assert res.isolation == {"real_calls_during_rehearsal": 0, "db_hash_unchanged": True}
    first, second = engine.prompts[-2:]  # the committed run's two ACT turns: the call, then the answer
    assert "Rehearsal consensus: 3 of 3" in first and "# Notes from rehearsal" not in second  # its turn only
    assert [s.action.name for s in res.committed.steps if s.action] == ["find_user_id_by_email"]
    calls = RehearsalAgent(engine, "parallel", 3, 256, act=P, rehearse=P, seed=0, memory_content="calls")
    env.reset(t)
    calls.run(ctx, env)
    assert all("# Notes from rehearsal" in p for p in engine.prompts[-2:])  # other memories stay every turn
    short = RehearsalAgent(engine, "parallel", 3, 16, act=P, rehearse=P, seed=0, memory_content="consensus")
    assert short.rehearse_round(ctx).memory == ""  # over the budget: no memory rather than half a call
    assert load_config("test", "rehearsal.memory_content=consensus").rehearsal.memory_content == "consensus"


def test_a_call_with_no_argument_value_is_eligible(task):
    _, ctx = task
    bare = rehearsal("list_all_product_types")
    assert first_call_consensus([bare, bare], ctx) == (bare.steps[0].action, 2)
    flags = rehearsal("find_user_id_by_email", flag=True, other=None)
    assert first_call_consensus([flags], ctx)[1] == 1
