"""benchmarks/rehearsal_effect_heldout.py (``rehearsal_effect.py --heldout N``): conditions with the verifier
off, the disjointness proof failing on overlap, per-cell JSON assembly and paired statistics on synthetic
records, resume from the episode cache (cached episodes are not rerun), --max-minutes, and a tiny-model run
end to end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.types import Task, ToolCall
from tests.benchmark_loader import load_benchmark
from tests.heldout_stand_in import stand_in_heldout

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
h = load_benchmark("rehearsal_effect_heldout")


def task(tid: str, request: str = "", actions=(("get_user_details", {"user_id": "u1"}),), domain="airline"):
    return Task(id=f"{domain}/{tid}", domain=domain, split="train", first_user_message=request or f"request {tid}",
                gold_actions=[ToolCall(name=n, arguments=a) for n, a in actions])


def rec(tid: str, success: float | None, rehearsals: int = 0, rejected: int = 0, real: int | None = None) -> dict:
    return {"task_id": tid, "domain": "airline", "trial": 0, "success": success, "error": None,
            "agent_stats": {"rehearsals": rehearsals, "rejected": rejected},
            "isolation": None if real is None else {"real_calls_during_rehearsal": real, "db_hash_unchanged": real == 0}}


def test_conditions_keep_the_given_order_and_name_the_verifier():
    cs = h.parse_conditions("parallel:4, none,parallel:4+noverify,sequential:2")
    assert [c["name"] for c in cs] == ["parallel:4", "none", "parallel:4+noverify", "sequential:2"]
    assert [c["verifier"] for c in cs] == [True, False, False, True]
    assert [(c["mode"], c["n"]) for c in cs] == [("parallel", 4), ("none", 0), ("parallel", 4), ("sequential", 2)]
    for bad, msg in (("parallel:2", "must include none"), ("none,parallel:2,parallel:2", "twice"),
                     ("none+noverify", "none has no verifier"), ("none,parallel:0", "parallel:0"),
                     ("none,sideways:2+noverify", "sideways")):
        with pytest.raises(h.BenchmarkError, match=msg):
            h.parse_conditions(bad)


def test_condition_config_turns_only_the_verifier_off():
    from envace_core.config import load_config

    cfg = load_config("test", {"rehearsal": {"verifier": True}})
    on, off, none = h.parse_conditions("none,parallel:2,parallel:2+noverify")[1], \
        h.parse_conditions("none,parallel:2+noverify")[1], h.parse_conditions("none")[0]
    assert h.condition_config(cfg, on).rehearsal.verifier is True
    c = h.condition_config(cfg, off)
    assert c.rehearsal.verifier is False and cfg.rehearsal.verifier is True
    assert c.rehearsal.model_dump(exclude={"verifier"}) == cfg.rehearsal.model_dump(exclude={"verifier"})
    assert h.condition_config(cfg, none) is cfg


def test_none_shares_its_cache_across_rehearsal_settings(tmp_path):
    """``none`` rehearses nothing: ``rehearsal.*`` overrides do not split its cache; other overrides do,
    and a rehearsing condition's cache follows every rehearsal setting."""
    from envace_core.config import load_config
    from envace_core.models import resolve_model_ref

    none, par = h.parse_conditions("none,parallel:4")
    model = resolve_model_ref("bundled:smollm2-135m-instruct", str(tmp_path / "reg"))

    def cdir(cond, overrides):
        cfg = load_config("test", overrides)
        return h.cache_dir(tmp_path, cfg, "m", model, cond, "opening_request", 0, "test", overrides)

    plain = cdir(none, "")
    assert cdir(none, "rehearsal.memory_content=calls,rehearsal.grounded_errors=true") == plain
    assert cdir(none, "rehearsal.n=3,eval.max_turns=2") == cdir(none, "eval.max_turns=2") != plain
    assert len({cdir(par, ""), cdir(par, "rehearsal.memory_content=calls"),
                cdir(par, "rehearsal.grounded_errors=true")}) == 3


