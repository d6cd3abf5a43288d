"""Every model-output parser, fed arbitrary text (and near-misses of every tool-call format we know), returns a
result or raises one of the project's typed `ParseError`s, never anything else; and a corpus of real tool-call
shapes from other model families is either parsed (lenient ACT) or counted as a typed format error (strict ACT,
USER, BFCL), never taken as a plain message or as "no call"."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envace_core.evaluation.bfcl import DecodeError, decode_calls
from envace_core.roles.act import parse_act
from envace_core.roles.errors import (
    ForeignToolCallFormat,
    InvalidUserTurn,
    MalformedToolCall,
    ParseError,
)
from envace_core.roles.foreign import FOREIGN_FORMATS, find_foreign_call
from envace_core.roles.rehearse import parse_rehearse
from envace_core.roles.self_eval import SelfEval, parse_self_eval
from envace_core.roles.user import UserTurn, parse_user
from envace_core.training.judge import InvalidVerdict, parse_verdict
from envace_core.types import Observation, ToolSpec

TOOLS = [
    ToolSpec(name="get_user_details", description="Look up a user.",
             parameters={"type": "object", "properties": {"user_id": {"type": "string"}},
                         "required": ["user_id"]}),
    ToolSpec(name="get_weather", description="Weather in a city.",
             parameters={"type": "object", "properties": {"city": {"type": "string"},
                                                          "unit": {"type": "string", "enum": ["c", "f"]}},
                         "required": ["city"]}),
]
NAMES = [t.name for t in TOOLS]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------- the corpus
# (format recognised, output text, the call it holds when decodable or None). Shapes from the models' chat
# templates and vLLM's tool parsers (vllm/tool_parsers/*_tool_parser.py).
CALL = ("get_user_details", {"user_id": "u_42"})
ARGS = json.dumps(CALL[1])
CORPUS: list[tuple[str, str, tuple | None]] = [
    ("llama3_python_tag", '<|python_tag|>{"name": "get_user_details", "parameters": ' + ARGS + "}", CALL),
    ("llama3_python_tag", '<|python_tag|>{"name": "get_user_details", "parameters": ' + ARGS + "}<|eom_id|>", CALL),
    ("llama3_python_tag", '<|python_tag|>get_user_details.call(user_id="u_42")', CALL),
    ("llama3_json", '{"name": "get_user_details", "parameters": ' + ARGS + "}", CALL),
    ("mistral", '[TOOL_CALLS][{"name": "get_user_details", "arguments": ' + ARGS + "}]", CALL),
    ("mistral", "[TOOL_CALLS]get_user_details[ARGS]" + ARGS, CALL),
    ("mistral", "[TOOL_CALLS]get_user_details[CALL_ID]a1b2c3d4e[ARGS]" + ARGS, CALL),
    ("function_tag", "<function=get_user_details>" + ARGS + "</function>", CALL),
    ("function_tag", "<function=get_user_details>\n<parameter=user_id>\nu_42\n</parameter>\n</function>", CALL),
    ("function_tag", "<seed:tool_call>\n<function=get_user_details>\n<parameter=user_id>u_42</parameter>\n"
                     "</function>\n</seed:tool_call>", CALL),
    ("glm4", "get_user_details\n<arg_key>user_id</arg_key>\n<arg_value>u_42</arg_value>", CALL),
    ("tagged_json", '<|tool_call|>[{"name": "get_user_details", "arguments": ' + ARGS + "}]", CALL),  # Granite
    ("tagged_json", '<tool_calls>[{"name": "get_user_details", "arguments": ' + ARGS + "}]</tool_calls>", CALL),
    ("tagged_json", '<function_call> {"name": "get_user_details", "arguments": ' + ARGS + "}", CALL),
    ("tagged_json", '<functioncall> {"name": "get_user_details", "arguments": \'' + ARGS + "'}", None),  # Glaive
    ("tagged_json", '<TOOLCALL>[{"name": "get_user_details", "arguments": ' + ARGS + "}]</TOOLCALL>", CALL),
    ("tagged_json", '<TOOL_CALL>{"name": "get_user_details", "arguments": ' + ARGS + "}</TOOL_CALL>", CALL),
    ("tagged_json", '<tool_use>{"name": "get_user_details", "arguments": ' + ARGS + "}</tool_use>", CALL),
    ("tagged_json", '<|tool_call_start|>[get_user_details(user_id="u_42")]<|tool_call_end|>', CALL),  # LFM2
    ("phi4_mini", 'functools[{"name": "get_user_details", "arguments": ' + ARGS + "}]", CALL),
    ("internlm", '<|action_start|><|plugin|>\n{"name": "get_user_details", "parameters": ' + ARGS
     + "}<|action_end|>", CALL),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_user_details\n```json\n"
                 + ARGS + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", CALL),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_user_details<｜tool▁sep｜>" + ARGS
     + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", CALL),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_user_details:0"
                "<|tool_call_argument_begin|>" + ARGS + "<|tool_call_end|><|tool_calls_section_end|>", CALL),
    ("gpt_oss", "<|start|>assistant<|channel|>commentary to=functions.get_user_details <|constrain|>json"
                "<|message|>" + ARGS + "<|call|>", CALL),
    ("functiongemma", "<start_function_call>call:get_user_details{user_id:<escape>u_42<escape>}"
                      "<end_function_call>", CALL),
    ("anthropic_xml", '<function_calls>\n<invoke name="get_user_details">\n<parameter name="user_id">u_42'
                      "</parameter>\n</invoke>\n</function_calls>", CALL),
    ("openai_tool_calls", json.dumps({"tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_user_details", "arguments": ARGS}}]}), CALL),
    ("openai_function", json.dumps({"type": "function", "function": {"name": "get_user_details",
                                                                     "arguments": CALL[1]}}), CALL),
    ("json_call", '[{"name": "get_user_details", "arguments": ' + ARGS + "}]", CALL),  # xLAM
    ("json_call", '```json\n{"name": "get_user_details", "arguments": ' + ARGS + "}\n```", CALL),
    ("json_call", 'Sure, let me look that up.\n{"name": "get_user_details", "arguments": ' + ARGS + "}", CALL),
    ("json_function", '{"function": "get_user_details", "parameters": ' + ARGS + "}", CALL),
    ("agent_json", '{"tool_name": "get_user_details", "parameters": ' + ARGS + "}", CALL),  # Cohere
    ("agent_json", '```json\n{"action": "get_user_details", "action_input": ' + ARGS + "}\n```", CALL),  # LangChain
    ("react", "Thought: I need the user.\nAction: get_user_details\nAction Input: " + ARGS, CALL),
    ("pythonic", 'get_user_details(user_id="u_42")', CALL),
    ("pythonic", '[get_user_details(user_id="u_42")]', CALL),  # Llama 3.2 / 4 pythonic
    ("pythonic", '```tool_code\nget_user_details(user_id="u_42")\n```', CALL),  # Gemma
    ("pythonic", 'I will call get_user_details(user_id="u_42") now.', CALL),
    ("xml_tool_tag", "<get_user_details><user_id>u_42</user_id></get_user_details>", CALL),
]


NAMED_FORMATS = {"pythonic", "xml_tool_tag"}  # recognised only for the given tool names
BFCL_DECODES = {"llama3_json", "openai_function", "json_call", "json_function", "pythonic"}


def test_corpus_covers_many_families():
    assert len(CORPUS) >= 20 and len({f for f, _, _ in CORPUS}) >= 20
    assert {f for f, _, _ in CORPUS} <= set(FOREIGN_FORMATS)


@pytest.mark.parametrize("fmt, text, call", CORPUS, ids=[f"{i}-{c[0]}" for i, c in enumerate(CORPUS)])
def test_foreign_call_is_a_typed_error_in_strict_mode_and_parsed_in_lenient_mode(fmt, text, call):
    found = find_foreign_call(text, NAMES)
    assert found is not None and found.format == fmt
    with pytest.raises(ForeignToolCallFormat) as e:  # strict (the default): never a message to the user
        parse_act(text, TOOLS)
    assert e.value.format == fmt and fmt in str(e.value) and e.value.raw == text
    assert isinstance(e.value, MalformedToolCall)
    if fmt not in NAMED_FORMATS:  # the rehearsed user has no tools (and knows no tool names)
        with pytest.raises(InvalidUserTurn, match="no tools"):
            parse_user(text)
    try:  # BFCL: the call (a form decode_calls takes, see its docstring) or a decode error, never "no call"
        assert decode_calls(text, TOOLS) == [{CALL[0]: CALL[1]}] and fmt in BFCL_DECODES
    except DecodeError:
        pass
    if call is None:
        with pytest.raises(ForeignToolCallFormat, match="not decodable"):
            parse_act(text, TOOLS, strict=False, lenient=True)
        return
    out = parse_act(text, TOOLS, strict=False, lenient=True)
    assert (out.tool_call.name, out.tool_call.arguments) == call and out.message == ""


def test_lenient_mode_still_checks_the_call():
    from envace_core.roles.errors import InvalidArguments, MultipleToolCalls, TextOutsideToolCall, UnknownTool

    with pytest.raises(UnknownTool):
        parse_act('<|python_tag|>{"name": "drop_tables", "parameters": {}}', TOOLS, lenient=True)
    with pytest.raises(InvalidArguments):
        parse_act('<|python_tag|>{"name": "get_user_details", "parameters": {"user_id": 7}}', TOOLS, lenient=True)
    with pytest.raises(MultipleToolCalls):
        parse_act('[get_user_details(user_id="a"), get_weather(city="b")]', TOOLS, lenient=True)
    with pytest.raises(TextOutsideToolCall):
        parse_act('Checking. <|python_tag|>{"name": "get_user_details", "parameters": {"user_id": "a"}}', TOOLS,
                  strict=True, lenient=True)
    assert parse_act('Checking. <|python_tag|>{"name": "get_user_details", "parameters": {"user_id": "a"}}', TOOLS,
                     strict=False, lenient=True).tool_call.arguments == {"user_id": "a"}


@pytest.mark.parametrize("text", [
    "Your reservation is confirmed. Anything else?",
    "The weather function is down; I can look up your user details instead.",
    "I have noted user id u_42 (get_user_details shows nothing).",
    "Action items: none. Thank you!",
])
def test_plain_messages_stay_messages(text):
    assert parse_act(text, TOOLS).message == text
    assert parse_user(text) == UserTurn(text, False)
    assert decode_calls(text, TOOLS) == []


def test_json_data_in_a_message_is_not_a_call():
    text = 'Your profile says {"name": "John Smith", "city": "Boston"}.'
    assert parse_act(text, TOOLS).message == text and parse_user(text).message == text


def test_foreign_body_inside_our_tags_is_named():
    with pytest.raises(ForeignToolCallFormat) as e:  # Qwen3-Coder writes XML inside <tool_call>
        parse_act("<tool_call>\n<function=get_user_details>\n<parameter=user_id>u_42</parameter>\n</function>\n"
                  "</tool_call>", TOOLS)
    assert e.value.format == "function_tag"
    with pytest.raises(ForeignToolCallFormat) as e:  # GLM-4.5
        parse_act("<tool_call>get_user_details\n<arg_key>user_id</arg_key>\n<arg_value>u_42</arg_value>"
                  "</tool_call>", TOOLS)
    assert e.value.format == "glm4"
    with pytest.raises(ForeignToolCallFormat) as e:  # Llama's "parameters" key in our tags
        parse_act('<tool_call>{"name": "get_user_details", "parameters": {"user_id": "u"}}</tool_call>', TOOLS)
    assert e.value.format == "llama3_json"
    out = parse_act('<tool_call>{"name": "get_user_details", "parameters": {"user_id": "u"}}</tool_call>', TOOLS,
                    lenient=True)
    assert out.tool_call.arguments == {"user_id": "u"}


# ---------------------------------------------------------------------------------- the properties
_SNIPPETS = sorted({s for _, t, _ in CORPUS for s in (t[:12], t[-12:], t[: len(t) // 2], t[len(t) // 2:])} | {
    "<tool_call>", "</tool_call>", "<tool_call", "<tool_calls>", '{"name": ', '"arguments": ', "{", "}", "[", "]",
    "(", ")", "NaN", "Infinity", "###STOP###", "###TRANSFER###", "```", "```json\n", '"met": ', "true", "false",
    '"reached_goal": ', "get_user_details", "get_weather(", "user_id=", "\x00", "\ud800", "\\", '"', "'", "\n",
})
near_miss = st.lists(st.one_of(st.sampled_from(_SNIPPETS), st.text(max_size=8)), max_size=12).map("".join)
anything = st.one_of(st.text(max_size=200), near_miss,
                     st.sampled_from([t for _, t, _ in CORPUS]).flatmap(
                         lambda t: st.integers(0, len(t)).map(lambda i: t[:i])))  # truncated real calls


def _typed(fn, text):
    try:
        return fn(text)
    except ParseError:
        return None


@SETTINGS
@given(anything, st.booleans(), st.booleans())
def test_parse_act_returns_or_raises_a_parse_error(text, strict, lenient):
    out = _typed(lambda t: parse_act(t, TOOLS, strict=strict, lenient=lenient), text)
    if out is not None:
        assert (out.tool_call is None) != (out.message == "")
        if out.tool_call is None:  # a message never holds a call in a format we know
            assert find_foreign_call(text, NAMES) is None and "<tool_call" not in text


@SETTINGS
@given(anything)
def test_parse_rehearse_returns_or_raises_a_parse_error(text):
    out = _typed(parse_rehearse, text)
    assert out is None or isinstance(out, Observation) and isinstance(json.loads(out.content), object)


@SETTINGS
@given(anything, st.booleans())
def test_parse_user_returns_or_raises_a_parse_error(text, strict):
    out = _typed(lambda t: parse_user(t, strict=strict), text)
    assert out is None or isinstance(out, UserTurn) and out.message == text.strip()


@SETTINGS
@given(anything)
def test_parse_self_eval_never_raises(text):
    out = parse_self_eval(text)
    assert isinstance(out, SelfEval) and out.raw == text and isinstance(out.as_text(), str)


@SETTINGS
@given(anything, st.integers(0, 4))
def test_parse_verdict_returns_or_raises_a_parse_error(text, n):
    out = _typed(lambda t: parse_verdict(t, n), text)
    assert out is None or len(out) == n


@SETTINGS
@given(anything)
def test_decode_calls_returns_or_raises_a_parse_error(text):
    out = _typed(lambda t: decode_calls(t, TOOLS), text)
    assert out is None or all(isinstance(c, dict) and len(c) == 1 for c in out)


DEEP = ["[" * 100_000, '{"a":' * 50_000, "[" * 990 + "]" * 990, '{"name": "get_user_details", "arguments": '
        + "[" * 5000 + "]" * 5000 + "}", "<tool_call>" + "[" * 50_000 + "</tool_call>", "(" * 10_000,
        "get_user_details(" * 3000, "{" * 200_000, "<|python_tag|>" + "[" * 20_000]


@pytest.mark.parametrize("text", DEEP, ids=range(len(DEEP)))
def test_deep_and_long_outputs_are_typed_errors_fast(text):
    t0 = time.monotonic()
    for parse in (lambda t: parse_act(t, TOOLS), lambda t: parse_act(t, TOOLS, strict=False, lenient=True),
                  parse_rehearse, parse_user, lambda t: decode_calls(t, TOOLS)):
        _typed(parse, text)
    assert isinstance(parse_self_eval(text), SelfEval)
    assert time.monotonic() - t0 < 20


def test_parse_verdict_deep_nesting_is_a_parse_error():
    for text in ('{"met": ' + "[" * 100_000, '{"met": ' + "[" * 100_000 + "]" * 100_000 + "}"):
        with pytest.raises(InvalidVerdict, match="too deeply"):
            parse_verdict(text, 1)


# ---------------------------------------------------------------------------------- where they are counted
@pytest.mark.parametrize("text", ['<|python_tag|>{"name": "get_user_details", "parameters": {"user_id": "x"}}',
                                  '[TOOL_CALLS][{"name": "get_user_details", "arguments": {"user_id": "x"}}]',
                                  'get_user_details(user_id="x")'])
def test_a_foreign_call_in_training_is_a_penalised_counted_parse_error(text, tiny_model_dir):
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.models import load_tokenizer
    from envace_core.training.loop import rollout_metrics, score
    from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
    from tests.scripted import ScriptedEngine

    task = load_tasks("airline", "test", limit=1)[0]
    p = RolloutParams(max_turns=2, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    t = rehearsal_rollouts(ScriptedEngine(load_tokenizer(tiny_model_dir), [text]), task_context(task, 300), 1, p)[0]
    assert t.termination == "parse_error" and t.steps == []  # not an agent_message
    assert t.generations[0].parse_error.startswith("ForeignToolCallFormat: ")
    assert score(task, t, format_penalty=-0.5).reward == -0.5
    m = rollout_metrics([t])
    assert m["parse_error_rate/act"] == 1.0 and m["parse_error_rate"] == 1.0
