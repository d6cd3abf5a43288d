"""benchmarks/prefill_reuse.py end to end on the tiny random Llama with --quick sizes (plumbing and JSON, not
speed): both variants in their own processes, the before tree from a git worktree that is removed after."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.benchmark_loader import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_benchmark("prefill_reuse")


def _worktrees() -> list[str]:
    """This benchmark's worktrees (its temporary folder's prefix): the other benchmark's test, running beside this
    one under pytest-xdist, adds and removes its own."""
    out = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "envace-prefill-reuse-" in line]


def test_quick_run_writes_both_variants_and_removes_its_worktree(tiny_model_dir, tmp_path, capsys):
    before = _worktrees()
    out = tmp_path / "reuse.json"
    assert _bench().main(["--before", "HEAD", "--quick", "--model", str(tiny_model_dir), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["summary"]) == {"1x16", "4x16"}
    for case, row in rep["summary"].items():
        rows = int(case.split("x")[0])
        assert row["after_over_before"] == pytest.approx(row["after"]["seconds"] / row["before"]["seconds"])
        for v in ("before", "after"):
            assert row[v]["seconds"] > 0 and row[v]["minor_faults"] >= 0
            calls = rep["runs"][v][0]["cases"][case]["calls"]
            prompt = rep["runs"][v][0]["prompt_tokens"]
            assert len(calls) == 2 and all(c["reused_tokens"] >= rows * prompt for c in calls)
    assert rep["details"]["before"] == "HEAD" and rep["details"]["spec"]["tails"] == [16]
    assert "| 1x16 |" in capsys.readouterr().out
    assert _worktrees() == before


@pytest.mark.parametrize(("argv", "msg"), [(["--tails", "a,b"], "--tails must be comma-separated integers"),
                                           (["--tails", "0"], "--tails must hold counts >= 1"),
                                           (["--calls", "0"], "--calls must be >= 1"),
                                           (["--pool-tokens", "100"], "--pool-tokens must hold"),
                                           (["--before", "no-such-rev-xyz"], "--before: not a git revision"),
                                           (["--model", "/nonexistent/model"], "--model: '/nonexistent/model' is not"),
                                           (["--before", ""], "--before is empty"),
                                           (["--json", ""], "--json: is empty"),
                                           (["--json", "/"], "is a folder")])
def test_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_a_relative_model_path_is_the_callers(tiny_model_dir, tmp_path, monkeypatch):
    """The workers run from the checkout's root; a --model relative to where the user stands still loads."""
    monkeypatch.chdir(tiny_model_dir.parent)
    out = tmp_path / "rel.json"
    assert _bench().main(["--quick", "--model", tiny_model_dir.name, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["details"]["spec"]["model"] == os.path.abspath(tiny_model_dir)