def test_disjointness_check_fails_on_any_overlap():
    train = [task("synth-L1-a", "Tell me my balance", (("get_user_details", {"user_id": "u1"}),)),
             task("synth-L2-b", "Cancel reservation X", (("cancel_reservation", {"reservation_id": "X"}),))]
    ok = [task("synth-L1-c", "Tell me my balance please", (("get_user_details", {"user_id": "u2"}),))]
    proof = h.check_disjoint(ok, train)
    assert proof["shared_ids"] == 0 and proof["train_tasks"] == 2 and proof["heldout_tasks"] == 1
    for bad, what in ((task("synth-L2-b", "other", (("x", {}),)), "same id: airline/synth-L2-b"),
                      (task("synth-L1-z", "  tell me MY balance ", (("y", {}),)), "same request: airline/synth-L1-z"),
                      (task("synth-L3-q", "new words", (("cancel_reservation", {"reservation_id": "X"}),)),
                       "same gold actions: airline/synth-L3-q")):
        with pytest.raises(h.BenchmarkError, match=what):
            h.check_disjoint(ok + [bad], train)
    # the same gold actions in another domain are another task
    h.check_disjoint([task("synth-L1-r", "r", (("get_user_details", {"user_id": "u1"}),), domain="retail")], train)


def test_interleave_and_limit_cover_every_level():
    ts = [task(f"synth-L{lv}-{i}{lv}") for lv in (1, 2, 3) for i in range(2)] + \
         [task(f"synth-L{lv}-{i}{lv}", domain="retail") for lv in (1, 2) for i in range(2)]
    air = h.interleave_levels([t for t in ts if t.domain == "airline"])
    assert [t.id[-2:] for t in air] == ["01", "02", "03", "11", "12", "13"]
    assert [t.id for t in h.limit_per_domain(air + ts[6:], 2)] == [air[0].id, air[1].id, ts[6].id, ts[7].id]
    assert h.limit_per_domain(ts, None) == ts


def test_cell_paired_statistics_changes_and_isolation_on_synthetic_records():
    none = [rec("a", 0.0), rec("b", 1.0), rec("c", 0.0), rec("d", 1.0), rec("e", None)]
    par = [rec("a", 1.0, 4, 1, 0), rec("b", 0.0, 4, 0, 0), rec("c", 1.0, 2, 2, 0), rec("d", 1.0), rec("e", 1.0, 4, 0, 0)]
    c = h.cell(par, none, {"a": 2.0, "b": 4.0}, {"a"}, 5, n_boot=500)
    assert c["success"]["mean"] == pytest.approx(0.8) and c["n"] == 5 and c["n_run"] == 5 and c["complete"]
    assert c["success"]["ci_low"] <= 0.8 <= c["success"]["ci_high"]
    # paired on the 4 tasks scored under both: (1 - 0) + (0 - 1) + (1 - 0) + 0 = 1 -> 0.25
    assert c["paired_vs_none"]["mean"] == pytest.approx(0.25) and c["paired_vs_none"]["n"] == 4
    assert c["paired_vs_none"]["ci_low"] < 0.25 < c["paired_vs_none"]["ci_high"]
    assert c["changed_vs_none"] == {"gained": ["a", "c"], "lost": ["b"]}
    assert (c["rehearsals_made"], c["rehearsals_rejected"], c["tasks_rehearsed"]) == (14, 3, 4)
    assert c["real_calls_in_rehearsal"] == 0 and c["isolation_checked"] == 4 and c["db_hash_unchanged"]
    assert c["seconds_per_episode"] == pytest.approx(3.0) and c["seconds_timed_episodes"] == 2
    assert c["seconds_note"].startswith("1 timed in this run, 1 when they ran earlier")
    assert c["outcomes"] == {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 1.0}
    # a real call during rehearsal shows up (never hidden as 0)
    leak = h.cell([rec("a", 1.0, 2, 0, 3)], none, {}, set(), 5)
    assert leak["real_calls_in_rehearsal"] == 3 and not leak["db_hash_unchanged"] and not leak["complete"]
    assert leak["seconds_per_episode"] is None and "no episode timed" in leak["seconds_note"]
    assert h.cell([rec("a", 1.0, 2)], none, {}, set(), 1)["real_calls_in_rehearsal"] is None  # unchecked
    before_none = h.cell(par, None, {}, set(), 5)
    assert before_none["paired_vs_none"]["mean"] is None and before_none["changed_vs_none"] == {"gained": [], "lost": []}


