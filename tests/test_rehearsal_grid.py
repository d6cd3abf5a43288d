"""benchmarks/rehearsal_grid.py without a model: the time budget stops a call between chunks, the next call
resumes from the saved state without rerunning an item, a chunk that raises blocks only its cell (and is
reported as skipped), an isolation failure stops the call, vLLM loads one model per call, a saved grid with
other settings is refused, and a `run_eval` result is read into a chunk's result."""

from __future__ import annotations

import argparse
import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from tests.benchmark_loader import load_benchmark

grid = load_benchmark("rehearsal_grid", register=True)  # dataclasses look their module up by name

SETTINGS = {"protocol": "tau2_orchestrator", "max_steps": 30, "seed": 0, "profile": "cpu-smoke", "overrides": "",
            "engine": "hf", "user": "policy"}
TOTALS = {"tau2:airline": 3, "bfcl:multi_turn_base": 5}
BENCHES = list(TOTALS)


class FakeHarness:
    """A clock and a per-item "cache": a chunk runs only the items not cached yet, 10 s each."""

    def __init__(self, fail=None, per_item_s=10.0, load_s=5.0):
        self.now, self.cache, self.runs, self.loads = 0.0, {}, [], []
        self.fail, self.per_item_s, self.load_s = fail or (lambda *a: None), per_item_s, load_s

    def clock(self) -> float:
        return self.now

    def load(self, label, ref):
        self.loads.append(label)
        self.now += self.load_s
        return label

    def run_chunk(self, handle, ref, cell, bench, limit):
        self.fail(handle, cell, bench, limit)
        have = self.cache.setdefault((handle, cell.label, bench), set())
        new = [i for i in range(limit) if i not in have]
        self.runs += [(handle, cell.label, bench, i) for i in new]
        have.update(new)
        self.now += self.per_item_s * len(new)
        outcomes = {f"{bench}/{i}": float((i + (cell.verifier is True)) % 2) for i in range(limit)}
        return {"done": limit, "outcomes": outcomes, "unscored": [], "errors": {}, "rehearsals": 2 * limit,
                "rejected": 1 if cell.verifier else 0, "real_calls_in_rehearsal": 0, "isolation_checked": 0,
                "ran": len(new), "seconds": self.per_item_s * len(new)}


def _args(out, budget, engine="hf", **kw):
    return argparse.Namespace(out=str(out), time_budget=budget, engine=engine, limit=None, retry_blocked=False, **kw)


def _call(fake, out, budget, models=(("a", "ref-a"),), engine="hf", settings=None, totals=TOTALS):
    fake.now = 0.0
    cells = grid.grid_cells(["none", "parallel:2"], [True, False])
    return grid.run_grid(_args(out, budget, engine), list(models), cells, BENCHES, totals,
                         {**SETTINGS, "engine": engine, **(settings or {})}, load=fake.load,
                         run_chunk=fake.run_chunk, clock=fake.clock, t0=0.0, log=lambda s: None)


def test_budget_stops_between_chunks_and_the_next_call_resumes(tmp_path):
    fake = FakeHarness()
    code, state = _call(fake, tmp_path, budget=65)
    assert code == grid.EXIT_MORE
    # load 5 s, then item-major over none, parallel:2, parallel:2/no-verifier: 6 tau2 items of 10 s end at 65 s
    assert [(r[1], r[3]) for r in fake.runs] == [("none", 0), ("parallel:2", 0), ("parallel:2/no-verifier", 0),
                                                 ("none", 1), ("parallel:2", 1), ("parallel:2/no-verifier", 1)]
    assert fake.now <= 65
    saved = json.loads((tmp_path / grid.STATE_FILE).read_text())
    assert {k: c["done"] for k, c in saved["cells"].items()} == {
        "a|tau2:airline|none": 2, "a|tau2:airline|parallel:2": 2, "a|tau2:airline|parallel:2/no-verifier": 2}
    assert "would end past the time budget" in saved["runs"][-1]["stopped"]
    # 18 items left at the slowest 10 s per item seen (bfcl, never timed, borrows tau2's)
    assert saved["runs"][-1]["remaining"] == {"items": 3 * 3 + 3 * 5 - 6, "skipped_items": 0, "seconds": 180.0}

    # a bench never timed borrows the slowest per-item time seen: its first chunk (4 x 10 s) is not started
    # with 5 s left
    other = FakeHarness()
    code, _ = _call(other, tmp_path / "other", budget=100)
    assert code == grid.EXIT_MORE and len(other.runs) == 9 and other.now == 95
    assert "bfcl:multi_turn_base none items 1-4, ~40 s" in json.loads(
        (tmp_path / "other" / grid.STATE_FILE).read_text())["runs"][-1]["stopped"]

    code, state = _call(fake, tmp_path, budget=None)
    assert code == grid.EXIT_DONE
    assert len(fake.runs) == len(set(fake.runs)) == 3 * 3 + 3 * 5  # every item once over both calls
    assert fake.runs[6][1:] == ("none", "tau2:airline", 2)  # resumed at the first item not done
    rep = grid.report(state, n_boot=200)
    assert rep["complete"] and rep["skipped"] == [] and rep["remaining"]["items"] == 0
    cell = next(c for c in rep["cells"] if c["bench"] == "bfcl:multi_turn_base" and c["condition"] == "parallel:2")
    assert cell["success"]["n"] == 5 and cell["per_episode_s"] == 10.0 and cell["done"] == cell["total"] == 5
    # none and /no-verifier: items 1, 3 succeed (0.4); parallel:2 (verifier on): items 0, 2, 4 (0.6)
    assert cell["success"]["mean"] == pytest.approx(0.6) and cell["diff_vs_none"]["mean"] == pytest.approx(0.2)
    nv = next(c for c in rep["cells"] if c["bench"] == "bfcl:multi_turn_base" and c["condition"].endswith("verifier"))
    assert nv["diff_vs_none"]["mean"] == 0.0 and nv["diff_vs_none"]["ci95"] == [0.0, 0.0]
    assert rep["by_model"]["a"]["tau2:airline"]["parallel:2"]["rejected"] == 1
    assert set(rep["by_model"]["a"]["tau2:airline"]) == {"none", "parallel:2", "parallel:2/no-verifier"}
    assert "| a | tau2:airline | parallel:2/no-verifier | 3/3 | 3 |" in grid.markdown(rep)


