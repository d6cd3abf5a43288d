"""`envace rehearse` and the rehearse Flyte workflow on one tau2 task with a tiny random model."""

import json

import pytest

from envace_core.cli import main


@pytest.fixture
def over(tiny_model_dir, tmp_path):
    return json.dumps({"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})


def test_rehearse_prints_every_section(over, capsys):
    assert main(["--profile", "test", "--overrides", over, "rehearse", "--task", "airline/2",
                 "--mode", "parallel", "--n", "2"]) == 0
    out = capsys.readouterr().out
    for section in ("Private Rehearsal on airline/2", "Rehearsals (imagined", "rehearsal 1",
                    "rehearsal 2", "Rehearsal memory", "Committed execution (real environment)",
                    "final message", "tau2 reward", "isolation: OK",
                    "real calls during rehearsal = 0", "DB hash unchanged by rehearsal = True"):
        assert section in out, section


def test_rehearse_options_after_the_subcommand_and_sequential(over, capsys):
    """--profile/--overrides also work after the subcommand; sequential mode shows self-evals."""
    assert main(["rehearse", "--profile", "test", "--overrides", over, "--task", "airline/2",
                 "--mode", "sequential", "--n", "2", "--no-verifier", "--max-turns", "1"]) == 0
    out = capsys.readouterr().out
    assert "mode=sequential n=2" in out and "verifier=False" in out
    assert "self-eval:" in out and "isolation: OK" in out


def test_unknown_task_id_is_one_clear_line(capsys):
    assert main(["--profile", "test", "rehearse", "--task", "airline/9999"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("envace: error: unknown task id 'airline/9999'")
    assert "envace rehearse --list" in err and len(err.splitlines()) == 1
    assert main(["rehearse", "--task", "nodomain"]) == 2
    assert "DOMAIN/ID" in capsys.readouterr().err


def test_bad_mode_and_bad_n_are_clear_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["rehearse", "--task", "airline/2", "--mode", "bogus"])
    assert e.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert main(["rehearse", "--task", "airline/2", "--n", "0"]) == 2
    assert "--n must be >= 1" in capsys.readouterr().err
    assert main(["rehearse", "--task", "airline/2", "--n", "100000"]) == 2  # refused before any model loads
    err = capsys.readouterr().err
    assert "--n '100000' (the setting rehearsal.n)" in err and "less than or equal to 64" in err


@pytest.mark.parametrize("argv", [["eval", "--model", "bundled:smollm2-135m-instruct", "--bench", "tau2:airline"],
                                  ["adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools", "t.json"]])
@pytest.mark.parametrize("seed, why", [("-1", "-1 is outside 0..2147483647"),
                                       (str(2**31), "2147483648 is outside 0..2147483647"),
                                       ("1.5", "'1.5' is not an integer seed")])
def test_a_seed_outside_train_seeds_range_is_an_argparse_error(capsys, argv, seed, why):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--seed", seed])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --seed: {why}" in err


def test_ctrl_c_ends_the_cli_with_one_line_and_status_130(capsys, monkeypatch):
    import envace_core.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_rehearse", interrupted)
    assert cli.main(["rehearse", "--task", "airline/2"]) == 130
    assert capsys.readouterr().err == "envace: interrupted\n"


def test_rehearse_list_ids(capsys):
    assert main(["rehearse", "--list", "airline"]) == 0
    out = capsys.readouterr().out
    assert "airline test (20):" in out and "airline/2 " in out


def test_rehearse_workflow_runs_locally(over, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Flyte's local sandbox stays in tmp
    from workflows.rehearse import rehearse

    out = json.loads(rehearse(task_id="airline/2", mode="parallel", n=2, profile="test", overrides=over))
    assert out["task_id"] == "airline/2" and out["split"] == "test"
    assert out["n_rehearsals"] == 2 and len(out["rounds"][0]["rehearsals"]) == 2
    assert out["isolation"]["real_calls_during_rehearsal"] == 0
    assert out["isolation"]["db_hash_unchanged"] is True
    assert "DB" in out["sub_rewards"] and out["reward"] is not None
    assert out["committed"]["termination"]

    from envace_core.rehearsal.inspect import render_html

    html = render_html(out)
    assert "Committed execution" in html and "Isolation" in html


@pytest.fixture
def loads_no_model(monkeypatch):
    """Fail the test if a rehearsal loads a model (for errors that must come first)."""
    from envace_core.training import policy

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad argument was reported")

    monkeypatch.setattr(policy, "load_policy", refuse)


@pytest.mark.parametrize("kw, needle", [
    ({"n": 1000}, "--n '1000' (the setting rehearsal.n): Input should be less than or equal to 64"),
    ({"n": 0}, "--n must be >= 1, got 0"),
    ({"mode": "none", "n": 7}, "--n: rehearsal mode none makes no rehearsal"),
    ({"mode": "sideways"}, "--mode 'sideways': choose one of none, parallel, sequential"),
    ({"task_id": "airline/9999"}, "unknown task id 'airline/9999'"),
    ({"task_id": " "}, "give the task as --task_id DOMAIN/ID"),
])
def test_rehearse_workflow_makes_the_clis_checks_before_any_model_loads(kw, needle, loads_no_model, over, tmp_path,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)  # Flyte's local sandbox stays in tmp
    from workflows.rehearse import rehearse

    with pytest.raises(Exception) as e:
        rehearse(**{"task_id": "airline/2", **kw}, profile="test", overrides=over)
    assert needle in " ".join(str(e.value).split()), str(e.value)


def test_the_cli_and_the_workflow_task_share_one_argument_check(loads_no_model, over, tmp_path, monkeypatch, capsys):
    import envace_core.rehearsal.inspect as inspect_mod

    seen = []

    def check(cfg, task_id, **kw):
        seen.append((task_id, kw.get("mode"), kw.get("n")))
        raise inspect_mod.EnvaceError("refused by the shared check")

    monkeypatch.setattr(inspect_mod, "check_rehearse_args", check)
    assert main(["--profile", "test", "--overrides", over, "rehearse", "--task", "airline/2", "--n", "3"]) == 2
    assert "refused by the shared check" in capsys.readouterr().err
    import tasks.rehearse as task_mod

    monkeypatch.setattr(task_mod, "check_rehearse_args", check)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="refused by the shared check"):
        task_mod.rehearse_task(task_id="airline/2", mode=None, n=None, profile="test", overrides=over)
    assert seen == [("airline/2", None, 3), ("airline/2", None, None)]


def test_rehearse_workflows_n_defaults_to_the_profiles_rehearsal_n(over, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Flyte's local sandbox stays in tmp
    from workflows.rehearse import rehearse

    o = json.loads(over)
    o.update({"rehearsal": {"mode": "parallel", "n": 3}, "eval": {"max_turns": 1}})
    out = json.loads(rehearse(task_id="airline/2", profile="test", overrides=json.dumps(o)))
    assert out["settings"]["mode"] == "parallel" and out["settings"]["n"] == 3 and out["n_rehearsals"] == 3


def _records(tmp_path):
    """Two task records as `stages.dataset.task_record` writes them: tau2's airline/2 under a held-out id."""
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.stages.dataset import task_record

    t = next(t for t in load_tasks("airline", "test") if t.id == "airline/2")
    held = t.model_copy(update={"id": "airline/synth-L1-heldout0", "split": "heldout"})
    return [task_record(t), task_record(held)]


def test_rehearse_a_task_of_a_tasks_file(over, tmp_path, capsys):
    """--tasks finds ids that no tau2 split holds (synthesized held-out tasks) and runs them as usual."""
    f = tmp_path / "heldout.json"
    f.write_text(json.dumps(_records(tmp_path)))
    assert main(["--profile", "test", "--overrides", over, "rehearse", "--tasks", str(f),
                 "--task", "airline/synth-L1-heldout0", "--mode", "parallel", "--n", "2", "--max-turns", "1"]) == 0
    out = capsys.readouterr().out
    assert "Private Rehearsal on airline/synth-L1-heldout0 (heldout split)" in out
    assert "Rehearsal memory" in out and "isolation: OK" in out


def test_tasks_file_as_a_dataset_folder_or_parquet(tmp_path):
    import pandas as pd

    from envace_core.rehearsal.inspect import find_task

    d = tmp_path / "datasets" / "abc"
    d.mkdir(parents=True)
    pd.DataFrame(_records(tmp_path)).to_parquet(d / "tasks.parquet")
    for where in (d, d / "tasks.parquet"):
        t = find_task("airline/synth-L1-heldout0", str(where))
        assert t.split == "heldout" and t.domain == "airline" and t.gold_actions
    assert find_task("airline/2", str(d)).split == "test"


def test_bad_tasks_files_are_one_clear_line(tmp_path, capsys):
    """Missing, unreadable, wrongly shaped files and ids not in the file: exit 2, one line naming the file."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_records(tmp_path)))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    not_list = tmp_path / "obj.json"
    not_list.write_text('{"id": "airline/2"}')
    no_cols = tmp_path / "nocols.json"
    no_cols.write_text('[{"id": "airline/2", "domain": "airline"}]')
    other = tmp_path / "tasks.csv"
    other.write_text("id\n")
    cases = [(tmp_path / "nope.json", "airline/2", "does not exist"),
             (broken, "airline/2", "cannot be read"),
             (not_list, "airline/2", "expected a list of task records"),
             (no_cols, "airline/2", "record 0 is not a task record"),
             (other, "airline/2", "expected tasks.parquet or a .json list"),
             (good, "airline/synth-nope", "do not hold it")]
    rec = _records(tmp_path)[1]

    def write(name, records):
        (tmp_path / name).write_text(json.dumps(records))
        return tmp_path / name

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    cases += [(write("dom.json", [dict(rec, domain="nodomain", id="nodomain/1")]), "nodomain/1", "not one of tau2's"),
              (write("mismatch.json", [dict(rec, id="retail/zz")]), "retail/zz", "does not start with 'airline/'"),
              (write("idint.json", [dict(rec, id=5)]), "airline/2", "record 0 is not a task record (ValidationError"),
              (write("goldlist.json", [dict(rec, gold_actions=[])]), "airline/2", "column 'gold_actions' must be a JSON text"),
              (write("goldobj.json", [dict(rec, gold_actions='{"name": "x"}')]), "airline/2",
               "column 'gold_actions' must hold a JSON list"),
              (write("srcobj.json", [dict(rec, source={})]), "airline/2", "column 'source' must be a JSON text"),
              (deep, "airline/2", "cannot be read: RecursionError"),
              ("~nosuchuser-envace/x.json", "airline/2", "cannot be opened"),
              (tmp_path / ("a" * 300 + ".json"), "airline/2", "cannot be opened"),
              ("/dev/null", "airline/2", "is not a regular file"),
              (good, "airline/" + "x" * 100_000, "do not hold it")]
    for path, task, want in cases:
        assert main(["--profile", "test", "rehearse", "--tasks", str(path), "--task", task]) == 2, path
        err = capsys.readouterr().err.strip()
        assert err.startswith("envace: error:") and want in err and len(err.splitlines()) == 1, err
        assert len(err) < 1000, err[:200]
    assert main(["--profile", "test", "rehearse", "--tasks", " ", "--task", "airline/2"]) == 2
    assert "--tasks is empty" in capsys.readouterr().err


def test_list_the_ids_of_a_tasks_file(tmp_path, capsys):
    """--list with --tasks lists the file's ids by domain and split (not tau2's own), upper-case suffix too."""
    f = tmp_path / "HELD.JSON"
    f.write_text(json.dumps(_records(tmp_path)))
    assert main(["rehearse", "--tasks", str(f), "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["airline heldout (1): airline/synth-L1-heldout0", "airline test (1): airline/2"]
    assert main(["rehearse", "--tasks", str(f), "--list", "retail"]) == 2
    assert "holds no task of domain 'retail'" in capsys.readouterr().err
    assert main(["rehearse", "--tasks", str(tmp_path / "nope.json"), "--list"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_trace_cuts_long_texts_and_keeps_short_ones():
    from envace_core.rehearsal.trace import _cut

    assert _cut("x" * 10, 10) == "x" * 10 and _cut(None, 3) is None and _cut("abcdef", None) == "abcdef"
    assert _cut("abcdef", 2) == "ab… [+4 chars]"


def test_trace_keeps_every_rehearsal_even_without_a_self_eval():
    from envace_core.rehearsal.agent import RehearsalRound
    from envace_core.rehearsal.trace import episode
    from envace_core.roles.self_eval import SelfEval
    from envace_core.types import Trajectory

    a, b = (Trajectory(task_id="airline/0", group_index=k, termination="agent_message") for k in (0, 1))
    rnd = RehearsalRound(turn=0, rehearsals=[a, b], memory="m" * 500, rejected=[(b, ["unknown tool"])],
                         self_evals=[SelfEval(True, "x" * 900, "", "raw")])
    tr = episode([rnd], a)
    r1, r2 = tr["rounds"][0]["rehearsals"]
    assert (r1["rejected"], r2["rejected"], r2["reasons"], r2["self_eval"]) == (False, True, ["unknown tool"], None)
    assert r1["self_eval"]["blocker"] == "x" * 400 + "… [+500 chars]" and tr["rounds"][0]["memory"].endswith("[+100 chars]")
    assert tr["committed"] == {"steps": [], "termination": "agent_message", "parse_errors": []}


@pytest.mark.parametrize("extra, flag", [(["--task", "airline/2"], "--task"), (["--n", "3"], "--n"),
                                         (["--mode", "parallel"], "--mode"), (["--no-verifier"], "--no-verifier"),
                                         (["--max-turns", "2"], "--max-turns")])
def test_list_refuses_the_flags_of_a_run(capsys, extra, flag):
    """--list prints ids only: a run flag beside it is named, not silently dropped."""
    assert main(["rehearse", "--list", "airline", *extra]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: --list only prints task ids" in err and "airline test" not in err


@pytest.mark.parametrize("extra, flag", [(["--n", "3"], "--n"), (["--reenter"], "--reenter"),
                                         (["--no-verifier"], "--no-verifier")])
def test_mode_none_refuses_rehearsal_flags(capsys, extra, flag):
    """--mode none rehearses nothing, so the flags that shape rehearsals are errors (before any model load)."""
    assert main(["--profile", "test", "rehearse", "--task", "airline/2", "--mode", "none", *extra]) == 2
    assert f"{flag}: rehearsal mode none makes no rehearsal" in capsys.readouterr().err


def test_profile_mode_none_also_refuses_n(capsys):
    over = json.dumps({"rehearsal": {"mode": "none"}})
    assert main(["--profile", "test", "--overrides", over, "rehearse", "--task", "airline/2", "--n", "2"]) == 2
    assert "--n: rehearsal mode none" in capsys.readouterr().err


def test_list_still_refuses_bad_overrides(capsys):
    assert main(["--overrides", "bogus.key=1", "rehearse", "--list", "airline"]) == 2
    assert "bogus" in capsys.readouterr().err