def test_assemble_shapes_the_report_and_the_table():
    recs = {"warm": {"none": [rec("a", 0.0), rec("b", 1.0)], "parallel:2+noverify": [rec("a", 1.0, 2, 0, 0), rec("b", 1.0, 2, 0, 0)]}}
    rep = h.assemble({"command": "x"}, recs, {"warm": {"none": {"a": 1.0, "b": 3.0}}}, {"warm": {"none": {"a", "b"}}}, 2, 200)
    assert set(rep) == {"run", "warm"} and list(rep["warm"]) == ["none", "parallel:2+noverify"]
    p = rep["warm"]["parallel:2+noverify"]
    for key in ("success", "paired_vs_none", "n", "seconds_per_episode", "real_calls_in_rehearsal", "rehearsals_made",
                "rehearsals_rejected", "changed_vs_none"):
        assert key in p
    assert set(p["success"]) == {"mean", "ci_low", "ci_high"} and p["paired_vs_none"]["mean"] == pytest.approx(0.5)
    assert rep["warm"]["none"]["seconds_per_episode"] == pytest.approx(2.0) and p["seconds_per_episode"] is None
    table = h.markdown(rep)
    assert "| warm | none | 2 | 0.500 [0.000, 1.000] | — | 0 (0) | 0 | 2.0 | 0 / 0 |" in table
    assert "| warm | parallel:2+noverify | 2 | 1.000 [1.000, 1.000] | +0.500 [+0.000, +1.000] | 4 (0) | 0 | n/a | 1 / 0 |" in table
    with pytest.raises(h.BenchmarkError, match="labelled 'run'"):
        h.assemble({}, {"run": {}}, {}, {}, 1)


def test_changed_outcomes_carry_both_traces_and_render_side_by_side():
    call = lambda name, obs: {"call": {"name": name, "arguments": {"reservation_id": "LV5MG2"}},
                              "observation": obs, "error": False}
    with_trace = {"rounds": [{"turn": 0, "memory": "Rehearsal 1: get_reservation_details -> not found <tool_call>", "rehearsals": [
        {"index": 1, "steps": [call("get_reservation_details", '{"error": "not found"}')], "rejected": False,
         "reasons": [], "termination": "agent_message", "self_eval": None, "parse_errors": []},
        {"index": 2, "steps": [], "rejected": True, "reasons": ["REHEARSE output is not JSON"],
         "termination": "parse_error", "self_eval": None, "parse_errors": ["rehearse: not JSON"]}]}],
        "committed": {"steps": [call("cancel_reservation", '{"status": "cancelled"}'), {"message": "Done."}],
                      "termination": "agent_message", "parse_errors": []}}
    none = [rec("a", 0.0), rec("b", 1.0), rec("c", 0.0)]
    par = [{**rec("a", 1.0, 2, 1, 0), "trace": with_trace}, rec("b", 1.0, 2, 0, 0), rec("c", 0.0, 2, 0, 0)]
    c = h.cell(par, none, {}, set(), 3, n_boot=200)
    missing = {"missing": "no trace in the record (protocol ?; opening_request records hold one since the harness "
                          "stores it)"}
    assert c["changed_traces"] == {"a": {"with": with_trace, "without": missing}}  # b and c kept their outcome
    md = h.changed_markdown({"run": {}, "m": {"none": h.cell(none, none, {}, set(), 3, n_boot=200), "parallel:2": c}})
    assert md.startswith("**m parallel:2, a: gained**")
    assert "- rehearsal 2 (rejected: REHEARSE output is not JSON): (no step)" in md
    assert "- memory: Rehearsal 1: get_reservation_details -> not found &lt;tool_call>" in md  # not eaten as HTML
    assert '- committed with rehearsal: `cancel_reservation({"reservation_id": "LV5MG2"})` → {"status": "cancelled"}; ' \
           "says: Done." in md
    assert "- committed without: (not recorded: no trace in the record" in md
    # an episode that raised is said to have raised; a backtick in an argument cannot end the code span
    par[0] = {**rec("a", 1.0, 2, 1, 0), "error": "Traceback ...\nRuntimeError: engine died"}
    with_trace["committed"]["steps"][0]["call"]["arguments"] = {"reservation_id": "LV`5"}
    none[0] = {**rec("a", 0.0), "trace": with_trace}
    md = h.changed_markdown({"m": {"parallel:2": h.cell(par, none, {}, set(), 3, n_boot=200)}})
    assert "- committed with rehearsal: (not recorded: the episode raised: RuntimeError: engine died)" in md
    assert "- committed without: `cancel_reservation({\"reservation_id\": \"LV'5\"})`" in md
    many = {t: {"with": with_trace, "without": with_trace} for t in "abcdefgh"}
    md = h.changed_markdown({"m": {"p": {"changed_traces": many, "changed_vs_none": {"gained": [], "lost": list(many)}}}})
    assert md.count(": lost**") == h.CHANGED_SHOWN and "(2 more changed tasks of m p: `changed_traces` in the JSON)" in md


