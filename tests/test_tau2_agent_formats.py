"""The tau2 participants and foreign tool formats / long prompts: the simulated user with tools parses every
reply (a call in another family's format is a counted parse error, or a call in lenient mode); the agent's
lenient mode (`eval.lenient_tool_format` -> `RolloutParams.lenient`) reaches `parse_act`; an ACT prompt that
cannot fit the context ends the dialogue with a counted, named message instead of the engine's ValueError."""

from __future__ import annotations

from dataclasses import replace

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.evaluation.tau2_agents import PROMPT_TOO_LONG, EnvaceTau2Agent, EnvaceUserSimulator
from envace_core.rehearsal.agent import RehearsalAgent
from envace_core.training.rollout import RolloutParams
from tests.scripted import ScriptedEngine

from tau2.data_model.message import AssistantMessage, UserMessage  # isort: skip
from tau2.registry import registry  # isort: skip

FOREIGN = '[TOOL_CALLS][{"name": "get_user_details", "arguments": {"user_id": "mia_li_3668"}}]'
RP = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=32, temperature=0.0)


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


@pytest.fixture(scope="module")
def airline():
    env = registry.get_env_constructor("airline")()
    return env.get_tools(), env.get_policy()


@pytest.mark.parametrize("lenient", [False, True])
def test_a_user_with_tools_parses_every_reply_and_counts_a_foreign_call(tok, airline, lenient):
    tools, _ = airline
    sim = EnvaceUserSimulator(tools=tools, instructions="You are Mia.", engine=ScriptedEngine(tok, [FOREIGN]),
                              lenient=lenient)
    msg, _ = sim.generate_next_message(AssistantMessage(role="assistant", content="Hi! How can I help you?"),
                                       sim.get_init_state())
    if lenient:  # parsed as the call it is
        assert msg.tool_calls and msg.tool_calls[0].name == "get_user_details" and sim.stats["tool_calls"] == 1
        assert sim.stats["parse_errors"] == 0
    else:  # sent as text (as tau2 passes malformed replies through), but counted by class
        assert not msg.tool_calls and msg.content == FOREIGN
        assert sim.stats["parse_errors"] == 1 and sim.parse_error_classes == {"ForeignToolCallFormat": 1}
    plain = EnvaceUserSimulator(tools=tools, instructions="You are Mia.", engine=ScriptedEngine(tok, ["Hi there."]))
    msg, _ = plain.generate_next_message(AssistantMessage(role="assistant", content="Hi!"), plain.get_init_state())
    assert msg.content == "Hi there." and plain.stats["parse_errors"] == 0


@pytest.mark.parametrize("lenient", [False, True])
def test_the_agents_lenient_mode_reaches_parse_act(tok, airline, lenient):
    tools, policy = airline
    rp = replace(RP, lenient=lenient)
    agent = EnvaceTau2Agent(tools, policy, RehearsalAgent(ScriptedEngine(tok, [FOREIGN]), "none", 0, 200, rp, rp),
                            domain="airline", policy_max_chars=300)
    msg, _ = agent.generate_next_message(UserMessage(role="user", content="Hi, I am Mia."), agent.get_init_state())
    if lenient:
        assert msg.tool_calls and msg.tool_calls[0].name == "get_user_details" and agent.stats["parse_errors"] == 0
    else:
        assert not msg.tool_calls and agent.stats["parse_errors"] == 1
        assert agent.parse_errors[0].startswith("ForeignToolCallFormat: ")


def test_an_act_prompt_over_the_context_ends_the_dialogue_named_and_counted(tok, airline):
    tools, policy = airline

    class Small(ScriptedEngine):
        context_tokens = 512

        def generate(self, prompts, params):
            assert all(len(p) <= self.context_tokens - params.max_new_tokens for p in prompts)
            return super().generate(prompts, params)

    agent = EnvaceTau2Agent(tools, policy, RehearsalAgent(Small(tok, ["Hello."]), "none", 0, 200, RP, RP),
                            domain="airline")  # the whole airline policy: far over 512 tokens
    msg, _ = agent.generate_next_message(UserMessage(role="user", content="Hi."), agent.get_init_state())
    assert msg.content == PROMPT_TOO_LONG and EnvaceTau2Agent.is_stop(msg)
    assert agent.stats["prompt_too_long"] == 1 and agent.parse_errors[0].startswith("PromptTooLong: ")
    assert not EnvaceTau2Agent.is_stop(AssistantMessage(role="assistant", content="Hello."))


def test_tool_results_from_tau2s_orchestrator_get_the_canonical_rendering():
    """ACT sees the same text for a real result under either protocol (envs.tau2.observations)."""
    from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage
    from tau2.data_model.message import ToolCall as Tau2ToolCall

    from envace_core.envs.tau2.observations import real_observation
    from envace_core.evaluation.tau2_agents import to_envace_history

    raw = '{"name": "Kim", "payment_methods": {"cc_1": {"id": "cc_1", "source": "credit_card"}}}'
    history = to_envace_history([
        UserMessage(role="user", content="hi"),
        AssistantMessage(role="assistant", tool_calls=[Tau2ToolCall(id="c1", name="get_user_details",
                                                                    arguments={"user_id": "u"})]),
        ToolMessage(id="c1", role="tool", content=raw),
        ToolMessage(id="c2", role="tool", content="Error: user not found", error=True)])
    assert history[2].content == real_observation("get_user_details", raw, False).content
    assert history[2].content == '{"name":"Kim","payment_methods":{"cc_1":{"source":"credit_card"}}}'
    assert (history[3].content, history[3].error) == ('{"error":"user not found"}', True)
