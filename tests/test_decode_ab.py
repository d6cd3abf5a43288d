"""benchmarks/decode_ab.py end to end on the tiny random Llama with --quick sizes (plumbing and JSON, not
speed): three variants in their own processes, the before tree from a git worktree that is removed after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_loader import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_benchmark("decode_ab")


def _worktrees() -> list[str]:
    """This benchmark's worktrees (its temporary folder's prefix): the other benchmark's test, running beside this
    one under pytest-xdist, adds and removes its own."""
    out = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "envace-decode-ab-" in line]


def test_quick_run_writes_every_variant_and_removes_its_worktree(tiny_model_dir, tmp_path):
    before = _worktrees()
    out = tmp_path / "ab.json"
    assert _bench().main(["--before", "HEAD", "--quick", "--lora", "4", "--model", str(tiny_model_dir),
                          "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["summary"]) == {"g8", "distinct8", "g1", "root2"}  # --quick: 2 distinct prompts
    for row in rep["summary"].values():
        assert set(row) >= {"before", "after", "unfused", "after_over_before", "after_over_unfused"}
        assert all(row[v]["exact_length"] and row[v]["seconds"] > 0 for v in ("before", "after", "unfused"))
        assert row["after_over_before"]["seconds"] == pytest.approx(row["after"]["seconds"] / row["before"]["seconds"])
    assert rep["details"]["before"] == "HEAD" and rep["details"]["lora"] == 4 and len(rep["runs"]["after"]) == 1
    assert _worktrees() == before


def test_bad_arguments_stop_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--before", "no-such-revision-xyz", "--json", str(tmp_path / "x.json")])
    assert "not a git revision" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _bench().main(["--max-new", "1"])
    with pytest.raises(SystemExit):
        _bench().main(["--lora", "-1"])
    assert not (tmp_path / "x.json").exists()
    for argv, msg in ((["--before", ""], "--before is empty"), (["--json", ""], "--json: is empty"),
                      (["--json", str(tmp_path)], "is a folder")):
        with pytest.raises(SystemExit) as e:
            _bench().main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def _stopped_by_sigterm(where: Path, body: str, stops: tuple[str, ...]) -> None:
    """Runs `body` (Python after ``import decode_ab``; it prints each line of `stops` when it gets there) in a child
    process, sends SIGTERM as each line arrives, and checks that the child exits 143 and the worktree at `where` is
    gone from disk and from ``git worktree list``."""
    code = (f"import os, sys, time\nsys.path.insert(0, {str(ROOT / 'benchmarks')!r})\nimport decode_ab\n" + body)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in stops:
            assert proc.stdout.readline().strip() == line
            proc.terminate()
        assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
    assert not where.exists()
    assert not [line for line in _worktrees() if where.parent.name in line]


def test_sigterm_removes_the_worktree_and_temp_folder(tmp_path):
    """A benchmark stopped by SIGTERM (kill, timeout) unwinds: its before-worktree and temporary folder go."""
    where = tmp_path / "envace-decode-ab-sigterm" / "before"
    _stopped_by_sigterm(where, (f"with decode_ab.detached_worktree('HEAD', {str(where)!r}) as w:\n"
                                "    assert os.path.isdir(w)\n"
                                "    print('ready', flush=True)\n"
                                "    time.sleep(60)\n"), ("ready",))


def test_second_sigterm_does_not_cut_the_cleanup_short(tmp_path):
    """Two SIGTERMs in a row (an impatient `kill`, a supervisor's retry): the first unwinds, the second is ignored
    while the worktree is removed."""
    where = tmp_path / "envace-decode-ab-sigterm2" / "before"
    _stopped_by_sigterm(where, ("real = decode_ab.remove_worktree\n"
                                "def slow(*a, **k):\n"
                                "    print('cleaning', flush=True)\n"
                                "    time.sleep(1.5)\n"
                                "    real(*a, **k)\n"
                                "decode_ab.remove_worktree = slow\n"
                                "with decode_ab.sigterm_unwinds():\n"
                                f"    with decode_ab.detached_worktree('HEAD', {str(where)!r}) as w:\n"
                                "        print('ready', flush=True)\n"
                                "        time.sleep(60)\n"), ("ready", "cleaning"))


def test_worktree_path_that_exists_is_refused_and_left_alone(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty folder"), _bench().detached_worktree("HEAD", str(busy)):
        pass
    assert (busy / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    with _bench().detached_worktree("HEAD", str(empty)) as w:
        assert (Path(w) / "pyproject.toml").is_file()
    assert empty.is_dir() and not any(empty.iterdir())  # it was there before: emptied, kept
