"""Crash injection for checkpoint tests: count the filesystem mutations of a store's `put_dir` and
SIGKILL the process right after the k-th one.

A *step* is one outermost call, made while `LocalStore.put_dir` of a checkpoint key runs, to one of
`MUTATIONS` (a directory made, a file copied or written, a rename, a symlink, a removal); calls
nested inside a counted one (``os.makedirs`` -> ``os.mkdir``, ``shutil.rmtree`` -> ``os.unlink``)
are part of it. Step 0 is the entry of `put_dir`, before it changes anything (what a kill during
the trainer's local build leaves in the store). `install(kill=(w, k))` kills the process with
SIGKILL right after step k of the w-th checkpoint `put_dir` (1-based), so nothing after it runs:
no `finally`, no `except BaseException` clean-up, no atexit. `install()` only records the steps
(`WRITES`: one list of step labels per checkpoint write).
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import signal

MUTATIONS = [(os, "mkdir"), (os, "makedirs"), (os, "rename"), (os, "replace"), (os, "symlink"),
             (os, "unlink"), (os, "rmdir"), (shutil, "copyfile"), (shutil, "rmtree"),
             (pathlib.Path, "write_text"), (pathlib.Path, "write_bytes")]

WRITES: list[list[str]] = []
_state = {"active": False, "depth": 0, "kill": None}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _step(label: str) -> None:
    steps = WRITES[-1]
    steps.append(label)
    if _state["kill"] == (len(WRITES), len(steps)):
        _die()


def _counted(owner, name: str):
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        if not _state["active"] or _state["depth"]:
            return real(*args, **kwargs)
        _state["depth"] += 1
        try:
            out = real(*args, **kwargs)
        finally:
            _state["depth"] -= 1
        _step(f"{name}({', '.join(os.path.basename(str(a)) for a in args[:2])})")
        return out

    return wrapper


def install(kill: tuple[int, int] | None = None) -> list[tuple[object, str, object]]:
    """Patch the mutations and `LocalStore.put_dir` (for keys ending in "/checkpoint") in this
    process; returns the (owner, name, original) triples that `uninstall` puts back."""
    from envace_core.store.local import LocalStore

    _state["kill"] = kill
    WRITES.clear()
    saved = [(owner, name, getattr(owner, name)) for owner, name in MUTATIONS]
    saved.append((LocalStore, "put_dir", LocalStore.put_dir))
    for owner, name in MUTATIONS:
        setattr(owner, name, _counted(owner, name))
    real_put = LocalStore.put_dir

    @functools.wraps(real_put)
    def put_dir(self, local_dir, key, *args, **kwargs):
        if not key.endswith("/checkpoint"):
            return real_put(self, local_dir, key, *args, **kwargs)
        WRITES.append([])
        if _state["kill"] == (len(WRITES), 0):
            _die()
        _state["active"] = True
        try:
            return real_put(self, local_dir, key, *args, **kwargs)
        finally:
            _state["active"] = False

    LocalStore.put_dir = put_dir
    return saved


def uninstall(saved: list[tuple[object, str, object]]) -> None:
    for owner, name, real in saved:
        setattr(owner, name, real)
