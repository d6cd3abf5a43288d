"""BFCL-v4 with bfcl-eval's own data, possible answers, AST / multi-turn checkers and tool classes.

Possible answers rendered as our native tool-call text score valid under bfcl's AST checker; a wrong
value does not; each awkward output form is parsed or reported as a typed DecodeError; multi-turn
ground-truth calls replayed through our env pass bfcl's multi-turn checker and a dropped call fails;
env state is private; the evaluator reports per-category numbers, decode errors and bfcl's overall.
"""

from __future__ import annotations

import copy
import json
import re
import sys

import pytest

import envace_core  # noqa: F401  (offline environment)
from envace_core.envs.bfcl import (
    BfclMultiTurnEnv,
    call_string,
    check_multi_turn,
    drop_instances,
    import_bfcl,
)
from envace_core.evaluation.bfcl import (
    DecodeError,
    UnsupportedCategory,
    bfcl_task,
    decode_calls,
    load_bfcl,
    score_single_turn,
)
from envace_core.evaluation.bfcl_results import overall_scores
from envace_core.evaluation.bfcl_run import evaluate_bfcl
from envace_core.types import ToolCall
from tests.scripted import ScriptedEngine


# ------------------------------------------------------------------------------------------ helpers
def _pick(options):
    """First non-"" option of a bfcl possible-answer list, rendered recursively (nested dicts hold options)."""
    for o in options:
        if o != "":
            return True, _render(o)
    return False, None


def _render(v):
    if isinstance(v, dict):
        out = {}
        for k, opts in v.items():
            ok, val = _pick(opts) if isinstance(opts, list) else (True, opts)
            if ok:
                out[k] = val
        return out
    if isinstance(v, list):
        return [_render(x) for x in v]
    return v


def _answer_calls(ground_truth):
    calls = []
    for call in ground_truth:
        (name, args), = call.items()
        rendered = {}
        for k, opts in args.items():
            ok, val = _pick(opts)
            if ok:
                rendered[k] = val
        calls.append((name, rendered))
    return calls


def _native(calls) -> str:
    return "\n".join("<tool_call>" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "</tool_call>"
                     for n, a in calls)


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from envace_core.models import load_tokenizer

    return load_tokenizer(bundled_tokenizer_dir)


# ------------------------------------------------------------------------------ the stand-in import
def test_bfcl_imports_with_model_config_stand_in():
    b = import_bfcl()
    mod = sys.modules["bfcl_eval.constants.model_config"]
    assert getattr(mod, "__envace_stand_in__", False) and "stand-in" in mod.__doc__.lower()
    assert mod.MODEL_CONFIG_MAPPING["envace"].underscore_to_dot is False
    assert "anthropic" not in sys.modules  # no vendor SDK was pulled in
    assert callable(b.ast_checker) and callable(b.multi_turn_checker)


def test_unknown_and_unsupported_categories_are_refused():
    with pytest.raises(UnsupportedCategory):
        load_bfcl("simple_java")
    with pytest.raises(UnsupportedCategory):
        load_bfcl("no_such_category")
    assert load_bfcl("simple", 2)[0].id == "simple_python_0"  # alias


# --------------------------------------------------------------------------- AST: possible answers
@pytest.mark.parametrize("category", ["simple", "multiple", "parallel", "parallel_multiple", "live_simple",
                                      "live_multiple", "live_parallel"])
def test_possible_answer_as_native_text_scores_valid(category):
    entries = load_bfcl(category, 6)
    assert len(entries) == 6 and all(e.ground_truth for e in entries)
    for e in entries:
        text = _native(_answer_calls(e.ground_truth))
        calls = decode_calls(text, e.functions)
        verdict = score_single_turn(e, calls)
        assert verdict["valid"], (e.id, text, verdict)


@pytest.mark.parametrize("category", ["simple", "multiple", "parallel", "live_simple"])
def test_wrong_value_scores_invalid(category):
    for e in load_bfcl(category, 4):
        calls = _answer_calls(e.ground_truth)
        name, args = calls[0]
        key = next(k for k, v in args.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool))
        args = {**args, key: (args[key] + 7919 if isinstance(args[key], (int, float)) else args[key] + " WRONG")}
        text = _native([(name, args)] + calls[1:])
        verdict = score_single_turn(e, decode_calls(text, e.functions))
        assert not verdict["valid"] and verdict["error_type"], (e.id, text)


