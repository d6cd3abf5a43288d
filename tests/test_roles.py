"""Prompt rendering and strict parsing of the ACT / REHEARSE roles (envace_core.roles, METHOD.md §1, §4)."""

from __future__ import annotations

import json

import pytest

from envace_core import EnvaceError
from envace_core.roles.act import ActOutput, act_prompt_ids, parse_act
from envace_core.roles.chat import render_history
from envace_core.roles.errors import (
    EmptyOutput,
    InvalidArguments,
    InvalidRehearsal,
    InvalidUserTurn,
    MalformedToolCall,
    MultipleToolCalls,
    ParseError,
    TextOutsideToolCall,
    UnknownTool,
    format_error,
)
from envace_core.roles.memory import memory_text
from envace_core.roles.rehearse import parse_rehearse, rehearse_prompt_ids
from envace_core.roles.tools import format_tool_call, template_supports_tools
from envace_core.roles.user import (
    AGENT_GREETING,
    USER_STOP_TOKENS,
    UserTurn,
    parse_user,
    user_instructions,
    user_messages,
    user_prompt_ids,
)
from envace_core.types import Message, Observation, TaskContext, ToolCall, ToolSpec

PASSENGER = {
    "properties": {
        "first_name": {"description": "First name", "title": "First Name", "type": "string"},
        "dob": {"description": "Date of birth YYYY-MM-DD", "title": "Dob", "type": "string"},
    },
    "required": ["first_name", "dob"],
    "title": "Passenger",
    "type": "object",
}

TOOLS = [
    ToolSpec(
        name="get_reservation_details",
        description="Get the details of a reservation.",
        parameters={
            "properties": {"reservation_id": {"description": "The reservation ID, such as 'ZFA04Y'.",
                                              "title": "Reservation Id", "type": "string"}},
            "required": ["reservation_id"], "title": "parameters", "type": "object",
        },
    ),
    ToolSpec(
        name="update_passengers",
        description="Update the passengers of a reservation.",
        parameters={
            "$defs": {"Passenger": PASSENGER, "Flight": {
                "properties": {"flight_number": {"title": "Flight Number", "type": "string",
                                                 "description": "Such as 'HAT001'."}},
                "required": ["flight_number"], "title": "Flight", "type": "object"}},
            "properties": {
                "reservation_id": {"title": "Reservation Id", "type": "string"},
                "passengers": {"items": {"$ref": "#/$defs/Passenger"}, "title": "Passengers", "type": "array"},
                "flights": {"items": {"anyOf": [{"$ref": "#/$defs/Flight"},  # pydantic's `Flight | dict`
                                                {"additionalProperties": True, "type": "object"}]},
                            "title": "Flights", "type": "array"},
                "cabin": {"enum": ["economy", "business"], "title": "Cabin", "type": "string"},
                "count": {"title": "Count", "type": "integer", "default": 1},
            },
            "required": ["reservation_id", "passengers", "cabin"],
            "title": "parameters", "type": "object",
        },
    ),
    ToolSpec(name="list_all_airports", description="Returns a list of all available airports."),
]

POLICY = "# Airline Agent Policy\nAlways confirm before booking. Basic economy cannot be modified."


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


@pytest.fixture
def ctx():
    return TaskContext(task_id="airline/1", domain="airline", policy=POLICY, tools=TOOLS,
                       first_user_message="Please check reservation ABC123.")


def call_text(name="get_reservation_details", arguments=None):
    args = {"reservation_id": "ABC123"} if arguments is None else arguments
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


# ------------------------------------------------------------------------------------------ parse_act
def test_good_call():
    out = parse_act("\n " + call_text() + "\n", TOOLS)
    assert out == ActOutput(tool_call=ToolCall(name="get_reservation_details",
                                               arguments={"reservation_id": "ABC123"}), message="")


def test_good_call_whitespace_inside_tags_and_no_arguments():
    out = parse_act('<tool_call>\n{"name": "list_all_airports"}\n</tool_call>', TOOLS)
    assert out.tool_call == ToolCall(name="list_all_airports", arguments={})


