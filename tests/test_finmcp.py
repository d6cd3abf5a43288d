"""FinMCP-Bench adapter: loader, tool-name metrics, per-turn evaluation with gold history (no leakage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envace_core import EnvaceError
from envace_core.evaluation.finmcp import finmcp_metrics, load_finmcp, tool_name_counts
from envace_core.evaluation.finmcp_run import (
    decode_tool_calls,
    evaluate_finmcp,
    prompt_messages,
)
from tests.scripted import ScriptedEngine

FIXTURE = Path(__file__).parent / "fixtures" / "finmcp_sample.json"


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


@pytest.fixture(scope="module")
def samples():
    return {s.id: s for s in load_finmcp(FIXTURE)}


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from envace_core.models import load_tokenizer

    return load_tokenizer(bundled_tokenizer_dir)


class RecordingEngine(ScriptedEngine):
    """ScriptedEngine that also keeps the decoded prompts it was given."""

    def __init__(self, tokenizer, act_texts):
        super().__init__(tokenizer, act_texts)
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += [self.tokenizer.decode(p) for p in prompts]
        return super().generate(prompts, params)


# ------------------------------------------------------------------------------------------ metrics
def test_multiset_counts_count_duplicates():
    assert tool_name_counts(["a", "a", "b"], ["a", "c"]) == (1, 2, 1)
    assert tool_name_counts(["a", "a"], ["a", "a", "a"]) == (2, 0, 1)
    assert tool_name_counts([], []) == (0, 0, 0)


def test_micro_and_macro_on_hand_numbers():
    # A: P=1/3 R=1/2 F1=0.4 ; B: 1/1/1 ; C: no pred, no gold -> 0/0/0 (zero denominators)
    m = finmcp_metrics([(1, 2, 1), (1, 0, 0), (0, 0, 0)])
    assert m["n"] == 3
    assert m["micro"]["tp"] == 2 and m["micro"]["fp"] == 2 and m["micro"]["fn"] == 1
    assert m["micro"]["precision"] == pytest.approx(0.5)
    assert m["micro"]["recall"] == pytest.approx(2 / 3)
    assert m["micro"]["tf1"] == pytest.approx(4 / 7)
    assert m["macro"]["precision"] == pytest.approx(4 / 9)
    assert m["macro"]["recall"] == pytest.approx(0.5)
    assert m["macro"]["tf1"] == pytest.approx(1.4 / 3)
    assert m["macro"]["tf1"] != pytest.approx(m["micro"]["tf1"])


def test_zero_denominators_give_zero():
    m = finmcp_metrics([(0, 0, 3)])  # predicted nothing: precision 0/0 -> 0
    assert m["micro"] == {"precision": 0.0, "recall": 0.0, "tf1": 0.0, "tp": 0, "fp": 0, "fn": 3}
    m = finmcp_metrics([(0, 2, 0)])  # no gold: recall 0/0 -> 0
    assert (m["micro"]["precision"], m["micro"]["recall"], m["micro"]["tf1"]) == (0.0, 0.0, 0.0)
    assert finmcp_metrics([])["macro"] == {"precision": 0.0, "recall": 0.0, "tf1": 0.0}
    with pytest.raises(EnvaceError):
        finmcp_metrics([(1, -1, 0)])


# ------------------------------------------------------------------------------------------ loading
def test_fixture_loads_with_labels_and_tools(samples):
    assert list(samples) == ["fin-single-1", "fin-multistep-1", "fin-multiturn-1"]
    s1, s2, s3 = samples.values()
    assert (s1.task, s1.diff_level, s1.scenery) == ("single", "easy", "stock quote")
    assert s1.tools_source == "sample" and [t.name for t in s1.tools] == ["get_stock_price", "get_fund_info"]
    # no `tools` field: the union of gold tool names of such samples, permissive schema
    pool = ["calc_period_return", "get_financial_report", "get_fund_info", "get_fund_nav", "get_valuation"]
    assert s2.tools_source == "derived" and [t.name for t in s2.tools] == pool
    assert s2.tools[0].parameters == {"type": "object"}
    assert s2.messages[0]["content"].startswith("Compare")  # content parts joined
    assert s2.gold_names(0) == ["get_valuation", "get_valuation", "get_financial_report"]
    assert s3.user_turns() == [1, 5]
    assert s3.gold_names(0) == ["get_fund_info"] and s3.gold_names(1) == ["get_fund_nav", "calc_period_return"]
    per_sample = {s.id: [t.name for t in s.tools] for s in load_finmcp(FIXTURE, derived_tools="sample")}
    assert per_sample["fin-multistep-1"] == ["get_financial_report", "get_valuation"]


def _write(tmp_path, rec, name="bad.json"):
    p = tmp_path / name
    p.write_text(json.dumps(rec))
    return p


@pytest.mark.parametrize("rec, needle", [
    ({"question": "q", "task": "single"}, "missing field 'messages'"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [{"role": "robot", "content": "q"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "system", "content": "s"}]}, "no user message"),
    ({"messages": [{"role": "user", "content": "q"}], "diff_level": {"x": 1}}, "'diff_level'"),
])
def test_loader_errors_name_file_and_field(tmp_path, rec, needle):
    p = _write(tmp_path, [rec])
    with pytest.raises(EnvaceError) as e:
        load_finmcp(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_loader_reads_directories_jsonl_and_rejects_bad_json(tmp_path):
    ok = {"id": "x", "question": "q", "messages": [{"role": "user", "content": "q"}]}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text(json.dumps(ok) + "\n\n" + json.dumps({**ok, "id": "y"}) + "\n")
    assert [s.id for s in load_finmcp(tmp_path / "d")] == ["x", "y"]
    (tmp_path / "d" / "b.json").write_text(json.dumps(ok))
    with pytest.raises(EnvaceError, match="already used"):
        load_finmcp(tmp_path / "d")
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(EnvaceError, match="c.json: not valid JSON"):
        load_finmcp(tmp_path / "c.json")
    with pytest.raises(EnvaceError, match="does not exist"):
        load_finmcp(tmp_path / "nowhere")
    # question only: it becomes the user turn after the system messages
    s = load_finmcp(_write(tmp_path, {"question": "hi", "messages": [{"role": "system", "content": "s"}]}, "q.json"))[0]
    assert [m["role"] for m in s.messages] == ["system", "user"] and s.messages[1]["content"] == "hi"


# ----------------------------------------------------------------------------------------- decoding
def test_decode_rules(samples):
    tools = samples["fin-single-1"].tools
    d = decode_tool_calls(call("get_stock_price", symbol="1") + "\n" + call("get_fund_info", fund_code="2"), tools)
    assert d.names == ["get_stock_price", "get_fund_info"] and not d.decode_errors and not d.text_outside
    d = decode_tool_calls(call("get_stock_price", symbol="1") + "<tool_call>{bad</tool_call>", tools)
    assert d.names == ["get_stock_price"] and d.decode_errors[0].startswith("MalformedToolCall")
    d = decode_tool_calls("<tool_call>" + json.dumps({"name": "get_stock_price", "arguments": {}}), tools)
    assert d.names == [] and "unclosed" in d.decode_errors[0]  # broken tags: the whole turn fails
    d = decode_tool_calls(call("nope") + call("get_stock_price"), tools)  # unknown tool; missing required arg
    assert d.names == ["nope", "get_stock_price"] and not d.decode_errors
    assert [e.split(":")[0] for e in d.invalid_calls] == ["UnknownTool", "InvalidArguments"]
    assert decode_tool_calls("The price is 10.", tools).names == []
    assert decode_tool_calls("  ", tools).decode_errors[0].startswith("EmptyOutput")
    d = decode_tool_calls("thinking " + call("get_stock_price", symbol="1") * 3, tools, max_calls=2)
    assert d.names == ["get_stock_price"] * 2 and d.over_cap == 1 and d.text_outside


@pytest.mark.parametrize("text, fmt", [
    ('<|python_tag|>{"name": "get_stock_price", "parameters": {"symbol": "1"}}', "llama3"),
    ('[TOOL_CALLS][{"name": "get_stock_price", "arguments": {"symbol": "1"}}]', "mistral"),
    ('get_stock_price(symbol="1")', "pythonic"),
    ('<function=get_stock_price>{"symbol": "1"}</function>', "function"),
])
def test_a_foreign_format_call_is_a_decode_error_not_no_call(samples, text, fmt):
    tools = samples["fin-single-1"].tools
    d = decode_tool_calls(text, tools)
    assert d.names == [] and len(d.decode_errors) == 1
    assert d.decode_errors[0].startswith("ForeignToolCallFormat: ") and fmt in d.decode_errors[0]


# ---------------------------------------------------------------------------------------- evaluation
def test_right_calls_score_one(tok, samples):
    s1, s2, s3 = samples.values()
    r = evaluate_finmcp(ScriptedEngine(tok, [call("get_stock_price", symbol="600519")]), [s1])
    assert r["micro"]["tf1"] == 1.0 and r["micro"]["precision"] == 1.0 and r["n_turns"] == 1
    both = call("get_valuation", symbol="300750") + "\n" + call("get_valuation", symbol="002594") + "\n" + \
        call("get_financial_report", symbols=["300750", "002594"], year=2024)
    r = evaluate_finmcp(ScriptedEngine(tok, [both]), [s2])
    assert (r["micro"]["tp"], r["micro"]["fp"], r["micro"]["fn"]) == (3, 0, 0)
    # turn 2's prompt holds 2 gold assistant messages, so ScriptedEngine answers it with act_texts[2]
    t2 = call("get_fund_nav", fund_code="110011") + call("calc_period_return", fund_code="110011", period="1y")
    r = evaluate_finmcp(ScriptedEngine(tok, [call("get_fund_info", fund_code="110011"), "unused", t2]), [s3])
    assert r["n_turns"] == 2 and r["micro"]["tf1"] == 1.0
    assert [t["pred"] for t in r["samples"][0]["turns"]] == [["get_fund_info"], ["get_fund_nav", "calc_period_return"]]
    assert r["by_task"]["multi turn"]["micro"]["tf1"] == 1.0 and r["by_diff_level"]["hard"]["n"] == 1
    assert r["decode"]["failed_blocks"] == 0 and r["published"]["tf1"] == 46.78


def test_wrong_tool_is_a_false_positive_and_a_miss(tok, samples):
    s1 = samples["fin-single-1"]
    r = evaluate_finmcp(ScriptedEngine(tok, [call("get_fund_info", fund_code="600519")]), [s1])
    assert (r["micro"]["tp"], r["micro"]["fp"], r["micro"]["fn"]) == (0, 1, 1)
    assert r["micro"]["tf1"] == 0.0 and r["decode"]["failed_blocks"] == 0 and r["decode"]["invalid_calls"] == 0
    r = evaluate_finmcp(ScriptedEngine(tok, [call("get_weather", city="x")]), [s1])  # not an offered tool
    assert r["micro"]["fp"] == 1 and r["decode"]["invalid_by_class"] == {"UnknownTool": 1}


def test_garbage_is_a_decode_failure_counted_separately(tok, samples):
    s1, s2 = samples["fin-single-1"], samples["fin-multistep-1"]
    r = evaluate_finmcp(ScriptedEngine(tok, ["<tool_call>{not json</tool_call>"]), [s1, s2])
    assert r["decode"]["failed_blocks"] == 2 and r["decode"]["turns_with_failure"] == 2
    assert r["decode"]["by_class"] == {"MalformedToolCall": 2}
    assert (r["micro"]["tp"], r["micro"]["fp"], r["micro"]["fn"]) == (0, 0, 4)  # predicts no tool
    assert r["samples"][0]["turns"][0]["decode_errors"][0].startswith("MalformedToolCall")
    assert set(r["by_task"]) == {"single", "multi step"}


def test_prompt_has_gold_history_up_to_the_turn_and_nothing_later(tok, samples):
    s3 = samples["fin-multiturn-1"]
    first = json.dumps({"name": "get_fund_info", "arguments": {"fund_code": "110011"}})
    later = json.dumps({"name": "get_fund_nav", "arguments": {"fund_code": "110011"}})
    eng = RecordingEngine(tok, ["plain answer"])
    evaluate_finmcp(eng, [s3])
    p0, p1 = eng.prompts
    assert "Tell me about fund 110011." in p0 and "licensed fund advisor" in p0
    for leak in ("SECOND_TURN_REQUEST", "GOLD_RESULT_TURN1", first, "Let me look it up", "ZHANG Kun.",
                 "GOLD_RESULT_TURN2", later, "Latest NAV"):
        assert leak not in p0
    for shown in ("Tell me about fund 110011.", first, "GOLD_RESULT_TURN1", "managed by ZHANG Kun",
                  "SECOND_TURN_REQUEST", "licensed fund advisor"):
        assert shown in p1
    for leak in ("GOLD_RESULT_TURN2", later, "Latest NAV 5.8312"):
        assert leak not in p1
    assert p1.rstrip().endswith("<|im_start|>assistant")
    # the chat structure: system, user, assistant (call), tool, assistant, user
    msgs = prompt_messages(s3, 1)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert msgs[2]["content"] == "Let me look it up.\n<tool_call>" + first + "</tool_call>"
    with pytest.raises(EnvaceError, match="turn 2 does not exist"):
        prompt_messages(s3, 2)


def test_real_engine_end_to_end_with_a_tiny_model(tiny_model_dir, samples):
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    engine = HFEngine(load_model(tiny_model_dir), tok, compute_dtype="float32", max_batch_size=4)
    r = evaluate_finmcp(engine, list(samples.values()), max_new_tokens=6, batch_size=3)
    assert r["n_samples"] == 3 and r["n_turns"] == 4
    assert r["micro"]["tp"] + r["micro"]["fn"] == 7  # every gold call is either found or missed
    assert all(len(s["turns"]) == n for s, n in zip(r["samples"], (1, 1, 2)))
    assert r["decode"]["truncated_turns"] <= 4 and 0.0 <= r["micro"]["tf1"] <= 1.0