def test_wrong_function_name_and_missing_call_score_invalid():
    e = load_bfcl("simple", 1)[0]
    (_name, args), = _answer_calls(e.ground_truth)
    assert not score_single_turn(e, decode_calls(_native([("other_function", args)]), e.functions))["valid"]
    assert not score_single_turn(e, decode_calls("The area is 25 square units.", e.functions))["valid"]
    assert score_single_turn(e, None)["error_type"] == "ast_decoder:decoder_failed"


@pytest.mark.parametrize("category", ["irrelevance", "live_irrelevance"])
def test_irrelevance_no_call_is_correct_and_a_call_is_not(category):
    for e in load_bfcl(category, 4):
        assert score_single_turn(e, decode_calls("None of the functions can answer this.", e.functions))["valid"]
        assert score_single_turn(e, [])["valid"]
        assert score_single_turn(e, None)["valid"]  # bfcl's rule: an undecodable output is no call
        f = e.functions[0]
        call = _native([(f["name"], {p: "x" for p in f["parameters"].get("required", [])})])
        verdict = score_single_turn(e, decode_calls(call, e.functions))
        assert not verdict["valid"] and verdict["error_type"] == "irrelevance_error:decoder_success"


def test_live_relevance_needs_a_call():
    e = load_bfcl("live_relevance", 1)[0]
    assert not score_single_turn(e, decode_calls("I cannot help.", e.functions))["valid"]
    f = e.functions[0]
    call = _native([(f["name"], {p: "x" for p in f["parameters"].get("required", [])})])
    assert score_single_turn(e, decode_calls(call, e.functions))["valid"]


# ------------------------------------------------------------------------------ awkward outputs
TOOLS = [
    {"name": "get_weather", "description": "", "parameters": {"type": "dict", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}},
    {"name": "math.factorial", "description": "", "parameters": {"type": "dict", "properties": {
        "number": {"type": "integer"}}, "required": ["number"]}},
    {"name": "say", "description": "", "parameters": {"type": "dict", "properties": {
        "text": {"type": "string"}}, "required": ["text"]}},
]


def test_native_single_and_several_calls():
    one = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert decode_calls(one, TOOLS) == [{"get_weather": {"city": "Paris"}}]
    two = one + '\n<tool_call>{"name": "math.factorial", "arguments": {"number": 5}}</tool_call>'
    assert decode_calls(two, TOOLS) == [{"get_weather": {"city": "Paris"}}, {"math.factorial": {"number": 5}}]


def test_bare_json_list_of_calls():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, ' \
           '{"name": "math.factorial", "arguments": {"number": 5}}]'
    assert decode_calls(text, TOOLS) == [{"get_weather": {"city": "Paris", "unit": "C"}},
                                         {"math.factorial": {"number": 5}}]
    fenced = "```json\n" + text + "\n```"
    assert decode_calls(fenced, TOOLS) == decode_calls(text, TOOLS)
    assert decode_calls("[]", TOOLS) == []
    with pytest.raises(DecodeError) as e:
        decode_calls('[{"city": "Paris"}]', TOOLS)  # JSON, but not a call
    assert e.value.reason == "not_a_call"