class FakeEvaluate:
    """evaluate_policy's cache contract (append a record per fresh task, skip cached ones) with a count of
    fresh episodes; `sleep` seconds per fresh episode."""

    def __init__(self, sleep: float = 0.0):
        self.ran, self.sleep, self.calls = [], sleep, []

    def __call__(self, cfg, engine, tasks, protocol, *, mode, n, seed, cache_path, concurrency=None):
        from envace_core.evaluation.tau2 import _load_cache

        self.calls.append(([t.id for t in tasks], concurrency))
        cache = _load_cache(Path(cache_path))
        out, skipped = [], 0
        for t in tasks:
            if (t.domain, t.id, 0) in cache:
                out.append(cache[(t.domain, t.id, 0)])
                skipped += 1
                continue
            assert engine == "engine"
            time.sleep(self.sleep)
            self.ran.append(t.id)
            r = {**rec(t.id, 1.0), "termination_reason": "agent_message", "reward": 1.0, "reward_breakdown": {}}
            with Path(cache_path).open("a") as f:
                f.write(json.dumps(r) + "\n")
            out.append(r)
        return {"results": out, "skipped": skipped}


def test_resume_skips_cached_episodes_and_keeps_their_timing(tmp_path):
    from envace_core.config import load_config

    cfg, tasks = load_config("test", ""), [task(f"synth-L1-{i}") for i in range(3)]
    cond = h.parse_conditions("none")[0]
    fake = FakeEvaluate()
    recs, fresh, stopped = h.run_cell(cfg, lambda: "engine", tasks[:2], cond, tmp_path / "c", "opening_request", 0,
                                      None, evaluate=fake)
    assert fake.ran == [t.id for t in tasks[:2]] and fresh == set(fake.ran) and not stopped and len(recs) == 2
    fake2 = FakeEvaluate()
    loads = []
    recs, fresh, _ = h.run_cell(cfg, lambda: loads.append(1) or "engine", tasks, cond, tmp_path / "c",
                                "opening_request", 0, None, evaluate=fake2)
    assert fake2.ran == [tasks[2].id] and fresh == {tasks[2].id} and len(recs) == 3 and len(loads) == 1
    timings = h.read_timings(tmp_path / "c" / "timing.jsonl")
    assert set(timings) == {t.id for t in tasks}
    c = h.cell(recs, recs, timings, fresh, 3)
    assert c["seconds_timed_episodes"] == 3 and c["seconds_note"].startswith("1 timed in this run, 2 when")


def test_concurrency_runs_uncached_tasks_in_batches_and_times_each_as_its_share(tmp_path):
    from envace_core.config import load_config

    cfg, tasks = load_config("test", ""), [task(f"synth-L1-{i}") for i in range(9)]
    cond = h.parse_conditions("none")[0]
    h.run_cell(cfg, lambda: "engine", [tasks[3]], cond, tmp_path / "c", "opening_request", 0, None,
               evaluate=FakeEvaluate())  # task 3 cached
    fake = FakeEvaluate()
    recs, fresh, stopped = h.run_cell(cfg, lambda: "engine", tasks, cond, tmp_path / "c", "opening_request", 0,
                                      None, evaluate=fake, concurrency=2)
    ids = [t.id for t in tasks]
    # batches of up to 2 K = 4 uncached tasks, cut at the cached one, in task order; K passed on
    assert fake.calls == [(ids[0:3], 2), ([ids[3]], None), (ids[4:8], 2), (ids[8:9], 2)]
    assert [r["task_id"] for r in recs] == ids and fresh == set(ids) - {ids[3]} and not stopped
    lines = [json.loads(x) for x in (tmp_path / "c" / "timing.jsonl").read_text().splitlines()]
    assert [x["task_id"] for x in lines[1:]] == ids[0:3] + ids[4:9]
    assert all(x["concurrency"] == 2 for x in lines[1:]) and "concurrency" not in lines[0]
    assert lines[1]["seconds"] == lines[2]["seconds"] == lines[3]["seconds"]  # a batch's wall, shared


