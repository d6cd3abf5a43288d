"""benchmarks/rehearsal_error_flag.py: each rehearsal's first call replayed in the real environment, its real
error flag against the imagined one, for all rehearsals and the verifier's kept ones; bad input named."""

from __future__ import annotations

import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.envs.tau2.synth import synthesize
from envace_core.stages.dataset import task_record
from tests.benchmark_loader import load_benchmark

ef = load_benchmark("rehearsal_error_flag")


def test_real_and_imagined_error_flags_are_counted(tmp_path):
    task = next(t for t in synthesize("retail", 6, levels=[1], seed=0) if t.gold_actions[0].name == "find_user_id_by_email")
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps([task_record(task)]))
    gold = {"name": task.gold_actions[0].name, "arguments": task.gold_actions[0].arguments}
    wrong = {"name": "find_user_id_by_email", "arguments": {"email": "nobody@example.com"}}

    def rehearsal(call, error, rejected):
        return {"rejected": rejected, "steps": [{"call": call, "error": error, "observation": '{"error": "x"}'}]}

    ep = {"task_id": task.id, "trace": {"rounds": [{"turn": 0, "rehearsals": [
        rehearsal(gold, True, False),   # a real success imagined as an error, kept
        rehearsal(gold, False, True),   # a real success imagined as one, rejected
        rehearsal(wrong, True, True),   # a real error imagined as one, rejected
        {"rejected": True, "steps": [{"call": gold, "error": False, "observation": None}]},  # no imagined response
    ]}]}}
    cache = tmp_path / "cell"
    cache.mkdir()
    (cache / "episodes.jsonl").write_text(json.dumps(ep) + "\n")
    res = ef.measure(str(tasks), {"c": str(cache)})["c"]
    assert res["all"]["real_success"] == {"n": 2, "imagined_error": 1, "rate": 0.5}
    assert res["all"]["real_error"] == {"n": 1, "imagined_error": 1, "rate": 1.0}
    assert res["kept"]["real_success"]["n"] == 1 and res["kept"]["real_error"] == {"n": 0, "imagined_error": 0,
                                                                                     "rate": None}
    assert "| c | all | 1 of 2 (0.50) | 1 of 1 (1.00) |" in ef.table({"c": res})
    with pytest.raises(ef.EnvaceError, match="does not exist"):
        ef.measure(str(tasks), {"c": str(tmp_path / "nope")})
    other = tmp_path / "other.json"
    other.write_text("[]")
    with pytest.raises(ef.EnvaceError, match="is not in"):
        ef.measure(str(other), {"c": str(cache)})
