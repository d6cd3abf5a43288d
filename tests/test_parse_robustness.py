"""Bad model output a new user found: deep nesting, arguments that are not an object for an unknown tool, and
duplicate keys. Each becomes its typed ParseError (never RecursionError, never a silently chosen value), in
parse_act, parse_rehearse, the REHEARSE early stop and a rollout."""

from __future__ import annotations

import json
import sys

import pytest

from envace_core.roles.act import parse_act
from envace_core.roles.errors import InvalidArguments, InvalidRehearsal, MalformedToolCall, UnknownTool
from envace_core.roles.json_prefix import viable
from envace_core.roles.rehearse import parse_rehearse
from envace_core.roles.strict_json import (
    MAX_JSON_DEPTH,
    DuplicateKey,
    JsonTooDeep,
    check_depth,
    decode_json,
    strict_json,
    value_depth,
)
from envace_core.roles.tools import validate_arguments
from envace_core.types import ToolSpec

TOOLS = [ToolSpec(name="get_user_details", description="Look up a user.",
                  parameters={"type": "object", "properties": {"user_id": {}}, "required": ["user_id"]})]


def _call(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def _nest(n: int, inner: str = "1") -> str:
    return "[" * n + inner + "]" * n


# ------------------------------------------------------------------------------------------ depth
@pytest.mark.parametrize("schema_errors", [False, True])
@pytest.mark.parametrize("name", ["x", "get_user_details"])
def test_the_reported_1000_deep_call_is_a_malformed_tool_call(name, schema_errors):
    for text in (_call('{"name":"%s","arguments":' % name + "[" * 1000 + "]" * 1000 + "}"),
                 _call('{"name":"%s","arguments":' % name + "[" * 1000),
                 _call('{"name":"%s","arguments":{"user_id":' % name + '{"a":' * 100_000 + "1" + "}" * 100_001 + "}")):
        with pytest.raises(MalformedToolCall, match=f"nested too deeply: more than {MAX_JSON_DEPTH} levels"):
            parse_act(text, TOOLS, schema_errors=schema_errors)


def test_the_depth_limit_is_exact_and_counts_every_array_and_object():
    inner = MAX_JSON_DEPTH - 2  # the call object and the arguments object are two levels
    ok = parse_act(_call('{"name":"get_user_details","arguments":{"user_id":' + _nest(inner) + "}}"), TOOLS)
    assert value_depth(ok.tool_call.arguments) == MAX_JSON_DEPTH - 1
    with pytest.raises(MalformedToolCall, match="nested too deeply"):
        parse_act(_call('{"name":"get_user_details","arguments":{"user_id":' + _nest(inner + 1) + "}}"), TOOLS)


def test_a_call_under_the_old_recursion_limit_is_refused_not_passed_on():
    """900 levels decoded under Python's 1000-frame limit and went on as a tool call (a schema error with
    schema_errors=True); every later recursive walk of it (json.dumps, jsonschema) was a RecursionError
    waiting for a deeper stack."""
    text = _call('{"name":"x","arguments":{"a":' + _nest(900) + "}}")
    with pytest.raises(MalformedToolCall, match="nested too deeply"):
        parse_act(text, TOOLS, schema_errors=True)


def test_a_deep_call_is_refused_even_from_a_deep_stack():
    """The limit is checked on the text; decoding 128 levels needs far fewer frames than are left here."""
    def at_depth(n):
        return at_depth(n - 1) if n else parse_act(_call('{"name":"x","arguments":' + _nest(5000) + "}"), TOOLS)

    with pytest.raises(MalformedToolCall):
        at_depth(sys.getrecursionlimit() - 200)


def test_lenient_foreign_calls_get_the_same_limit_on_their_arguments():
    text = '<|python_tag|>{"name": "get_user_details", "parameters": {"user_id": ' + _nest(500) + "}}"
    with pytest.raises(InvalidArguments, match=r"nested too deeply: 501 levels of arrays/objects, at most 128"):
        parse_act(text, TOOLS, strict=False, lenient=True, schema_errors=True)


def test_check_depth_skips_brackets_in_strings_and_escaped_quotes():
    check_depth(json.dumps(["[" * 500, '"[[[' * 100, "\\" * 7]))
    with pytest.raises(JsonTooDeep):
        check_depth('["\\"", ' + "[" * MAX_JSON_DEPTH + "]")  # the escaped quote does not open a string
    check_depth('"unterminated [[[[' + "[" * 1000)  # inside a string to the end: no nesting at all
    check_depth("]]]]" + _nest(MAX_JSON_DEPTH))  # stray closers do not buy depth
    with pytest.raises(JsonTooDeep):
        check_depth("]]]]" + _nest(MAX_JSON_DEPTH + 1))


def test_validation_of_a_recursive_schema_that_runs_out_of_stack_is_invalid_arguments():
    node = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}
    tool = ToolSpec(name="tree", parameters={"$defs": {"node": node}, "type": "object",
                                             "properties": {"root": {"$ref": "#/$defs/node"}}})
    args: dict = {}
    for _ in range(100):
        args = {"child": args}
    validate_arguments({"root": args}, tool)  # fits in the usual stack
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(__import__("inspect").stack()) + 150)
    try:
        with pytest.raises(InvalidArguments, match="nested too deeply to validate"):
            validate_arguments({"root": args}, tool)
    finally:
        sys.setrecursionlimit(old)