def test_a_chunk_that_raises_blocks_only_its_cell_and_is_reported(tmp_path):
    attempts = []

    def fail(handle, cell, bench, limit):
        if bench == "bfcl:multi_turn_base" and cell.label == "parallel:2" and limit > 4:
            attempts.append(limit)
            raise ValueError("The decoder prompt (length 9000) is longer than the maximum model length of 8192")

    totals = {"tau2:airline": 3, "bfcl:multi_turn_base": 9}  # bfcl chunks end at items 4, 8, 9
    fake = FakeHarness(fail=fail)
    code, state = _call(fake, tmp_path, budget=None, totals=totals)
    assert code == grid.EXIT_DONE  # nothing left to run: the rest of the blocked cell is skipped, not pending
    assert attempts == [8]  # blocked at its chunk 5-8; chunk 9 is not tried
    c = state["cells"]["a|bfcl:multi_turn_base|parallel:2"]
    assert c["done"] == 4 and c["blocked"].startswith("items 5-8: ValueError: The decoder prompt")
    assert state["cells"]["a|bfcl:multi_turn_base|parallel:2/no-verifier"]["done"] == 9
    rep = grid.report(state, n_boot=200)
    assert rep["remaining"] == {"items": 0, "skipped_items": 5, "seconds": 0.0}
    assert any("parallel:2: items 5-9 not run" in s and "maximum model length" in s for s in rep["skipped"])
    by = {c["condition"]: c for c in rep["cells"] if c["bench"] == "bfcl:multi_turn_base"}
    assert by["none"]["success"]["n"] == 9 and by["parallel:2"]["success"]["n"] == 4  # unblocked cells pair on 9
    assert by["parallel:2"]["left_out_of_pairing"] == []
    assert "| a | bfcl:multi_turn_base | parallel:2 | 4/9 blocked | 4 |" in grid.markdown(rep)
    assert "5 skipped by blocked cells" in grid.summary_text(rep)

    fake.fail = lambda *a: None  # --retry-blocked runs the rest of it
    code, state = grid.run_grid(_retry(tmp_path), [("a", "ref-a")],
                                grid.grid_cells(["none", "parallel:2"], [True, False]), BENCHES, totals, SETTINGS,
                                load=fake.load, run_chunk=fake.run_chunk, clock=fake.clock, t0=0.0, log=lambda s: None)
    assert state["cells"]["a|bfcl:multi_turn_base|parallel:2"]["done"] == 9
    assert [r[3] for r in fake.runs if r[1:3] == ("parallel:2", "bfcl:multi_turn_base")] == list(range(9))


def _retry(out):
    a = _args(out, None)
    a.retry_blocked = True
    return a


def test_isolation_error_stops_the_call(tmp_path):
    from envace_core.rehearsal.agent import IsolationError

    def fail(handle, cell, bench, limit):
        if cell.condition != "none":
            raise IsolationError("rehearsal changed the real environment: (0, 'x') -> (1, 'y')")

    with pytest.raises(IsolationError):
        _call(FakeHarness(fail=fail), tmp_path, budget=None)
    assert json.loads((tmp_path / grid.STATE_FILE).read_text())["cells"]["a|tau2:airline|none"]["done"] == 1


