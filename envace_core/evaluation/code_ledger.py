"""Which code played the episodes an evaluation cache holds.

An evaluation cache folder (`harness.run_eval`'s ``<out>/cache/<fingerprint>``, a benchmark cell's folder)
is keyed by the settings that change episodes (`options.fingerprint`: options, model weights, config), not
by the code: a rerun after an upgrade reuses episodes an older envace played. The ledger makes that visible
instead of silent: each run that plays episodes into the folder appends one line to ``code_versions.jsonl``
there::

    {"date": "<ISO 8601 UTC>", "commit": "<40 hex>" | null, "dirty": true | false | null, "episodes_ran": n}

A folder that already held episodes when its ledger began gets a first line marking them
(``"before_ledger": true``, commit null, 0 episodes; `begin`). `code_version` is the `buildinfo.build_info`
commit (an image's BUILD_INFO.json, else the checkout's ``git rev-parse HEAD``) and whether Python sources
differ from it. `reuse_note` says, after a run that reused cached episodes, when the folder holds episodes
played by other code than the running one, by code with uncommitted changes (the commit does not identify
it), before its ledger began, or more than the ledger accounts for; the caller shows the note and keeps the
episodes (a resumed run must not replay what it paid for). Pass a new ``--out`` to replay them.

The ledger counts episodes per folder, not per episode: when a folder holds episodes of several code
versions, the note names them all, whichever of them a run reused.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

LEDGER_NAME = "code_versions.jsonl"
_BEFORE = "before_ledger"  # the marker line's key: the folder held episodes when its ledger began


@functools.lru_cache(maxsize=1)
def _process_code() -> tuple[str | None, bool | None]:
    from envace_core.buildinfo import git_state, read_build_file

    baked = read_build_file()  # an image's BUILD_INFO.json, as `buildinfo.build_info` reads it first
    if baked is not None and "error" not in baked:
        return baked["commit"], baked["dirty"]
    git = git_state(pathspec=("*.py",))  # only changed Python sources make the code differ (not results or docs)
    return git["commit"], git["dirty"]


def code_version() -> dict[str, Any]:
    """{"commit": 40-hex or None, "dirty": bool or None} of the running code, read once per process: the
    `buildinfo.build_info` commit; in a git checkout "dirty" means a tracked ``*.py`` file differs from
    it (result files and docs a benchmark rewrites do not count), in an image BUILD_INFO.json's flag."""
    commit, dirty = _process_code()
    return {"commit": commit, "dirty": dirty}


def _label(commit: str | None, dirty: bool | None) -> str:
    if not commit:
        return "an unknown commit"
    return commit[:12] + {True: " with uncommitted changes", None: " (uncommitted changes unknown)"}.get(dirty, "")


def _entry(line: str) -> dict[str, Any] | None:
    """A ledger line as {"commit", "dirty", "episodes_ran", "date", "before"}, or None when it is not one."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    commit, dirty, ran, date = rec.get("commit"), rec.get("dirty"), rec.get("episodes_ran"), rec.get("date")
    if not (commit is None or isinstance(commit, str)) or not (dirty is None or isinstance(dirty, bool)):
        return None
    if isinstance(ran, bool) or not isinstance(ran, int) or ran < 0 or not isinstance(date, str):
        return None
    return {"commit": commit or None, "dirty": dirty, "episodes_ran": ran, "date": date,
            "before": rec.get(_BEFORE) is True}


def history(cache_dir: str | Path) -> list[dict[str, Any]]:
    """The ledger's runs merged per code version, oldest first: [{"commit", "dirty", "episodes_ran",
    "first", "last"}] (first/last: the runs' dates), plus {"before_ledger": True, "first"} when the folder
    already held episodes as its ledger began (their code and number unknown). [] when there is no ledger.
    A line that is not a ledger record (damaged, wrong types, a negative count) is skipped."""
    path = Path(cache_dir) / LEDGER_NAME
    try:
        text = path.read_text(encoding="utf-8-sig", errors="replace")
    except OSError:
        return []
    merged: dict[tuple, dict[str, Any]] = {}
    for line in text.splitlines():
        e = _entry(line)
        if e is None:
            continue
        if e["before"]:
            merged.setdefault(("before",), {_BEFORE: True, "first": e["date"]})
            continue
        m = merged.setdefault((e["commit"], e["dirty"]), {"commit": e["commit"], "dirty": e["dirty"],
                                                          "episodes_ran": 0, "first": e["date"], "last": e["date"]})
        m["episodes_ran"] += e["episodes_ran"]
        m["last"] = e["date"]
    return list(merged.values())


def _append(path: Path, line: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        f.seek(0, 2)
        if f.tell():  # a line cut by a crash must not swallow this one
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(line) + "\n").encode())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def begin(cache_dir: str | Path) -> None:
    """Call before a run plays into `cache_dir`: a folder that holds cached episodes (any file) but no
    ledger gets one whose first line marks them as played by unknown code, so that every later reuse
    there is noted (which of them a run reuses cannot be told)."""
    d = Path(cache_dir)
    if (d / LEDGER_NAME).exists() or not d.is_dir() or not any(p.is_file() for p in d.iterdir()):
        return
    _append(d / LEDGER_NAME, {"date": _now(), "commit": None, "dirty": None, "episodes_ran": 0, _BEFORE: True})


def record(cache_dir: str | Path, episodes_ran: int, code: dict[str, Any] | None = None) -> None:
    """Append this run to the folder's ledger (nothing when it played no episode). `code`: default
    `code_version()`. Raises OSError when the ledger cannot be written (callers warn and go on)."""
    if episodes_ran <= 0:
        return
    code = code_version() if code is None else code
    _append(Path(cache_dir) / LEDGER_NAME, {"date": _now(), "commit": code.get("commit"), "dirty": code.get("dirty"),
                                            "episodes_ran": int(episodes_ran)})


def reuse_note(cache_dir: str | Path, reused: int, code: dict[str, Any] | None = None) -> str | None:
    """Why the `reused` episodes a run took from `cache_dir` may not be what the running code would play,
    or None. Call it before `record` adds the run itself.

    None when nothing was reused, or when every episode the ledger counts was played by the running commit
    with a clean tree, the ledger counts at least `reused` episodes and it began on an empty folder
    (`begin`). Otherwise one sentence naming the other code versions with their episode counts, episodes
    cached before the ledger began, and how many reused episodes the ledger does not account for (also
    counted: a run that stopped before recording, or trials that failed and were replayed)."""
    if reused <= 0:
        return None
    code = code_version() if code is None else code
    runs = history(cache_dir)
    same = bool(code.get("commit")) and code.get("dirty") is False
    before = [r for r in runs if r.get(_BEFORE)]
    counted = [r for r in runs if not r.get(_BEFORE)]
    parts = [f"some cached before this ledger began ({r['first'][:10]}; their code is unknown)" for r in before]
    parts += [f"{r['episodes_ran']} at {_label(r['commit'], r['dirty'])} ({r['first'][:10]})" for r in counted
              if not (same and r["commit"] == code["commit"] and r["dirty"] is False)]
    unaccounted = reused - sum(r["episodes_ran"] for r in counted)
    if unaccounted > 0 and not before:
        parts.append(f"{unaccounted} the ledger does not account for (played before it existed, or by a run "
                     "that stopped early)")
    if not parts:
        return None
    return (f"{reused} episodes reused from cache {cache_dir} may come from other code ({'; '.join(parts)}); "
            f"the code now: {_label(code.get('commit'), code.get('dirty'))}; pass a new --out to replay them")