def test_calls_wrapped_in_prose():
    text = ('Sure! Let me check that for you.\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            'I will report back once I have the result.')
    assert decode_calls(text, TOOLS) == [{"get_weather": {"city": "Paris"}}]
    with pytest.raises(DecodeError) as e:  # an untagged call inside prose is not guessed at
        decode_calls("Sure, calling get_weather(city='Paris') now.", TOOLS)
    assert e.value.reason == "call_in_prose"
    with pytest.raises(DecodeError) as e:
        decode_calls('Here: {"name": "get_weather", "arguments": {"city": "Paris"}} done', TOOLS)
    assert e.value.reason == "call_in_prose"
    assert decode_calls("It is sunny in Paris today.", TOOLS) == []  # plain text: no call


def test_python_style_calls():
    assert decode_calls('get_weather(city="Paris", unit="C")', TOOLS) == [{"get_weather": {"city": "Paris",
                                                                                           "unit": "C"}}]
    assert decode_calls("[math.factorial(number=5), get_weather(city='Rome')]", TOOLS) == [
        {"math.factorial": {"number": 5}}, {"get_weather": {"city": "Rome"}}]
    assert decode_calls("<tool_call>get_weather('Oslo', unit='F')</tool_call>", TOOLS) == [
        {"get_weather": {"city": "Oslo", "unit": "F"}}]  # positional named by the tool's parameter order
    assert decode_calls("math.factorial(number=-3)", TOOLS) == [{"math.factorial": {"number": -3}}]
    for bad, reason in [("get_weather(city=__import__('os').getcwd())", "unsupported_argument"),
                        ("get_weather(city=paris)", "unsupported_argument"),
                        ("get_weather('a', 'b', 'c')", "positional_arguments"),
                        ("get_weather(city='Paris'", "bad_json")]:
        with pytest.raises(DecodeError) as e:
            decode_calls(bad, TOOLS)
        assert e.value.reason == reason, bad


def test_a_positional_dict_is_a_decode_error_not_a_nested_argument():
    """`get_weather({"city": "Paris"})` is the keyword arguments written as a dict: naming it `city` would score
    a wrong answer ({"city": {"city": "Paris"}}) instead of a decode error (bfcl's `ast_parse` reads keywords only)."""
    for text in ('get_weather({"city": "Paris"})', "<tool_call>get_weather({'city': 'Paris', 'unit': 'C'})</tool_call>",
                 '[get_weather({"city": "Paris"})]'):
        with pytest.raises(DecodeError) as e:
            decode_calls(text, TOOLS)
        assert e.value.reason == "positional_arguments" and "positional dict" in str(e.value), text
    takes_dict = [{"name": "book", "description": "", "parameters": {"type": "dict", "properties": {
        "options": {"type": "dict"}, "note": {"type": "string"}}}}]
    assert decode_calls('book({"seat": "12A"})', takes_dict) == [{"book": {"options": {"seat": "12A"}}}]


@pytest.mark.parametrize("text", [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '<function=get_weather>{"city": "Paris"}</function>',
    '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>',
    "Action: get_weather\nAction Input: {\"city\": \"Paris\"}",
    "<get_weather><city>Paris</city></get_weather>",
])
def test_foreign_formats_are_decode_errors_not_no_call(text):
    """Scored as "no call" these would count as correct in the irrelevance categories."""
    with pytest.raises(DecodeError) as e:
        decode_calls(text, TOOLS)
    assert e.value.reason == "foreign_format"


def test_nested_quotes():
    text = r'<tool_call>{"name": "say", "arguments": {"text": "He said \"hi\" and it' + "'" + r's fine"}}</tool_call>'
    assert decode_calls(text, TOOLS) == [{"say": {"text": 'He said "hi" and it\'s fine'}}]
    assert decode_calls("""say(text="It's \\"quoted\\" here")""", TOOLS) == [{"say": {"text": 'It\'s "quoted" here'}}]
    assert decode_calls("""<tool_call>{'name': 'say', 'arguments': {'text': "it's"}}</tool_call>""", TOOLS) == [
        {"say": {"text": "it's"}}]  # a single-quoted Python dict, read with ast.literal_eval
    with pytest.raises(DecodeError) as e:  # unescaped inner double quotes break the JSON
        decode_calls('<tool_call>{"name": "say", "arguments": {"text": "He said "hi""}}</tool_call>', TOOLS)
    assert e.value.reason == "bad_json"


def test_broken_tags_are_decode_errors():
    for text, reason in [('<tool_call>{"name": "say", "arguments": {"text": "a"}}', "unclosed_tag"),
                         ('{"name": "say"}</tool_call>', "stray_tag"),
                         ('<tool_call >{"name": "say", "arguments": {}}</tool_call>', "malformed_tag"),
                         ("<tool_call>  </tool_call>", "empty_call_block"),
                         ('<tool_call>{"name": "say", "arguments": "not json"}</tool_call>', "bad_arguments"),
                         ('<tool_call>{"name": "say", "arguments": [1]}</tool_call>', "bad_arguments")]:
        with pytest.raises(DecodeError) as e:
            decode_calls(text, TOOLS)
        assert e.value.reason == reason, text
        assert e.value.raw == text


def test_other_json_call_shapes():
    assert decode_calls('{"name": "say", "parameters": {"text": "a"}}', TOOLS) == [{"say": {"text": "a"}}]
    assert decode_calls('[{"function": "say", "parameters": {"text": "a"}}]', TOOLS) == [{"say": {"text": "a"}}]
    assert decode_calls('<tool_call>{"name": "say", "arguments": "{\\"text\\": \\"a\\"}"}</tool_call>',
                        TOOLS) == [{"say": {"text": "a"}}]


# -------------------------------------------------------------------------------------- multi-turn
def _replay(entry, drop=None):
    """Play the ground truth through our env; `drop` = (turn, index) of one call to leave out."""
    env = BfclMultiTurnEnv()
    task = bfcl_task(entry)
    env.reset(task)
    for t, turn in enumerate(entry.ground_truth):
        env.begin_turn()
        for i, s in enumerate(turn):
            if drop == (t, i):
                continue
            calls = decode_calls(s, env.tools())
            obs = env.step_calls([ToolCall(name=n, arguments=a) for c in calls for n, a in c.items()])
            assert len(obs) == len(calls)
    result = env.score(task, [], "")
    env.close()
    return result


@pytest.fixture(scope="module")
def mt_entries():
    return load_bfcl("multi_turn_base", 2)


def test_multi_turn_ground_truth_replay_passes_and_dropping_a_call_fails(mt_entries):
    for e in mt_entries:
        assert _replay(e).reward == 1.0, e.id
        # drop the last state-changing call of the first turn with one
        t = next(i for i, turn in enumerate(e.ground_truth) if turn)
        dropped = _replay(e, drop=(t, len(e.ground_truth[t]) - 1))
        assert dropped.reward == 0.0 and dropped.info["error_type"].startswith("multi_turn:"), e.id


def test_multi_turn_checker_requires_every_turn(mt_entries):
    e = mt_entries[0]
    r = check_multi_turn(e.raw, [[]], e.ground_truth)
    assert not r["valid"] and r["error_type"] == "multi_turn:force_terminated"


def test_env_state_is_isolated_and_snapshot_tracks_changes(mt_entries):
    e = mt_entries[0]  # GorillaFileSystem + TwitterAPI
    a, b = BfclMultiTurnEnv(), BfclMultiTurnEnv()
    a.reset(bfcl_task(e))
    b.reset(bfcl_task(e))
    assert a.snapshot() == b.snapshot()
    before = b.snapshot()
    a.begin_turn()
    obs = a.step_calls([ToolCall(name="cd", arguments={"folder": "document"}),
                        ToolCall(name="mkdir", arguments={"dir_name": "temp"})])
    assert not any(o.error for o in obs)
    assert a.snapshot() != before and b.snapshot() == before  # b did not see a's change
    assert a.calls_made == 2 and b.calls_made == 0
    # a fresh reset restores the initial state
    a.reset(bfcl_task(e))
    assert a.snapshot() == before
    # unknown functions and unsafe argument names are refused, not executed
    a.begin_turn()
    bad = a.step_calls([ToolCall(name="__import__", arguments={"name": "os"}),
                        ToolCall(name="mkdir", arguments={"dir_name) or print(1": "x"})])
    assert all(o.error for o in bad) and a.turn_calls == [[]] and a.snapshot() == before
    a.close(), b.close()
    assert drop_instances(a._model_name) == 0  # nothing left behind in bfcl's globals


def test_tool_errors_come_back_as_error_observations(mt_entries):
    env = BfclMultiTurnEnv()
    env.reset(bfcl_task(mt_entries[0]))
    obs = env.step(ToolCall(name="cd", arguments={"folder": "no_such_folder"}))
    assert obs.error and "no_such_folder" in obs.content
    env.close()


def test_call_string_matches_bfcl_form():
    assert call_string("mv", {"source": "a.txt", "destination": "b"}) == "mv(source='a.txt', destination='b')"
    assert call_string("math.factorial", {"number": 5}) == "math.factorial(number=5)"


# ---------------------------------------------------------------------------------------- evaluator
class AnswerEngine(ScriptedEngine):
    """Answers single-turn prompts from a {user question: reply} table; multi-turn prompts with the
    entry's ground-truth calls for the current turn (all in one step), then "Done." after tool results."""

    def __init__(self, tokenizer, replies, mt_entries=()):
        super().__init__(tokenizer, ["I cannot help with that."])
        self.replies = replies
        self.mt = list(mt_entries)

    def _reply(self, text):
        for q, r in self.replies.items():
            if q in text:
                return r
        for e in self.mt:
            if e.question[0][0]["content"] in text:
                if text.rstrip().endswith("<|im_start|>assistant") and \
                        text.rfind("<|im_start|>tool") > text.rfind("<|im_start|>user"):
                    return "Done."
                turn = text.count("<|im_start|>user") - 1
                env = BfclMultiTurnEnv()
                env.reset(bfcl_task(e))
                calls = [c for s in e.ground_truth[turn] for c in decode_calls(s, env.tools())]
                env.close()
                return _native([(n, a) for c in calls for n, a in c.items()]) if calls else "Nothing to do."
        return self.act_texts[0]

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            self.calls.append("act")
            out.append([self._completion(self._reply(self.tokenizer.decode(p))) for _ in range(params.n)])
        return out


def test_evaluator_reports_categories_decode_errors_and_bfcl_overall(tok, mt_entries):
    simple = load_bfcl("simple", 3)
    irrelevance = load_bfcl("irrelevance", 2)
    q = lambda e: e.question[0][-1]["content"]
    replies = {
        q(simple[0]): _native(_answer_calls(simple[0].ground_truth)),  # correct
        q(simple[1]): '<tool_call>{"name": "x", "arguments": {</tool_call>',  # decode error
        q(simple[2]): "I do not know.",  # no call
        q(irrelevance[0]): "None of these functions apply.",  # correct (no call)
        q(irrelevance[1]): "<tool_call>{broken",  # decode error, counted, and "no call" by bfcl's rule
    }
    engine = AnswerEngine(tok, replies, mt_entries)
    report = evaluate_bfcl(engine, ["simple", "irrelevance", "multi_turn_base"], limit_per_category=3,
                           batch_size=2)
    s, i, m = (report.categories[c] for c in ("simple_python", "irrelevance", "multi_turn_base"))
    assert (s.n, s.correct, s.decode_errors, s.no_call, s.wrong) == (3, 1, 1, 1, 0)
    assert s.accuracy == pytest.approx(1 / 3)
    assert [r.outcome for r in s.entries] == ["correct", "decode_error", "no_call"]
    assert s.decode_reasons == {"bad_json": 1} and s.error_types["ast_decoder:decoder_failed"] == 1
    assert (i.n, i.correct, i.decode_errors) == (3, 3, 1)  # 3rd irrelevance entry gets the default text
    # multi-turn: the ground truth played turn by turn through our agent loop passes bfcl's checker
    assert m.n == 3 and [r.valid for r in m.entries[:2]] == [True, True]
    assert m.entries[2].valid is False  # not in the engine's table: it only answered in text
    # bfcl's weighting: missing categories count 0 in `overall`; the evaluated-only variant renormalises
    scores = {c: {"accuracy": r.accuracy, "total_count": r.n} for c, r in report.categories.items()}
    assert report.overall == pytest.approx(overall_scores(scores)[0]["accuracy"])
    non_live = (1 / 3 + 0 + 0 + 0) / 4  # simple = mean(simple_python, java 0, js 0) -> /3
    expected = 0.1 * ((1 / 3) / 3) / 4 + 0.1 * 0 + 0.1 * (1.0 + 0) / 2 + 0.3 * (2 / 3) / 4 + 0.4 * 0
    assert non_live > 0 and report.overall == pytest.approx(expected)
    expected_eval = (10 * (1 / 3) + 10 * 1.0 + 30 * (2 / 3)) / 50
    assert report.overall_evaluated == pytest.approx(expected_eval)
    assert not report.complete and "live_simple" in report.missing_categories
    table = report.table()
    assert "decode_err" in table and "simple_python" in table and "overall (bfcl)" in table
    json.dumps(report.model_dump())  # the report serialises


def test_decode_error_in_multi_turn_is_counted_and_ends_the_turn(tok, mt_entries):
    engine = ScriptedEngine(tok, ["<tool_call>{oops</tool_call>"])
    report = evaluate_bfcl(engine, ["multi_turn_base"], limit_per_category=1)
    m = report.categories["multi_turn_base"]
    turns = len(mt_entries[0].question)
    assert m.decode_errors == 1 and m.decode_error_steps == turns and m.decode_reasons == {"bad_json": turns}
    assert m.correct == 0 and m.entries[0].error_type == "multi_turn:empty_turn_model_response"


def test_prompt_shows_tools_and_no_answer(tok):
    e = load_bfcl("simple", 1)[0]
    engine = ScriptedEngine(tok, ["x"])
    seen = []
    orig = engine.generate

    def spy(prompts, params):
        seen.extend(tok.decode(p) for p in prompts)
        return orig(prompts, params)

    engine.generate = spy
    evaluate_bfcl(engine, ["simple"], limit_per_category=1)
    assert "calculate_triangle_area" in seen[0] and "<tool_call>" in seen[0]
    assert "You simulate the" not in seen[0]
    assert re.search(r"base \(integer\)", seen[0])
    gt = copy.deepcopy(e.ground_truth)
    assert json.dumps(gt) not in seen[0]