def test_vllm_loads_one_model_per_call_and_other_settings_are_refused(tmp_path):
    fake = FakeHarness()
    models = (("warm_start", "w"), ("trained", "t"))
    code, state = _call(fake, tmp_path, budget=None, models=models, engine="vllm")
    assert code == grid.EXIT_MORE and fake.loads == ["warm_start"]
    assert "one model is loaded per call" in state["runs"][-1]["stopped"]
    code, state = _call(fake, tmp_path, budget=None, models=models, engine="vllm")
    assert code == grid.EXIT_DONE and fake.loads == ["warm_start", "trained"]  # the finished model is not reloaded
    with pytest.raises(grid.GridError, match=r"max_steps: 30 there, 8 here"):
        _call(fake, tmp_path, budget=None, models=models, engine="vllm", settings={"max_steps": 8})
    with pytest.raises(grid.GridError, match=r"model trained: 't' there, 'other' here"):
        _call(fake, tmp_path, budget=None, models=(("trained", "other"),), engine="vllm")
    # a model load that would end past the budget is not started
    grid.save_state(tmp_path / "c", {"cells": {}, "loads": {"warm_start": 100.0}, "settings": SETTINGS})
    fake2 = FakeHarness()
    code, state = _call(fake2, tmp_path / "c", budget=50, models=models)
    assert code == grid.EXIT_MORE and fake2.loads == [] and "loading model warm_start" in state["runs"][-1]["stopped"]


def test_cells_overrides_and_verifier_option():
    cells = grid.grid_cells(["none", "parallel:4", "sequential:2"], [True, False])
    assert [c.label for c in cells] == ["none", "parallel:4", "parallel:4/no-verifier", "sequential:2",
                                        "sequential:2/no-verifier"]
    assert grid.parse_verifier("off") == [False] and grid.parse_verifier("on, off,on") == [True, False]
    with pytest.raises(grid.GridError, match="--verifier"):
        grid.parse_verifier("maybe")
    base = {"eval": {"max_turns": 5}}
    on = grid.cell_overrides(base, "vllm", True, default_verifier=True)
    assert json.loads(on) == {"eval": {"max_turns": 5}, "rollout": {"engine": "vllm"}}
    assert json.loads(grid.cell_overrides(base, "vllm", False, True))["rehearsal"] == {"verifier": False}
    assert grid.cell_overrides(base, "vllm", None, True) == on  # none: the same setting as verifier on
    assert json.loads(grid.cell_overrides({}, "hf", True, default_verifier=False))["rehearsal"] == {"verifier": True}
    assert grid.chunk_step("tau2:retail") == 1 and grid.chunk_step("bfcl:multi_turn_base") == 4


def test_chunk_result_reads_a_run_eval_result():
    tau2 = {"benches": [{"bench": "tau2", "name": "airline", "results": [
        {"task_id": "airline/1", "success": 1.0, "agent_stats": {"rehearsals": 2, "rejected": 1},
         "isolation": {"real_calls_during_rehearsal": 0}, "error": None},
        {"task_id": "airline/2", "success": None, "agent_stats": {}, "isolation": None, "error": None},
        {"task_id": "airline/3", "success": 0.0, "agent_stats": {"rehearsals": 2}, "isolation": None,
         "error": "ValueError: prompt too long\nTraceback ..."}]}],
        "work": {"tau2:airline": {"ran": 1, "cached": 2}}, "seconds": {"load": 0.0, "tau2:airline": 7.5}}
    r = grid.chunk_result(tau2, "tau2:airline")
    assert r["done"] == 3 and r["outcomes"] == {"airline/1": 1.0, "airline/3": 0.0}
    assert r["unscored"] == ["airline/2"] and r["errors"] == {"airline/3": "ValueError: prompt too long"}
    assert (r["rehearsals"], r["rejected"], r["real_calls_in_rehearsal"], r["isolation_checked"]) == (4, 1, 0, 1)
    assert (r["ran"], r["seconds"]) == (1, 7.5)
    bfcl = {"benches": [{"bench": "bfcl", "name": "bfcl", "report": {"categories": {"multi_turn_base": {"entries": [
        {"id": "multi_turn_base_0", "valid": True, "rehearsal": {"rehearsals": 4, "rejected": 2,
                                                                 "real_calls_during_rehearsal": 0}}]}}}}],
        "work": {}, "seconds": {}}
    r = grid.chunk_result(bfcl, "bfcl:multi_turn_base")
    assert r["done"] == 1 and r["outcomes"] == {"multi_turn_base_0": 1.0} and r["ran"] == 0
    assert (r["rehearsals"], r["rejected"], r["isolation_checked"]) == (4, 2, 1)


def test_bad_arguments_stop_before_any_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(grid, "run_grid", lambda *a, **k: pytest.fail("ran despite bad arguments"))
    m = ["--models", "base=bundled:smollm2-135m-instruct", "--engine", "hf", "--out", str(tmp_path / "g")]
    for argv, msg in (([*m, "--verifier", "maybe"], "--verifier"), ([*m, "--time-budget", "-1"], "--time-budget"),
                      ([*m, "--user", "bundled:smollm2-135m-instruct"], "loaded again for every chunk"),
                      ([*m, "--conditions", "parallel:2"], "include none"), (["--engine", "hf"], "no model"),
                      (["--report", "--out", str(tmp_path / "none")], "no grid has run there")):
        assert grid.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, (argv, err)
    grid.save_state(tmp_path / "g", {"cells": {}, "settings": {**SETTINGS, "max_steps": 8}})
    assert grid.main(m) == 2
    assert "max_steps: 8 there, 30 here" in capsys.readouterr().err
