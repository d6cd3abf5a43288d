"""benchmarks/first_call.py: the first ACT turn's classification against the gold first action (exact,
right tool with other arguments and the copy-error flag, other tool, message, parse error), the
`grounded` flag, and the per-level summary."""

from __future__ import annotations

import sys
from pathlib import Path

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.types import ToolCall
from tests.benchmark_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
fc = load_benchmark("first_call")

REQUEST = "You want the flight numbers in your reservation HYRRPC.\n\nYour user id is fatima_johansson_1766."
GOLD = {"name": "get_reservation_details", "arguments": {"reservation_id": "HYRRPC"}}


def test_exact_call_is_exact_and_grounded():
    r = fc.classify(GOLD, ToolCall(name="get_reservation_details", arguments={"reservation_id": "HYRRPC"}), None,
                    REQUEST)
    assert r["outcome"] == "exact" and r["grounded"] and not r["copy_error"]


def test_a_merged_id_is_a_copy_error_and_not_grounded():
    # what the warm start wrote: the reservation id with the user id's digits appended
    r = fc.classify(GOLD, ToolCall(name="get_reservation_details", arguments={"reservation_id": "HYRRPC1766"}),
                    None, REQUEST)
    assert r["outcome"] == "right_tool_wrong_args" and r["copy_error"] and not r["grounded"]


def test_other_tool_with_copied_arguments_is_grounded():
    r = fc.classify(GOLD, ToolCall(name="get_user_details", arguments={"user_id": "fatima_johansson_1766"}), None,
                    REQUEST)
    assert r["outcome"] == "other_tool" and r["grounded"]
    made_up = fc.classify(GOLD, ToolCall(name="get_user_details", arguments={"user_id": "sara_doe_496"}), None,
                          REQUEST)
    assert not made_up["grounded"]


def test_no_call_is_message_or_parse_error():
    assert fc.classify(GOLD, None, "agent_message", REQUEST)["outcome"] == "message"
    assert fc.classify(GOLD, None, "parse_error", REQUEST)["outcome"] == "parse_error"
    assert fc.classify(GOLD, None, "prompt_too_long", REQUEST)["outcome"] == "other"


def test_summary_rates_per_level():
    recs = [{"outcome": "exact", "copy_error": False, "grounded": True, "level": 1, "domain": "airline"},
            {"outcome": "other_tool", "copy_error": False, "grounded": False, "level": 1, "domain": "retail"},
            {"outcome": "parse_error", "copy_error": False, "grounded": False, "level": 2, "domain": "retail"}]
    s = fc.summarize(recs, n_boot=200, seed=0)
    assert s["all"]["n"] == 3 and abs(s["all"]["exact"]["mean"] - 1 / 3) < 1e-9
    assert s["by_level"]["1"]["grounded"]["mean"] == 0.5 and s["by_level"]["2"]["parse_error"]["mean"] == 1.0
    assert s["by_domain"]["retail"]["n"] == 2 and s["by_domain"]["airline"]["exact"]["mean"] == 1.0
    table = fc.markdown({"models": {"warm": s}})
    assert "| warm | all | 3 |" in table and "| warm | level 2 | 1 |" in table and "| warm | retail | 2 |" in table


def test_task_files_that_are_not_task_lists_are_named(tmp_path):
    import json

    import pytest

    cases = {"bad.json": "{not json", "empty.json": "[]", "object.json": '{"id": 1}', "norecord.json": '["x"]',
             "nogold.json": json.dumps([{"id": "airline/t", "domain": "airline", "split": "heldout",
                                         "first_user_message": "hi", "user_scenario": "{}", "gold_actions": "[]",
                                         "source": "{}"}])}
    want = {"bad.json": "not a readable JSON file", "empty.json": "non-empty JSON list",
            "object.json": "non-empty JSON list", "norecord.json": "record 0 is not a task record",
            "nogold.json": "has no gold action"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(fc.BenchmarkError, match=want[name]):
            fc.load_tasks_file(str(tmp_path / name))
    with pytest.raises(fc.BenchmarkError, match="no such file"):
        fc.load_tasks_file(str(tmp_path / "missing.json"))


def test_bad_arguments_stop_before_any_model_loads(tmp_path, monkeypatch):
    import json

    import pytest

    import envace_core.training.policy as policy

    monkeypatch.setattr(policy, "load_engine", lambda *a, **k: pytest.fail("a model was loaded"))
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps([{"id": "airline/t1", "domain": "airline", "split": "heldout",
                                  "first_user_message": "My user id is u1.", "user_scenario": "{}",
                                  "gold_actions": json.dumps([{"name": "get_user_details", "id": "g0",
                                                               "arguments": {"user_id": "u1"}}]),
                                  "source": "{}"}]))
    base = ["--tasks", str(tasks), "--out", str(tmp_path / "o"), "--json", str(tmp_path / "r.json")]
    ok = "x=bundled:smollm2-135m-instruct"
    for argv, msg in [(["--models", "a/b=bundled:smollm2-135m-instruct"], "labels name cache files"),
                      (["--models", ok, "--limit", "0"], "--limit must be >= 1"),
                      (["--models", ok, "--n-boot", "0"], "--n-boot must be >= 1"),
                      (["--models", ok + ",y=" + str(tmp_path / "nothere")], f"--models y '{tmp_path / 'nothere'}': "),
                      (["--models", ok, "--json", str(tmp_path)], "is a folder"),
                      (["--models", ok, "--json", str(tasks)], "is the --tasks file"),
                      (["--models", ok, "--json", ""], "--json is empty"),
                      (["--models", ok, "--out", "", "--json", str(tmp_path / "r.json")], "--out is empty"),
                      (["--models", ok, "--tasks", str(tmp_path)], "a folder; give the JSON task file")]:
        with pytest.raises(Exception, match=msg):
            fc.main([x for k, v in zip(base[::2], base[1::2]) if k not in argv for x in (k, v)] + argv)