def test_nested_ref_arguments_validate():
    args = {"reservation_id": "A", "cabin": "economy",
            "passengers": [{"first_name": "Ann", "dob": "1990-01-01"}]}
    assert parse_act(call_text("update_passengers", args), TOOLS).tool_call.arguments == args


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_reservation_details", "arguments": {"reservation_id": "A"}</tool_call>',
    "<tool_call>{'name': 'get_reservation_details'}</tool_call>",
    '<tool_call>{"name": "calculate", "arguments": {"x": NaN}}</tool_call>',
])
def test_bad_json(text):
    with pytest.raises(MalformedToolCall) as e:
        parse_act(text, TOOLS)
    assert e.value.raw == text


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_reservation_details", "arguments": {"reservation_id": "A"}}',  # unclosed
    '{"name": "get_reservation_details"}</tool_call>',  # stray close
    '<tool_call name="x">{"name": "list_all_airports"}</tool_call>',  # misspelt tag
    '<tool_call><tool_call>{"name": "list_all_airports"}</tool_call></tool_call>',  # nested
    '<tool_call>["get_reservation_details"]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "list_all_airports", "parameters": {}}</tool_call>',  # unexpected key
])
def test_malformed(text):
    with pytest.raises(MalformedToolCall):
        parse_act(text, TOOLS)


def test_unknown_tool():
    with pytest.raises(UnknownTool, match="cancel_everything"):
        parse_act(call_text("cancel_everything", {}), TOOLS)


@pytest.mark.parametrize("args, match", [
    ({}, "reservation_id"),  # missing required
    ({"reservation_id": 123}, "string"),  # wrong type
    ({"reservation_id": "A", "extra": 1}, "extra"),  # argument the tool does not take
])
def test_invalid_arguments(args, match):
    with pytest.raises(InvalidArguments, match=match):
        parse_act(call_text(arguments=args), TOOLS)


def test_invalid_arguments_nested_and_enum_and_not_object():
    bad_nested = {"reservation_id": "A", "cabin": "economy", "passengers": [{"first_name": "Ann"}]}
    with pytest.raises(InvalidArguments, match="dob"):
        parse_act(call_text("update_passengers", bad_nested), TOOLS)
    bad_enum = {"reservation_id": "A", "cabin": "first", "passengers": []}
    with pytest.raises(InvalidArguments, match="first"):
        parse_act(call_text("update_passengers", bad_enum), TOOLS)
    with pytest.raises(InvalidArguments, match="object"):
        parse_act('<tool_call>{"name": "list_all_airports", "arguments": "{}"}</tool_call>', TOOLS)
    # validation follows the tool's own schema: its catch-all `anyOf` branch accepts any object
    loose = {"reservation_id": "A", "cabin": "economy", "passengers": [], "flights": [{"x": 1}]}
    assert parse_act(call_text("update_passengers", loose), TOOLS).tool_call.arguments == loose


@pytest.mark.parametrize("text", ["Let me check. " + call_text(), call_text() + " Done!"])
def test_text_outside(text):
    with pytest.raises(TextOutsideToolCall):
        parse_act(text, TOOLS, strict=True)
    assert parse_act(text, TOOLS, strict=False).tool_call.name == "get_reservation_details"


def test_multiple_calls():
    with pytest.raises(MultipleToolCalls):
        parse_act(call_text() + "\n" + call_text(), TOOLS)
    with pytest.raises(MultipleToolCalls):
        parse_act(call_text() + call_text(), TOOLS, strict=False)


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty(text):
    with pytest.raises(EmptyOutput):
        parse_act(text, TOOLS)


def test_plain_message():
    assert parse_act("  Your reservation is confirmed.\n", TOOLS) == ActOutput(
        tool_call=None, message="Your reservation is confirmed.")


def test_errors_are_typed_and_formatted():
    with pytest.raises(ParseError) as e:
        parse_act(call_text("nope", {}), TOOLS)
    assert isinstance(e.value, EnvaceError)
    assert format_error(e.value).startswith("UnknownTool: unknown tool 'nope'")


# ------------------------------------------------------------------------------------- parse_rehearse
def test_rehearse_object():
    obs = parse_rehearse(' {"reservation_id": "ABC123", "cabin": "economy"}\n')
    # the canonical rendering (envs.tau2.observations): compact JSON, key order kept
    assert obs == Observation(content='{"reservation_id":"ABC123","cabin":"economy"}', error=False)


