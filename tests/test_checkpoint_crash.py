"""A checkpoint write killed with SIGKILL at any step: the re-run resumes from the newest complete
checkpoint, ends with exactly the uninterrupted run's metrics, and says what it removed.

`tests.checkpoint_crash_driver` (one subprocess) runs the uninterrupted reference (2 iterations, a
checkpoint after each) counting the steps of its two checkpoint writes (`tests.crash_points`: every
filesystem mutation of the store's put_dir, and step 0 before any), then, for each kill of
`crash_cases` (every step of the second write, which has an older checkpoint beside it; of the
first, the steps that differ in kind), a real training process that kills itself with SIGKILL right
after that step, and the same command re-run. Exact metric equality is right for the reason
tests/test_resume.py gives (CPU kernels, weights restored bit for bit, seeded sampling); only
wall-clock keys differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint_crash_driver import commit_step, crash_cases, crash_config
from tests.test_resume import _deterministic

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def crashes(tiny_model_dir, tmp_path_factory):
    from envace_core.stages.curate import curate

    tmp = tmp_path_factory.mktemp("crash")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        ds = curate(crash_config(tiny_model_dir, tmp / "data", tmp / "registry"))
    job = tmp / "job.json"
    job.write_text(json.dumps({"cwd": str(tmp), "model": str(tiny_model_dir), "dataset": ds,
                               "out": str(tmp / "out.json")}))
    proc = subprocess.run([sys.executable, "-m", "tests.checkpoint_crash_driver", str(job)], cwd=REPO,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                               # the driver forks its training processes: a fork of a process whose OpenMP
                               # pool has started hangs in the child (seen with 2 threads), so one thread
                               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


def test_every_step_of_every_checkpoint_write_was_killed(crashes):
    writes = crashes["writes"]
    assert len(writes) == 2 and all(len(w) >= 5 for w in writes), writes  # a create, then a replace
    assert any(s.startswith("replace(") for s in writes[1]) and any(s.startswith("copyfile(") for s in writes[0])
    assert [r["kill"] for r in crashes["results"]] == [list(c) for c in crash_cases(writes)]
    assert [k for w, k in crash_cases(writes) if w == 2] == list(range(len(writes[1]) + 1))
    assert {r["status"] for r in crashes["results"]} == {"SIGKILL"}
    assert {r["rerun_status"] for r in crashes["results"]} == {0}


def test_the_key_always_names_one_complete_checkpoint(crashes):
    for r in crashes["results"]:
        w, k = r["kill"]
        # before the commit step the previous checkpoint (none before the first), from it on the new one
        want = w if k >= commit_step(crashes["writes"][w - 1]) else (w - 1 or None)
        assert r["after_kill"]["iteration"] == want, (r["kill"], r["after_kill"])


def test_the_rerun_resumes_from_the_newest_complete_checkpoint(crashes):
    adopted = 0
    for r in crashes["results"]:
        left = r["after_kill"]
        # the committed one; with none committed, a complete version the killed write left (it was
        # killed after that version's CHECKSUMS.json, before its pointer)
        newest = left["iteration"] or max(left["complete_siblings"], default=None)
        if newest is None:
            assert "re-run the same command to resume" in r["said"], (r["kill"], r["said"])
        else:
            assert f"resuming run {crashes['run_id']} at iteration {newest + 1} " in r["said"], (r["kill"], r["said"])
        if left["iteration"] is None and newest is not None:
            adopted += 1
            assert "checkpoint recovery:" in r["said"] and "restored the newest complete version" in r["said"]
    assert adopted >= 1  # the first write killed between its manifest and its pointer


def test_the_rerun_has_the_uninterrupted_runs_metrics(crashes):
    want = [_deterministic(h) for h in crashes["history"]]
    assert len(want) == 2 and want[1]["train/grad_norm"] > 0 and want[1]["train/optimizer_steps"] > 0
    for r in crashes["results"]:
        assert [_deterministic(h) for h in r["history"]] == want, r["kill"]


def test_what_a_kill_left_is_removed_and_said(crashes):
    cleaned = 0
    for r in crashes["results"]:
        left, after = r["after_kill"], r["after_rerun"]
        stale = [n for n in left["siblings"] if n != left["pointer"]]
        if stale:
            cleaned += 1
            assert "[train] checkpoint recovery:" in r["said"], (r["kill"], stale, r["said"])
        else:
            assert "checkpoint recovery" not in r["said"], (r["kill"], r["said"])
        # afterwards: the key is a pointer to its one version folder, nothing else beside it
        assert after["iteration"] == 2 and after["siblings"] == [after["pointer"]], (r["kill"], after)
    assert cleaned >= 10
