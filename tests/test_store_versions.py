"""LocalStore's versioned directories: one atomic pointer swap per put_dir, and `recover_dir` for
whatever a kill left (SIGKILL at every step of a write, in a forked process: no clean-up runs)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from envace_core.store.local import LocalStore
from tests import crash_points

KEY = "runs/r/checkpoint"  # crash_points counts the steps of put_dirs of keys ending in /checkpoint


def _src(tmp_path: Path, name: str, it: int) -> Path:
    d = tmp_path / name
    (d / "adapter").mkdir(parents=True)
    (d / "adapter" / "w.bin").write_bytes(bytes([it]) * 100)
    (d / "state.json").write_text(json.dumps({"iteration": it}))
    return d


def _steps(tmp_path: Path, prepare, src: Path) -> list[str]:
    root = tmp_path / "count"
    prepare(root)
    saved = crash_points.install()
    try:
        LocalStore(root).put_dir(src, KEY)
    finally:
        crash_points.uninstall(saved)
    return crash_points.WRITES[0]


def _killed_put_dir(root: Path, src: Path, k: int) -> None:
    pid = os.fork()
    if pid == 0:  # the writer: SIGKILLed right after step k of its put_dir
        try:
            crash_points.install(kill=(1, k))
            LocalStore(root).put_dir(src, KEY)
        finally:
            os._exit(0)
    status = os.waitpid(pid, 0)[1]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, k


def _iteration(store: LocalStore):
    return store.read_json(f"{KEY}/state.json")["iteration"] if store.exists(f"{KEY}/state.json") else None


def _beside(store: LocalStore) -> list[str]:
    return sorted(p.name for p in store.path("runs/r").iterdir()) if store.path("runs/r").is_dir() else []


def _fresh(root: Path) -> None:
    LocalStore(root)


def _committed(tmp_path):
    def prepare(root: Path) -> None:
        LocalStore(root).put_dir(_src(tmp_path / "v1", root.name, 1), KEY)
    return prepare


def _legacy(tmp_path):
    def prepare(root: Path) -> None:  # a real directory, as the two-rename code wrote it
        LocalStore(root).put_dir(_src(tmp_path / "v1", root.name, 1), KEY)
        d = LocalStore(root).path(KEY)
        target = d.parent / os.readlink(d)
        d.unlink()
        target.rename(d)
    return prepare


@pytest.mark.parametrize("case", ["create", "replace", "replace_legacy_directory"])
def test_a_write_killed_at_any_step_leaves_one_complete_version_and_recovers(tmp_path, case):
    prepare = {"create": _fresh, "replace": _committed(tmp_path), "replace_legacy_directory": _legacy(tmp_path)}[case]
    old = None if case == "create" else 1
    src = _src(tmp_path, "v2", 2)
    steps = _steps(tmp_path, prepare, src)
    assert any(s.startswith(("replace(", "symlink(")) for s in steps), steps
    seen = set()
    for k in range(len(steps) + 1):
        root = tmp_path / f"k{k}"
        prepare(root)
        _killed_put_dir(root, src, k)
        store = LocalStore(root)
        now = _iteration(store)
        # never a half-written checkpoint; a vanished one only in the one-time move of a directory
        # from before versioned writes aside (its rename, before the pointer swap), restored below
        moved = [i for i, st in enumerate(steps, 1) if st.startswith(("rename(checkpoint", "replace("))]
        migrating = case == "replace_legacy_directory" and moved[0] <= k < moved[-1]
        assert now in (old, 2) or (migrating and now is None), (k, steps[:k])
        if now is not None:
            assert store.verify_dir(KEY) == []
        key = store.path(KEY)
        pointer = os.readlink(key) if key.is_symlink() else None
        stale = [n for n in _beside(store) if n not in ("checkpoint", pointer)]
        notes = store.recover_dir(KEY)
        after = _iteration(store)
        # the committed version stays; with none committed (the legacy directory moved aside, a
        # first write before its pointer) the newest complete version left is restored
        assert after == now or (now is None and after in (old, 2)), (k, now, after)
        assert not migrating or after == 2, k  # the newest complete version: the one being written
        assert bool(notes) == bool(stale), (k, stale, notes)  # said exactly when something was left
        pointer = os.readlink(key) if key.is_symlink() else None
        assert _beside(store) == ([] if after is None else sorted(["checkpoint"] + [pointer] * bool(pointer))), k
        if after is not None:
            assert store.verify_dir(KEY) == []
        assert store.recover_dir(KEY) == []  # nothing left the second time
        store.put_dir(_src(tmp_path / f"v3-{k}", "s", 3), KEY)  # and the key takes new writes
        assert _iteration(store) == 3 and len(_beside(store)) == 2
        seen.add((now, after))
    assert (2, 2) in seen and (old, old) in seen  # both sides of the commit were hit


def test_what_the_two_rename_code_left_is_recovered(tmp_path):
    """Killed between its two renames: no key, the old version in .<name>.old-*/<name>, the new
    complete one in .<name>.tmp-*; the newest complete one becomes the key, the rest goes."""
    store = LocalStore(tmp_path / "store")
    parent = store.path("runs/r")
    parent.mkdir(parents=True)
    for where, it, t in ((parent / ".checkpoint.old-a1b2c3d4" / "checkpoint", 1, 1_000), (parent / ".checkpoint.tmp-x9y8z7w6", 2, 2_000)):
        src = _src(tmp_path / f"s{it}", "d", it)
        tmp = LocalStore(tmp_path / f"tmp{it}")
        tmp.put_dir(src, "d")
        import shutil
        shutil.copytree(tmp.path("d"), where)
        os.utime(where / "CHECKSUMS.json", (t, t))
    partial = parent / ".checkpoint.tmp-p4r7i4l0"
    partial.mkdir()
    (partial / "state.json").write_text("{")  # a build killed before its CHECKSUMS.json
    assert not store.exists(f"{KEY}/state.json")
    notes = store.recover_dir(KEY)
    assert _iteration(store) == 2 and store.verify_dir(KEY) == []
    assert any("restored the newest complete version it left (.checkpoint.tmp-x9y8z7w6)" in n for n in notes), notes
    assert sum("removed" in n for n in notes) == 2, notes  # the old version and the partial build
    assert _beside(store) == sorted(["checkpoint", os.readlink(store.path(KEY))])
    assert store.list_dirs() == [KEY]


def test_readers_see_a_pointer_and_listing_follows_it(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put_dir(_src(tmp_path, "a", 1), KEY)
    store.put_dir(_src(tmp_path, "b", 2), KEY)
    assert store.path(KEY).is_symlink() and _iteration(store) == 2
    assert (store.get_dir(KEY) / "adapter" / "w.bin").read_bytes() == bytes([2]) * 100
    assert store.list_dirs() == [KEY] == store.list_dirs("runs")
    assert len(_beside(store)) == 2 and store.recover_dir(KEY) == []
    with pytest.raises(Exception, match="already exists"):
        store.put_dir(_src(tmp_path, "c", 3), KEY, overwrite=False)
    assert _iteration(store) == 2 and len(_beside(store)) == 2