def test_rehearse_error_object():
    obs = parse_rehearse('{"error":"Reservation ABC123 not found"}')
    assert obs.error and json.loads(obs.content) == {"error": "Reservation ABC123 not found"}


@pytest.mark.parametrize("text, value", [
    ('```json\n{"a": [1, 2]}\n```', {"a": [1, 2]}),
    ("```\n[1, 2]\n```", [1, 2]),
    ('"ok"', "ok"),
    ("42", 42),
])
def test_rehearse_values_and_fences(text, value):
    obs = parse_rehearse(text)
    assert not obs.error and json.loads(obs.content) == value


@pytest.mark.parametrize("text", [
    "The reservation was found.",
    'Here it is: {"a": 1}',
    '{"a": 1} {"b": 2}',
    "NaN",
    '```json\n{"a": 1}\n``` trailing',
])
def test_rehearse_invalid(text):
    with pytest.raises(InvalidRehearsal):
        parse_rehearse(text)


def test_rehearse_empty():
    with pytest.raises(EmptyOutput):
        parse_rehearse("  ")


# --------------------------------------------------------------------------------------- rendering
def test_history_tool_call_round_trip():
    call = ToolCall(name="update_passengers", id="call_0", arguments={
        "reservation_id": "A", "cabin": "business", "passengers": [{"first_name": "Zoë", "dob": "1990-01-01"}]})
    msgs = render_history([Message(role="user", content="hi"), Message(role="assistant", tool_call=call),
                                 Message(role="tool", content='{"ok": true}')])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    parsed = parse_act(msgs[1]["content"], TOOLS).tool_call
    assert (parsed.name, parsed.arguments) == (call.name, call.arguments)
    assert msgs[2]["content"] == '{"ok": true}'


def test_act_prompt(tok, ctx):
    ids = act_prompt_ids(tok, ctx, [Message(role="user", content=ctx.first_user_message)])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    text = tok.decode(ids)
    for t in TOOLS:
        assert t.name in text
    assert POLICY in text and ctx.first_user_message in text and "<tool_call>" in text
    assert "Passenger" not in text and "$defs" not in text and "Reservation Id" not in text  # inlined, no titles
    assert '"economy"|"business"' in text and "count (integer, optional, default=1)" in text
    assert "    dob (string): Date of birth YYYY-MM-DD" in text  # nested argument lines
    assert "flights (array of object, optional)\n    flight_number (string): Such as 'HAT001'." in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == act_prompt_ids(tok, ctx, [])  # empty history → the first user message


def test_act_prompt_memory_and_history(tok, ctx):
    call = ToolCall(name="get_reservation_details", arguments={"reservation_id": "ABC123"})
    hist = [Message(role="user", content=ctx.first_user_message), Message(role="assistant", tool_call=call),
            Message(role="tool", content='{"status": "confirmed"}')]
    text = tok.decode(act_prompt_ids(tok, ctx, hist, memory="[rehearsal 1]\nAsk before cancelling."))
    assert "Ask before cancelling." in text
    assert format_tool_call(call) + "<|im_end|>" in text
    assert '<|im_start|>tool\n{"status": "confirmed"}<|im_end|>' in text


def test_act_prompt_native_tools(tok, ctx):
    native = tok.__class__.from_pretrained(tok.name_or_path)
    native.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert template_supports_tools(native) and not template_supports_tools(tok)
    text = native.decode(act_prompt_ids(native, ctx, []))
    assert text.startswith("TOOLS:get_reservation_details;update_passengers;list_all_airports;")
    assert "Reservation ID" not in text and POLICY in text  # tools come only from the template


def test_rehearse_prompt_only_called_tool(tok, ctx):
    call = ToolCall(name="get_reservation_details", arguments={"reservation_id": "ABC123"})
    hist = [Message(role="user", content=ctx.first_user_message)]
    text = tok.decode(rehearse_prompt_ids(tok, ctx, hist, call))
    assert "get_reservation_details" in text and "The reservation ID, such as 'ZFA04Y'." in text
    assert "update_passengers" not in text and "list_all_airports" not in text
    assert POLICY in text and ctx.first_user_message in text and '"reservation_id": "ABC123"' in text
    assert '{"error": "<message>"}' in text and text.endswith("<|im_start|>assistant\n")
    # the caller may pass the history with the call already appended: it is not repeated
    with_call = hist + [Message(role="assistant", tool_call=call)]
    assert rehearse_prompt_ids(tok, ctx, with_call, call) == rehearse_prompt_ids(tok, ctx, hist, call)


