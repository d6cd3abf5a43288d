"""benchmarks/heap_trim.py: per-condition child runs, resumed from the report, a failed child records nothing."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from tests.benchmark_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
ht = load_benchmark("heap_trim")


def _record(cond: str, peak: float) -> str:
    it = {"iteration": 1, "seconds": 10.0, "rss_at_rollouts_gib": 2.0, "rollouts_peak_gib": peak,
          "update_peak_gib": 3.0}
    return json.dumps({"condition": cond, "iterations": [it], "peak_rss_gib": peak, "setup_peak_gib": 1.0,
                       "load_average": [0.1, 0.2]})


def test_each_condition_runs_once_and_a_rerun_reuses_the_report(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(cmd, **kw):
        cond = cmd[cmd.index("--child") + 1]
        calls.append(cond)
        return types.SimpleNamespace(returncode=0, stdout="log line\n" + _record(cond, 4.0 if cond == "trim" else 5.0),
                                     stderr="")

    monkeypatch.setattr(ht.subprocess, "run", fake_run)
    out = tmp_path / "heap.json"
    args = ["--dataset", "d", "--iterations", "1", "--json", str(out)]
    assert ht.main(args) == 0
    assert calls == ["no-trim", "trim"]
    report = json.loads(out.read_text())
    assert report["conditions"]["trim"]["peak_rss_gib"] == 4.0
    assert "| trim | 1 | 10 | 2.00 | 4.00 | 3.00 | 4.00 |" in capsys.readouterr().out
    assert ht.main(args) == 0 and calls == ["no-trim", "trim"]  # both reused
    assert ht.main(["--dataset", "d", "--iterations", "2", "--json", str(out)]) == 0  # another setting
    assert calls == ["no-trim", "trim", "no-trim", "trim"] and json.loads(out.read_text())["iterations"] == 2


def test_a_failed_child_records_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ht.subprocess, "run",
                        lambda cmd, **kw: types.SimpleNamespace(returncode=3, stdout="", stderr="Traceback: boom"))
    out = tmp_path / "heap.json"
    assert ht.main(["--dataset", "d", "--conditions", "trim", "--json", str(out)]) == 1
    assert not out.exists()
    assert "exit 3" in capsys.readouterr().err


def test_unknown_condition_and_zero_iterations_are_refused():
    with pytest.raises(SystemExit):
        ht.main(["--dataset", "d", "--conditions", "fast"])
    with pytest.raises(SystemExit):
        ht.main(["--dataset", "d", "--iterations", "0"])
