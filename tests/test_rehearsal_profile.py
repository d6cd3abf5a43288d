"""benchmarks/rehearsal_profile.py: every generate call of a rehearsing episode lands in its phase and role,
the parts add up to the seconds spent generating, the rehearsal phase exists only where a condition rehearses,
and the agent class is left as it was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from tests.heldout_stand_in import stand_in_heldout

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import rehearsal_effect_heldout as heldout
import rehearsal_profile as prof


def test_summarise_calls_adds_by_phase_and_role():
    calls = [{"phase": "rehearsal", "role": "act", "calls": 1, "rows": 4, "tokens_fed": 10, "tokens_cached": 90,
              "tokens_generated": 40, "decode_steps": 12, "seconds": 1.0, "prefill_s": 0.25, "decode_s": 0.5},
             {"phase": "committed", "role": "act", "calls": 1, "rows": 1, "tokens_fed": 5, "tokens_cached": 95,
              "tokens_generated": 9, "decode_steps": 9, "seconds": 0.5, "prefill_s": 0.125, "decode_s": 0.25}]
    parts = prof.summarise_calls(calls + calls[:1])
    assert parts["rehearsal/act"]["rows"] == 8 and parts["rehearsal/act"]["decode_steps"] == 24
    assert parts["committed/act"]["calls"] == 1
    assert parts["all"]["seconds"] == 2.5 and parts["all"]["tokens_generated"] == 89


def test_tiny_model_profile_end_to_end(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from envace_core.rehearsal.agent import RehearsalAgent

    ds, stand_in, over = stand_in_heldout(tmp_path)
    monkeypatch.setattr(heldout, "build_heldout", lambda train, n, levels, seed: stand_in)
    out_json = tmp_path / "p.json"
    before = RehearsalAgent.rehearse_round
    argv = ["--dataset", str(ds), "--model", str(tiny_model_dir), "--heldout", "1", "--tasks", "1",
            "--conditions", "none,parallel:2", "--profile", "test", "--overrides", over, "--out",
            str(tmp_path / "out"), "--json", str(out_json), "--decode-len", "24"]
    assert prof.main(argv) == 0
    assert RehearsalAgent.rehearse_round is before
    rep = json.loads(out_json.read_text())
    assert rep["run"]["task_ids"] == [stand_in[0].id]  # --tasks 1: the first of the set
    none, par = rep["conditions"]["none"], rep["conditions"]["parallel:2"]
    assert {k.split("/")[0] for k in none["parts"] if k != "all"} == {"committed"}
    assert par["parts"]["rehearsal/act"]["rows"] >= 2  # two rehearsals, first turn
    assert par["parts"]["committed/act"]["calls"] >= 1
    for c in (none, par):
        a = c["parts"]["all"]
        assert 0 < a["prefill_s"] + a["decode_s"] <= a["seconds"] + 1e-6
        assert a["seconds"] + c["outside_generate_s"] == pytest.approx(c["wall_s"], abs=0.05)
    assert par["seconds_ratio_vs_none"] > 0 and par["decode_steps_ratio_vs_none"] > 0
    assert set(rep["decode_ms_per_step"]) == {"prompt_tokens", "rows=1", "rows=2"}
    assert "**episode**" in capsys.readouterr().out


def test_bad_model_or_json_path_fail_before_any_work(tmp_path, capsys, monkeypatch):
    """A wrong --model or an unwritable --json is refused before tasks are synthesized or a model loads."""
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "tasks.parquet").write_bytes(b"")  # only its presence is checked before the run
    monkeypatch.setattr(prof, "run", lambda args: pytest.fail("the run started"))
    base = ["--dataset", str(ds), "--profile", "test", "--json", str(tmp_path / "p.json")]
    assert prof.main([*base, "--model", str(tmp_path / "nope")]) == 2
    assert "error" in capsys.readouterr().err
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert prof.main([*base[:-1], str(blocker / "p.json"), "--model", "bundled:smollm2-135m-instruct"]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and len(err.strip().splitlines()) == 1
    assert prof.main([*base, "--out", str(blocker), "--model", "bundled:smollm2-135m-instruct"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a file, not a folder" in err and len(err.strip().splitlines()) == 1
    # a --json over the dataset's own tasks file is refused, and the file kept
    assert prof.main([*base[:-1], str(ds / "tasks.parquet"), "--model", "bundled:smollm2-135m-instruct"]) == 2
    assert "not a .json report would be overwritten" in capsys.readouterr().err
    assert (ds / "tasks.parquet").read_bytes() == b""
    for argv in ([*base, "--out", ""], [*base[:-1], ""]):  # an empty --out / --json: the current folder
        assert prof.main([*argv, "--model", "bundled:smollm2-135m-instruct"]) == 2
        assert " is empty" in capsys.readouterr().err
    # the conditions set rehearsal.mode / n / verifier: an override of them would be silently replaced
    assert prof.main([*base, "--overrides", "rehearsal.n=3", "--model", "bundled:smollm2-135m-instruct"]) == 2
    assert "--overrides sets rehearsal.n, which every condition sets itself" in capsys.readouterr().err
