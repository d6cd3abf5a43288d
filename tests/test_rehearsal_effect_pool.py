"""benchmarks/rehearsal_effect_pool.py on hand-made held-out reports: the pooled estimate over seeds (tasks
averaged over seeds, bootstrap over tasks), and every report set that does not measure one thing refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_loader import load_benchmark

pool_bench = load_benchmark("rehearsal_effect_pool")
TASKS = [f"airline/t{i}" for i in range(6)]


def _cell(outcomes: list[float], complete: bool = True, sec: float = 2.0, made: int = 0) -> dict:
    return {"outcomes": dict(zip(TASKS, outcomes)), "complete": complete, "n_run": len(outcomes),
            "seconds_per_episode": sec, "seconds_timed_episodes": len(outcomes), "rehearsals_made": made,
            "rehearsals_rejected": made // 2, "real_calls_in_rehearsal": 0}


def _report(tmp: Path, name: str, seed: int, none: list[float], cond: dict[str, dict], **run) -> str:
    rep = {"run": {"seed": seed, "task_ids": TASKS, "heldout_file": "h.json", "dataset": "d", "synth_seed": 1,
                   "levels": [1, 2, 3], "protocol": "opening_request", "profile": "cpu-smoke", "overrides": "",
                   "models": {"m": {"ref": "/x/adapter"}}, **run},
           "m": {"none": _cell(none), **cond}}
    path = tmp / name
    path.write_text(json.dumps(rep))
    return str(path)


def test_pooled_over_two_seeds(tmp_path):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0], sec=4.0, made=8)})
    b = _report(tmp_path, "b.json", 1, [1, 0, 1, 1, 0, 0], {"parallel:4": _cell([1, 1, 1, 0, 1, 1], sec=6.0, made=4)})
    block = pool_bench.pool({a: pool_bench.load_report(a), b: pool_bench.load_report(b)}, n_boot=500)
    p4 = block["m"]["parallel:4"]
    # per task (cond - none) averaged over seeds: t0 0, t1 1, t2 0, t3 -0.5, t4 0.5, t5 0.5 -> mean 1/4
    assert p4["paired_vs_none"]["mean"] == pytest.approx(1 / 4)
    assert p4["success"]["mean"] == pytest.approx((1 + 1 + 0.5 + 0.5 + 0.5 + 0.5) / 6)
    assert p4["per_seed"]["0"] == {"success": pytest.approx(0.5), "paired_vs_none": pytest.approx(1 / 6), "gained": 1,
                                   "lost": 0, "seconds_per_episode": 4.0}
    assert (p4["per_seed"]["1"]["gained"], p4["per_seed"]["1"]["lost"]) == (3, 1)
    assert p4["seeds"] == [0, 1] and p4["n"] == 6 and p4["n_episodes"] == 12
    assert p4["seed_ci"] is not None and p4["seed_ci"][0] < 1 / 4 < p4["seed_ci"][1]
    assert all(type(x) is float for x in p4["seed_ci"])
    assert p4["seconds_per_episode"] == pytest.approx(5.0)
    assert (p4["rehearsals_made"], p4["rehearsals_rejected"], p4["real_calls_in_rehearsal"]) == (12, 6, 0)
    assert p4["paired_vs_none"]["ci_low"] <= 1 / 4 <= p4["paired_vs_none"]["ci_high"]
    assert block["m"]["none"]["success"]["mean"] == pytest.approx((1 + 0 + 0.5 + 1 + 0 + 0) / 6)
    assert block["run"]["n_tasks"] == 6 and block["run"]["left_out"] == []
    table = pool_bench.markdown(block)
    assert "| m | parallel:4 | 0,1 | 6 × 2 |" in table and "0: +0.167 (1/0), 1: +0.333 (3/1)" in table


def test_one_seeds_none_in_two_reports_counts_once_and_must_agree(tmp_path):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _report(tmp_path, "b.json", 0, [1, 0, 0, 1, 0, 0], {"sequential:4": _cell([1, 0, 0, 0, 0, 0])})
    block = pool_bench.pool({p: pool_bench.load_report(p) for p in (a, b)}, n_boot=200)
    assert block["m"]["none"]["seeds"] == [0]
    assert block["m"]["sequential:4"]["paired_vs_none"]["mean"] == pytest.approx(-1 / 6)
    c = _report(tmp_path, "c.json", 0, [0, 0, 0, 1, 0, 0], {"sequential:4": _cell([1, 0, 0, 0, 0, 0])})
    with pytest.raises(pool_bench.BenchmarkError, match="other per-task outcomes"):
        pool_bench.pool({p: pool_bench.load_report(p) for p in (a, c)}, n_boot=200)


def test_unfinished_cell_left_out_and_nothing_to_pool_refused(tmp_path):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0], complete=False)})
    with pytest.raises(pool_bench.BenchmarkError, match="nothing to pool"):
        pool_bench.pool({a: pool_bench.load_report(a)}, n_boot=200)
    b = _report(tmp_path, "b.json", 1, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    block = pool_bench.pool({p: pool_bench.load_report(p) for p in (a, b)}, n_boot=200)
    assert block["m"]["parallel:4"]["seeds"] == [1]
    assert len(block["run"]["left_out"]) == 1 and "not complete" in block["run"]["left_out"][0]


@pytest.mark.parametrize("field,value", [("heldout_file", "other.json"), ("overrides", "rehearsal.memory_content=all"),
                                         ("task_ids", TASKS[:3]), ("protocol", "tau2_orchestrator")])
def test_reports_of_other_set_ups_refused(tmp_path, field, value):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _report(tmp_path, "b.json", 1, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])}, **{field: value})
    with pytest.raises(pool_bench.BenchmarkError, match=f"differ in run.{field}"):
        pool_bench.pool({p: pool_bench.load_report(p) for p in (a, b)}, n_boot=200)


def test_other_model_reference_refused(tmp_path):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _report(tmp_path, "b.json", 1, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])},
                models={"m": {"ref": "/y/adapter"}})
    with pytest.raises(pool_bench.BenchmarkError, match="different references"):
        pool_bench.pool({p: pool_bench.load_report(p) for p in (a, b)}, n_boot=200)


def test_main_writes_block_keeps_other_keys_and_appends(tmp_path, capsys):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _report(tmp_path, "b.json", 1, [1, 0, 1, 1, 0, 0], {"parallel:4": _cell([1, 1, 1, 1, 0, 0])})
    out, md = tmp_path / "effect.json", tmp_path / "R.md"
    out.write_text(json.dumps({"older": {"x": 1}}))
    md.write_text("# Results\n")
    argv = [a, b, "--key", "m_seeds01", "--json", str(out), "--results-md", str(md), "--n-boot", "200"]
    assert pool_bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["older"] == {"x": 1} and data["m_seeds01"]["m"]["parallel:4"]["seeds"] == [0, 1]
    assert "pooled over seeds (m_seeds01)" in md.read_text() and "wrote 'm_seeds01'" in capsys.readouterr().out
    assert pool_bench.main(argv + ["--no-append"]) == 0
    assert "replaced 'm_seeds01'" in capsys.readouterr().out


@pytest.mark.parametrize("content,match", [(b"{not json", "not a readable JSON"), (b"\xff\xfe\x00", "not a readable JSON"),
                                           (b'{"run": {"seed": 0}}', "not a held-out report"),
                                           (b'{"run": {"seed": 0, "task_ids": []}}', "no model")])
def test_bad_report_files_refused(tmp_path, capsys, content, match):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert pool_bench.main([str(bad), "--key", "k", "--json", str(tmp_path / "o.json"), "--no-append"]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_bad_arguments_refused_before_reading(tmp_path, capsys):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    before = Path(a).read_text()
    cases = [([a, "--key", "run"], "--key"), ([a, "--key", " "], "--key"), ([a, a, "--key", "k"], "named twice"),
             ([a, "--key", "k", "--json", a], "is one of the reports"), ([a, "--key", "k", "--n-boot", "5"], "--n-boot"),
             ([str(tmp_path / "missing.json"), "--key", "k"], "no such file")]
    for argv, match in cases:
        assert pool_bench.main(argv + ["--no-append"] + ([] if "--json" in argv else ["--json", str(tmp_path / "o.json")])) == 2
        assert match in capsys.readouterr().err
    assert Path(a).read_text() == before


def test_json_target_that_is_not_an_object_left_alone(tmp_path, capsys):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    out = tmp_path / "o.json"
    out.write_text("[1, 2]")
    assert pool_bench.main([a, "--key", "k", "--json", str(out), "--no-append"]) == 2
    assert "not a JSON report" in capsys.readouterr().err and out.read_text() == "[1, 2]"


def _edited(tmp: Path, name: str, edit) -> str:
    path = _report(tmp, name, 1, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    rep = json.loads(Path(path).read_text())
    edit(rep)
    Path(path).write_text(json.dumps(rep))
    return path


@pytest.mark.parametrize("edit,match", [
    (lambda r: r["m"]["parallel:4"]["outcomes"].update({TASKS[0]: 5.0}), "is not 0 or 1"),
    (lambda r: r["m"]["parallel:4"]["outcomes"].update({TASKS[0]: 0.5}), "is not 0 or 1"),
    (lambda r: r["m"]["parallel:4"]["outcomes"].update({TASKS[0]: "1"}), "is not 0 or 1"),
    (lambda r: r["m"]["parallel:4"]["outcomes"].update({TASKS[0]: None}), "is not 0 or 1"),
    (lambda r: r["m"]["parallel:4"]["outcomes"].update({TASKS[0]: True}), "is not 0 or 1"),
    (lambda r: r["m"]["parallel:4"].update(complete="false"), "'complete' must be true or false"),
    (lambda r: r["m"]["parallel:4"].update(rehearsals_made=2.7), "rehearsals_made must be an integer"),
    (lambda r: r["m"]["parallel:4"].update(seconds_per_episode="19"), "seconds_per_episode must be"),
    (lambda r: r["run"].update(seed=True), "run.seed must be an integer"),
    (lambda r: r["run"].update(seed="1"), "run.seed must be an integer"),
    (lambda r: r["run"].pop("models"), "has no reference in run.models"),
    (lambda r: r["run"].update(models={"m": None}), "has no reference in run.models"),
    (lambda r: r["run"].update(models="m"), "has no reference in run.models"),
    (lambda r: r.update(m={}), "no condition cells"),
])
def test_reports_with_bad_values_refused_before_anything_is_written(tmp_path, capsys, edit, match):
    good = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    bad = _edited(tmp_path, "b.json", edit)
    out = tmp_path / "o.json"
    assert pool_bench.main([good, bad, "--key", "k", "--json", str(out), "--no-append"]) == 2
    assert match in capsys.readouterr().err and not out.exists()


def test_nan_outcome_refused(tmp_path, capsys):
    good = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    bad = tmp_path / "b.json"
    bad.write_text(Path(good).read_text().replace('"seed": 0', '"seed": 1').replace('"airline/t0": 1', '"airline/t0": NaN', 1))
    assert pool_bench.main([good, str(bad), "--key", "k", "--json", str(tmp_path / "o.json"), "--no-append"]) == 2
    assert "is not 0 or 1" in capsys.readouterr().err


def test_condition_without_none_at_its_seed_is_listed_as_left_out(tmp_path):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _edited(tmp_path, "b.json", lambda r: r["m"].pop("none"))
    c = _edited(tmp_path, "c.json", lambda r: (r["run"].update(seed=2), r["m"]["none"].update(complete=False)))
    block = pool_bench.pool({p: pool_bench.load_report(p) for p in (a, b, c)}, n_boot=200)
    assert block["m"]["parallel:4"]["seeds"] == [0]
    left = block["run"]["left_out"]
    assert any("parallel:4 at seed 1: no finished none" in x for x in left)
    assert any("parallel:4 at seed 2: no finished none" in x for x in left)
    assert any("none (seed 2" in x and "not complete" in x for x in left)


def test_none_success_at_the_same_seeds_and_seed_ci_cut_to_the_possible_range(tmp_path):
    a = _report(tmp_path, "a.json", 0, [0, 0, 0, 0, 0, 0], {"parallel:4": _cell([1, 1, 1, 1, 1, 1])})
    b = _report(tmp_path, "b.json", 1, [1, 1, 1, 1, 1, 1], {"parallel:4": _cell([1, 1, 1, 1, 1, 1])})
    c = _report(tmp_path, "c.json", 2, [1, 1, 1, 1, 1, 1], {})
    block = pool_bench.pool({p: pool_bench.load_report(p) for p in (a, b, c)}, n_boot=200)
    p4 = block["m"]["parallel:4"]
    assert block["m"]["none"]["seeds"] == [0, 1, 2] and p4["seeds"] == [0, 1]
    assert p4["none_success_same_seeds"] == pytest.approx(0.5)  # seeds 0 and 1 only, not seed 2's none
    assert p4["seed_ci"][0] >= -1.0 and p4["seed_ci"][1] == 1.0  # per-seed Δ 1 and 0: t(0.975, 1) = 12.7 spreads far
    assert "| 0.500 |" in pool_bench.markdown(block)


def test_task_sets_that_differ_are_named(tmp_path):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _edited(tmp_path, "b.json", lambda r: r["m"]["none"]["outcomes"].pop(TASKS[2]))
    with pytest.raises(pool_bench.BenchmarkError, match=r"m none at seed 1 scored other tasks .* 'airline/t2'"):
        pool_bench.pool({p: pool_bench.load_report(p) for p in (a, b)}, n_boot=200)


def test_real_calls_in_rehearsal_are_warned_about(tmp_path, capsys):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _edited(tmp_path, "b.json", lambda r: r["m"]["parallel:4"].update(real_calls_in_rehearsal=3))
    assert pool_bench.main([a, b, "--key", "k", "--json", str(tmp_path / "o.json"), "--no-append"]) == 0
    assert "WARNING: m parallel:4: 3 real calls during rehearsal" in capsys.readouterr().out


def test_targets_that_would_lose_data_refused(tmp_path, capsys):
    a = _report(tmp_path, "a.json", 0, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    b = _report(tmp_path, "b.json", 1, [1, 0, 0, 1, 0, 0], {"parallel:4": _cell([1, 1, 0, 1, 0, 0])})
    other = _report(tmp_path, "other_run.json", 3, [1, 0, 0, 1, 0, 0], {})
    measured = tmp_path / "effect.json"
    measured.write_text(json.dumps({"act48": {"none": {"n": 60}}}))
    folder = tmp_path / "adir"
    folder.mkdir()
    cases = [(["--json", str(measured), "--key", "act48"], "not a pooled block"),
             (["--json", str(folder)], "a folder"), (["--json", ""], "--json is empty")]
    for extra, match in cases:
        argv = [a, b, "--no-append"] + extra + ([] if "--key" in extra else ["--key", "k"])
        before = {p: Path(p).read_text() for p in (a, b, other, str(measured))}
        assert pool_bench.main(argv) == 2, extra
        assert match in capsys.readouterr().err
        assert {p: Path(p).read_text() for p in before} == before
    assert list(folder.iterdir()) == [] and not list(tmp_path.glob("*.tmp"))
    assert pool_bench.main([a, b, "--key", "pooled", "--json", str(measured), "--no-append"]) == 0
    assert pool_bench.main([a, b, "--key", "pooled", "--json", str(measured), "--no-append"]) == 0  # a pooled block: replaced
    assert "replaced 'pooled'" in capsys.readouterr().out
    # a held-out report may take the block (rehearsal_effect.json is one) and is still read as a report after it
    assert pool_bench.main([a, b, "--key", "pooled", "--json", other, "--no-append"]) == 0
    assert "pooled" in json.loads(Path(other).read_text())
    block = pool_bench.pool({p: pool_bench.load_report(p) for p in (a, other)}, n_boot=200)
    assert "pooled" not in block and block["m"]["none"]["seeds"] == [0, 3]


def test_a_folder_given_as_a_report_is_named_so(tmp_path, capsys):
    assert pool_bench.main([str(tmp_path), "--key", "k", "--json", str(tmp_path / "o.json"), "--no-append"]) == 2
    assert "a folder; give a report file" in capsys.readouterr().err