def test_max_minutes_stops_after_the_running_episode(tmp_path):
    from envace_core.config import load_config

    fake = FakeEvaluate(sleep=0.3)
    recs, fresh, stopped = h.run_cell(load_config("test", ""), lambda: "engine", [task(f"t{i}") for i in range(4)],
                                      h.parse_conditions("none")[0], tmp_path / "c", "opening_request", 0,
                                      time.monotonic() + 0.1, evaluate=fake)
    assert stopped and len(fake.ran) == 1 and len(recs) == 1


def test_a_json_target_holding_other_results_is_refused_and_a_rerun_may_rewrite_its_own():
    import tempfile

    d = Path(tempfile.mkdtemp())
    pooled = d / "pooled.json"
    pooled.write_text(json.dumps({"run": {"disjoint": {}}, "act48": {}, "actmem": {}}))
    assert "holds other results (act48, actmem)" in h.report_clash(str(pooled), [("base", "x")])
    own = d / "own.json"
    own.write_text(json.dumps({"run": {"heldout_file": "f.json"}, "base": {}}))
    assert h.report_clash(str(own), [("base", "x"), ("trained", "y")]) is None  # a rerun of the same run
    assert "holds other results (base)" in h.report_clash(str(own), [("trained", "y")])
    (d / "bad.json").write_text("not json")
    assert "not a JSON report" in h.report_clash(str(d / "bad.json"), [("base", "x")])
    assert h.report_clash(str(d / "new.json"), [("base", "x")]) is None
    committed = Path(h.DEFAULT_JSON)
    if committed.is_file():  # the committed pooled report: the default --json is refused, not overwritten
        assert "holds other results" in h.report_clash(str(committed), [("base", "bundled:smollm2-135m-instruct")])


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    re_ = load_benchmark("rehearsal_effect", "rehearsal_effect_main")
    (tmp_path / "ds").mkdir()
    ok = tmp_path / "ok"  # a dataset folder as far as the argument check looks
    ok.mkdir()
    (ok / "tasks.parquet").write_bytes(b"")
    for argv, msg in ((["--heldout", "0", "--dataset", str(tmp_path)], "--heldout must be >= 1"),
                      (["--heldout", "2", "--dataset", str(ok), "--max-minutes", "nan"], "--max-minutes must be a finite number > 0"),
                      (["--heldout", "2", "--dataset", str(ok), "--concurrency", "0"], "--concurrency must be >= 1"),
                      (["--heldout", "2", "--dataset", str(ok), "--concurrency", "65"], "--concurrency must be <= 64"),
                      (["--heldout", "2", "--dataset", str(tmp_path / "ds")], "no tasks.parquet"),
                      (["--heldout", "2", "--dataset", str(tmp_path), "--conditions", "none+noverify"], "no verifier"),
                      (["--heldout", "2", "--dataset", str(tmp_path), "--models", "run=x"], "labelled 'run'"),
                      (["--heldout", "2", "--dataset", str(ok), "--models", "y=/nonexistent/m"],
                       "--models y '/nonexistent/m': no such file or folder"),
                      (["--heldout", "2", "--dataset", str(ok), "--overrides", "rehearsal.verifier=false"],
                       "sets rehearsal.verifier, which every condition sets itself"),
                      (["--heldout", "2", "--dataset", str(ok), "--overrides", "rehearsal.n=2"],  # = the profile's
                       "give it in --conditions"),
                      # report paths: refused before synthesis (minutes) rather than after the run
                      (["--heldout", "2", "--dataset", str(ok), "--out", str(ok / "tasks.parquet")],
                       "--out"),
                      (["--heldout", "2", "--dataset", str(ok), "--out", str(tmp_path / "o"), "--json",
                        str(tmp_path)], "--json"),
                      (["--heldout", "2", "--dataset", str(ok), "--out", str(tmp_path / "o"), "--json",
                        str(tmp_path / "r.json"), "--results-md", str(tmp_path)], "(or pass --no-append)"),
                      # a report over an input, or both reports in one file
                      (["--heldout", "2", "--dataset", str(ok), "--out", str(tmp_path / "o"), "--json",
                        str(ok / "tasks.parquet"), "--no-append"], "not a .json report would be overwritten"),
                      (["--heldout", "2", "--dataset", str(ok), "--out", str(tmp_path / "o"), "--json",
                        str(tmp_path / "same.md"), "--results-md", str(tmp_path / "same.md")],
                       "is also --json: give each report its own file")):
        if "--json" not in argv:  # the default --json is the committed pooled report, refused on its own
            argv = [*argv, "--json", str(tmp_path / "fresh.json")]
        assert re_.main(argv) == 2  # rehearsal_effect.py hands --heldout runs over
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1