def test_rehearse_output_and_its_early_stop_share_the_limit():
    parse_rehearse(_nest(MAX_JSON_DEPTH), "get_user_details")
    with pytest.raises(InvalidRehearsal, match="nested too deeply"):
        parse_rehearse(_nest(MAX_JSON_DEPTH + 1), "get_user_details")
    with pytest.raises(InvalidRehearsal, match="nested too deeply"):
        parse_rehearse(_nest(900), "get_user_details")
    assert viable(_nest(MAX_JSON_DEPTH)) and viable("[" * MAX_JSON_DEPTH)
    assert not viable("[" * (MAX_JSON_DEPTH + 1))
    assert viable("{" + '"a":{' * (MAX_JSON_DEPTH - 1)) and not viable("{" + '"a":{' * MAX_JSON_DEPTH)


# ------------------------------------------------------------------------- arguments not an object
@pytest.mark.parametrize("args, got", [("[1,2]", "array"), ("null", "null"), ('"u_1"', "string"), ("3", "number"),
                                       ("true", "boolean")])
@pytest.mark.parametrize("name", ["nope", "get_user_details"])
@pytest.mark.parametrize("schema_errors", [False, True])
def test_arguments_that_are_not_an_object_are_invalid_whatever_the_name(args, got, name, schema_errors):
    """tau2's ToolCall.arguments is a dict: such a call is malformed, not a call of an unknown tool."""
    with pytest.raises(InvalidArguments, match=f"arguments of {name} must be a JSON object, got {got}$"):
        parse_act(_call('{"name":"%s","arguments":%s}' % (name, args)), TOOLS, schema_errors=schema_errors)


def test_a_well_formed_call_of_an_unknown_tool_is_still_a_schema_error():
    text = _call('{"name":"nope","arguments":{"user_id":"u_1"}}')
    with pytest.raises(UnknownTool):
        parse_act(text, TOOLS)
    out = parse_act(text, TOOLS, schema_errors=True)
    assert isinstance(out.schema_error, UnknownTool) and out.tool_call.arguments == {"user_id": "u_1"}
    out = parse_act(_call('{"name":"nope"}'), TOOLS, schema_errors=True)  # omitted arguments are {}
    assert isinstance(out.schema_error, UnknownTool) and out.tool_call.arguments == {}


