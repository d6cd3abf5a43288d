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
