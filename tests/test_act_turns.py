"""benchmarks/act_turns.py: every teacher-forced ACT turn of a held-out task, classified against its target
(gold call or final answer), with the repeat of the previous call told apart; cached per task."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.config import load_config
from envace_core.envs.tau2.synth import gold_answer, synthesize
from envace_core.roles.tools import format_tool_call
from envace_core.stages.dataset import task_record
from tests.benchmark_loader import load_benchmark

from .scripted import ScriptedEngine

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
at = load_benchmark("act_turns")

F = {"name": "get_user_details", "arguments": {"user_id": "u1"}}
G = {"name": "get_reservation_details", "arguments": {"reservation_id": "ABC123"}}


def test_outcomes_of_a_call_turn():
    assert at.classify(G, F, G, None, None, []) == "exact"
    assert at.classify(G, F, F, None, None, []) == "repeat"
    assert at.classify(G, None, {"name": G["name"], "arguments": {"reservation_id": "X"}}, None, None, []) \
        == "right_tool_wrong_args"
    assert at.classify(G, None, F, None, None, []) == "other_tool"
    assert at.classify(G, F, None, "Sure.", None, []) == "message"
    assert at.classify(G, F, None, None, "ParseError: x", []) == "parse_error"


def test_outcomes_of_the_answer_turn():
    items = ["HAT001", "economy"]
    assert at.classify(None, G, None, "Your flight HAT001 is in Economy.", None, items) == "answer"
    assert at.classify(None, G, None, "Your flight is HAT001.", None, items) == "message"
    assert at.classify(None, G, None, "Done.", None, []) == "answer"
    assert at.classify(None, G, G, None, None, items) == "repeat"
    assert at.classify(None, G, F, None, None, items) == "other_tool"


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


def test_a_model_that_repeats_its_look_up_is_counted_at_the_answer_turn(tok, tmp_path):
    """A level-1 task: turn 0 is the look-up (exact), turn 1 the answer, where the scripted model repeats
    the look-up; the cache holds both turns and a rerun loads them without the engine."""
    task = synthesize("airline", 1, levels=[1], seed=0)[0]
    look_up = task.gold_actions[0]
    cfg = load_config("cpu-smoke")
    engine = ScriptedEngine(tok, [format_tool_call(look_up)])
    cache = tmp_path / "m.jsonl"
    recs = at.run_model(cfg, lambda: engine, [task], cache, log=lambda *_: None)
    assert [(r["kind"], r["outcome"]) for r in recs] == [("first_call", "exact"), ("answer", "repeat")]
    assert len(cache.read_text().splitlines()) == 2
    again = at.run_model(cfg, lambda: pytest.fail("the cache was not used"), [task], cache)
    assert again == recs
    s = at.summarize(recs, n_boot=100, seed=0)
    assert s["answer"]["repeat"]["mean"] == 1.0 and s["first_call"]["exact"]["mean"] == 1.0
    assert "| m | answer | 1 |" in at.markdown({"models": {"m": {"summary": s}}})

    answering = ScriptedEngine(tok, [format_tool_call(look_up), gold_answer(task)])
    recs = at.run_model(cfg, lambda: answering, [task], tmp_path / "a.jsonl", log=lambda *_: None)
    assert [r["outcome"] for r in recs] == ["exact", "answer"]


def test_paired_differences_match_turns_and_subtract_the_first_model():
    """`paired`: the second model minus the first on the same (task, turn); a turn only one model measured is
    left out, and one model gives no comparison."""
    def rec(task, turn, kind, outcome):
        return {"task_id": task, "turn": turn, "kind": kind, "outcome": outcome, "level": 1}

    ref = [rec("t1", 0, "first_call", "other_tool"), rec("t1", 1, "answer", "repeat"),
           rec("t2", 0, "first_call", "exact"), rec("t2", 1, "answer", "answer")]
    new = [rec("t1", 0, "first_call", "exact"), rec("t1", 1, "answer", "answer"),
           rec("t2", 0, "first_call", "exact"), rec("t3", 0, "first_call", "exact")]
    d = at.paired({"ref": ref, "new": new}, n_boot=200, seed=0)
    assert d["reference"] == "ref"
    assert d["new"]["first_call"]["n"] == 2 and d["new"]["first_call"]["exact"]["mean"] == 0.5
    assert d["new"]["answer"]["n"] == 1 and d["new"]["answer"]["answer"]["mean"] == 1.0
    assert d["new"]["answer"]["repeat"]["mean"] == -1.0
    assert at.paired({"ref": ref}, n_boot=200, seed=0) == {}
    table = at.markdown({"models": {}, "paired": d})
    assert "| new − ref (paired) | first_call | 2 | +0.50" in table


def test_bad_arguments_stop_before_any_model_loads(tmp_path, monkeypatch):
    import envace_core.training.policy as policy

    monkeypatch.setattr(policy, "load_engine", lambda *a, **k: pytest.fail("a model was loaded"))
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps([task_record(synthesize("airline", 1, levels=[1], seed=0)[0])]))
    base = ["--tasks", str(tasks), "--out", str(tmp_path / "o"), "--json", str(tmp_path / "r.json")]
    ok = "x=bundled:smollm2-135m-instruct"
    for argv, msg in [(["--models", "a/b=bundled:smollm2-135m-instruct"], "labels name cache files"),
                      (["--models", ok, "--limit", "0"], "--limit must be >= 1"),
                      (["--models", ok + ",y=" + str(tmp_path / "nothere")], "no such file|not found"),
                      (["--models", ok, "--json", str(tmp_path)], "is a folder"),
                      (["--models", ok, "--json", str(tasks)], "is the --tasks file"),
                      (["--models", ok, "--json", str(tmp_path / "o")], "or a folder above it")]:
        with pytest.raises(Exception, match=msg):
            at.main(base + argv if "--json" not in argv else base[:4] + argv)
    record = json.loads(tasks.read_text())[0]
    for name, records, msg in [("dup.json", [record, record], "task ids repeat"),
                               ("dom.json", [{**record, "domain": "nowhere"}], "nowhere")]:
        (tmp_path / name).write_text(json.dumps(records))
        with pytest.raises(Exception, match=msg):
            at.main(["--tasks", str(tmp_path / name)] + base[2:] + ["--models", ok])


def test_a_corrupt_or_folder_cache_is_named(tmp_path):
    for text in ("not json", "{}", "[1]"):
        (tmp_path / "c.jsonl").write_text(text + "\n")
        with pytest.raises(at.BenchmarkError, match="line 1 is not a turn record"):
            at.read_cache(tmp_path / "c.jsonl")
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(at.BenchmarkError, match="is a folder"):
        at.read_cache(tmp_path / "d.jsonl")
    assert at.read_cache(tmp_path / "missing.jsonl") == {}