def test_tiny_model_end_to_end_then_resume(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The real harness (evaluate_policy, opening_request) on two tau2 test tasks standing in for the
    synthesized ones (synthesis is covered by the main job's tests and takes minutes)."""
    ds, stand_in, over = stand_in_heldout(tmp_path)
    monkeypatch.setattr(h, "build_heldout", lambda train, n, levels, seed: stand_in)
    md, out_json = tmp_path / "RESULTS.md", tmp_path / "r.json"
    md.write_text("# Measured results\n")
    argv = ["--heldout", "1", "--dataset", str(ds), "--models", f"tiny={tiny_model_dir}", "--conditions",
            "none,parallel:2,parallel:2+noverify", "--profile", "test", "--overrides", over, "--out",
            str(tmp_path / "out"), "--json", str(out_json), "--results-md", str(md), "--n-boot", "200"]
    assert h.main(argv) == 0
    rep = json.loads(out_json.read_text())
    assert rep["run"]["task_ids"] == [t.id for t in stand_in] and rep["run"]["disjoint"]["shared_ids"] == 0
    assert list(rep["tiny"]) == ["none", "parallel:2", "parallel:2+noverify"]
    assert rep["run"]["verifier"] == {"parallel:2": True, "parallel:2+noverify": False}
    for name, c in rep["tiny"].items():
        assert c["n_run"] == 2 and c["complete"] and c["seconds_per_episode"] > 0
        assert (c["rehearsals_made"] > 0) == (name != "none") and c["real_calls_in_rehearsal"] == 0
    assert "## Private Rehearsal effect on held-out synthesized tasks" in md.read_text()
    capsys.readouterr()

    monkeypatch.setattr(h, "build_heldout", lambda *a: pytest.fail("the task set is reread, not rebuilt"))
    from envace_core.training import policy

    monkeypatch.setattr(policy, "load_engine", lambda *a, **k: pytest.fail("a model loaded for cached episodes"))
    assert rep["run"]["cache_notes"] == {}
    from envace_core.evaluation import code_ledger

    monkeypatch.setattr(code_ledger, "_process_code", lambda: ("f" * 40, False))  # as after an upgrade
    assert h.main(argv + ["--no-append"]) == 0
    again = json.loads(out_json.read_text())
    notes = again["run"]["cache_notes"]  # every cell reused episodes the first run's code played
    assert sorted(notes) == ["tiny none", "tiny parallel:2", "tiny parallel:2+noverify"]
    assert all("2 episodes reused" in n and "the code now: ffffffffffff" in n for n in notes.values())
    for name, c in again["tiny"].items():
        assert c["outcomes"] == rep["tiny"][name]["outcomes"]
        assert c["seconds_per_episode"] == pytest.approx(rep["tiny"][name]["seconds_per_episode"])
        assert c["seconds_note"].startswith("0 timed in this run, 2 when")


def test_a_built_set_that_overlaps_the_train_split_is_not_kept(tmp_path, monkeypatch):
    """A synthesis seed whose held-out set shares a task with the train split fails, and leaves no task file that a
    rerun would read back (it would fail again without a rebuild)."""
    from envace_core.envs.tau2.tasks import load_tasks

    ds, stand_in, _ = stand_in_heldout(tmp_path)
    overlapping = [load_tasks("airline", "train")[0], *stand_in]  # the dataset's first train task
    monkeypatch.setattr(h, "build_heldout", lambda train, n, levels, seed: overlapping)
    with pytest.raises(h.BenchmarkError, match="overlap the training dataset's train split"):
        h.heldout_tasks(str(ds), 1, 2, [1, 2, 3], tmp_path / "out", log=lambda *a: None)
    assert not list((tmp_path / "out").rglob("*.json"))
    monkeypatch.setattr(h, "build_heldout", lambda train, n, levels, seed: stand_in)
    tasks, info = h.heldout_tasks(str(ds), 1, 2, [1, 2, 3], tmp_path / "out", log=lambda *a: None)
    assert [t.id for t in tasks] == [t.id for t in stand_in] and Path(info["file"]).is_file()