def test_rehearse_prompt_unknown_tool(tok, ctx):
    text = tok.decode(rehearse_prompt_ids(tok, ctx, [], ToolCall(name="fly_now", arguments={})))
    assert 'No tool named "fly_now"' in text and "get_reservation_details" not in text


# ------------------------------------------------------------------------------------------- memory
def test_memory_text_budget(tok):
    rehearsals = [f"tried plan {i}\n" + "\n".join(f"rule {i}.{j}: do not cancel basic economy" for j in range(5))
                  for i in range(6)]
    full = memory_text(rehearsals, 10_000, tok)
    assert full.splitlines()[0] == "[rehearsal 6]" and "[rehearsal 1]" in full
    for budget in (0, 5, 20, 60, 150):
        m = memory_text(rehearsals, budget, tok)
        assert len(tok.encode(m, add_special_tokens=False)) <= budget
        assert full.startswith(m)  # truncated at whole lines, newest kept first
        lines = set(full.splitlines())
        assert all(line in lines for line in m.splitlines())
    assert memory_text(rehearsals, 5, tok) == ""  # a header alone is never emitted
    assert memory_text(["same\nx", "same\ny"], 100, tok) == "[rehearsal 2]\nsame\ny\n[rehearsal 1]\nx"


# ------------------------------------------------------------------------------------ USER-REHEARSE
@pytest.fixture(scope="module")
def airline_task():
    from envace_core.envs.tau2.tasks import load_tasks

    return load_tasks("airline", "train", limit=3)[2]


def test_user_constants_are_tau2s():
    from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
    from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER

    assert USER_STOP_TOKENS == (STOP, TRANSFER, OUT_OF_SCOPE)
    assert AGENT_GREETING == DEFAULT_FIRST_AGENT_MESSAGE.content


def test_user_prompt_is_tau2s_user_simulator_prompt(tok, airline_task):
    """Same system prompt and role flipping as tau2's UserSimulator (as our eval user simulator sends it)."""
    from tau2.data_model.message import AssistantMessage, UserMessage

    from envace_core.evaluation.tau2_agents import EnvaceUserSimulator

    instr = user_instructions(airline_task.user_scenario)
    assert "Known info:" in instr and "anya_garcia_5901" in instr and "Unknown info:" in instr
    history = [Message(role="user", content=airline_task.first_user_message),
               Message(role="assistant", tool_call=ToolCall(name="get_user_details", arguments={"user_id": "u"})),
               Message(role="tool", content='{"membership": "silver"}'),
               Message(role="assistant", content="You are a silver member.")]
    ours = user_messages(instr, history)
    sim = EnvaceUserSimulator(instructions=instr, engine=object())
    state = sim.get_init_state(message_history=[
        AssistantMessage(role="assistant", content=AGENT_GREETING),
        UserMessage(role="user", content=airline_task.first_user_message),
        AssistantMessage(role="assistant", content="You are a silver member.")])
    assert ours == sim._chat(state.system_messages + state.flip_roles())
    text = tok.decode(user_prompt_ids(tok, instr, history))
    assert "silver" in text and '"membership"' not in text and "get_user_details" not in text  # no tool I/O
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(EnvaceError, match="user_scenario"):
        user_instructions('{"persona": 3}')


def test_parse_user():
    assert parse_user("  My id is u1. ") == UserTurn("My id is u1.", False)
    assert parse_user("###STOP###").stop
    assert parse_user("Thanks, bye! ###TRANSFER###\n") == UserTurn("Thanks, bye! ###TRANSFER###", True)
    with pytest.raises(InvalidUserTurn, match="after the stop token"):
        parse_user("###STOP### and one more thing")
    assert parse_user("###STOP### and one more thing", strict=False).stop
    with pytest.raises(InvalidUserTurn, match="no tools"):
        parse_user(call_text())
    with pytest.raises(EmptyOutput):
        parse_user(" \n")
    assert isinstance(InvalidUserTurn("x"), ParseError)