# -------------------------------------------------------------------------------- duplicate keys
@pytest.mark.parametrize("schema_errors", [False, True])
def test_a_repeated_argument_is_invalid_arguments_naming_the_key(schema_errors):
    text = _call('{"name":"get_user_details","arguments":{"user_id":"a","user_id":"b"}}')
    with pytest.raises(InvalidArguments, match=r'get_user_details hold the key "user_id" twice \(in arguments\)'):
        parse_act(text, TOOLS, schema_errors=schema_errors)
    nested = _call('{"name":"nope","arguments":{"p":[{"first":"a","last":"b","first":"c"}]}}')
    with pytest.raises(InvalidArguments, match=r'the key "first" twice \(in arguments/p/0\)'):
        parse_act(nested, TOOLS, schema_errors=schema_errors)
    escaped = _call('{"name":"get_user_details","arguments":{"user_id":"a","user_\\u0069d":"b"}}')
    with pytest.raises(InvalidArguments, match='"user_id" twice'):  # the same key once decoded
        parse_act(escaped, TOOLS, schema_errors=schema_errors)


def test_a_repeated_top_level_key_is_a_malformed_call():
    for body in ('{"name":"get_user_details","name":"nope","arguments":{"user_id":"a"}}',
                 '{"name":"get_user_details","arguments":{"user_id":"a"},"arguments":{"user_id":"b"}}'):
        with pytest.raises(MalformedToolCall, match="duplicate key .* in the top-level object"):
            parse_act(_call(body), TOOLS, schema_errors=True)


def test_equal_values_under_distinct_keys_are_fine():
    out = parse_act(_call('{"name":"get_user_details","arguments":{"user_id":{"a":1,"b":{"a":1}}}}'), TOOLS)
    assert out.tool_call.arguments == {"user_id": {"a": 1, "b": {"a": 1}}}


def test_rehearse_output_with_a_repeated_key_is_invalid_and_stops_early():
    for text in ('{"a": 1, "a": 2}', '{"users": [{"id": "u1", "id": "u2"}]}', '```json\n{"a": 1, "a": 2}\n```'):
        with pytest.raises(InvalidRehearsal, match='duplicate key "(a|id)"'):
            parse_rehearse(text, "get_user_details")
    assert viable('{"a": 1, "b"') and not viable('{"a": 1, "a"')
    assert not viable('{"users": [{"id": "u1", "\\u0069d"')
    assert viable('{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}')


def test_strict_json_names_the_key_and_where_it_is():
    with pytest.raises(DuplicateKey) as e:
        strict_json('{"x": [0, {"k": 1, "k": 2}]}')
    assert (e.value.key, e.value.path, str(e.value)) == ("k", ("x", 1), 'duplicate key "k" in x/1')
    value, dup = decode_json('{"k": 1, "k": 2}')
    assert value == {"k": 2} and type(value) is dict and dup.path == ()
    assert decode_json('{"k": [1, {"j": 2}]}') == ({"k": [1, {"j": 2}]}, None)


# ------------------------------------------------------------------------------------- in a rollout
def test_a_rollout_ends_these_outputs_as_parse_errors_and_runs_none(tiny_model_dir):
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.models import load_tokenizer
    from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
    from tests.scripted import ScriptedEngine

    task = next(t for t in load_tasks("airline", "test") if t.gold_actions)
    params = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0,
                           schema_errors=True)
    tok = load_tokenizer(tiny_model_dir)
    for text, error in [
        (_call('{"name":"x","arguments":{"a":' + _nest(900) + "}}"), "MalformedToolCall: tool call is not valid "
                                                                     "JSON: JSON nested too deeply"),
        (_call('{"name":"nope","arguments":[1,2]}'), "InvalidArguments: arguments of nope must be a JSON object"),
        (_call('{"name":"get_user_details","arguments":{"user_id":"a","user_id":"mia_li_3668"}}'),
         'InvalidArguments: arguments of get_user_details hold the key "user_id" twice'),
    ]:
        t = rehearsal_rollouts(ScriptedEngine(tok, [text, "Done."]), task_context(task, 300), 1, params, seed=0)[0]
        assert t.termination == "parse_error" and t.steps == []
        assert t.generations[0].parse_error.startswith(error)
