"""Which code played the episodes an evaluation cache holds.

An evaluation cache folder (`harness.run_eval`'s ``<out>/cache/<fingerprint>``, a benchmark cell's folder)
is keyed by the settings that change episodes (`options.fingerprint`: options, model weights, config), not
by the code: a rerun after an upgrade reuses episodes an older envace played. The ledger makes that visible
instead of silent: each run that plays episodes into the folder appends one line to ``code_versions.jsonl``
there::

    {"date": "<ISO 8601 UTC>", "commit": "<40 hex>" | null, "dirty": true | false | null, "episodes_ran": n}

`code_version` is the `buildinfo.build_info` commit (an image's BUILD_INFO.json, else the checkout's
``git rev-parse HEAD``) and its dirty flag. `reuse_note` says, after a run that reused cached episodes,
when the folder holds episodes played by other code than the running one, by code with uncommitted changes
(the commit does not identify it), or that the ledger does not account for; the caller shows the note and
keeps the episodes (a resumed run must not replay what it paid for). Pass a new ``--out`` to replay them.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

LEDGER_NAME = "code_versions.jsonl"


@functools.lru_cache(maxsize=1)
def _process_code() -> tuple[str | None, bool | None]:
    from envace_core.buildinfo import build_info

    info = build_info()
    return info.get("commit"), info.get("dirty")


def code_version() -> dict[str, Any]:
    """{"commit": 40-hex or None, "dirty": bool or None} of the running code (read once per process)."""
    commit, dirty = _process_code()
    return {"commit": commit, "dirty": dirty}


def _label(commit: str | None, dirty: bool | None) -> str:
    if commit is None:
        return "an unknown commit"
    return commit[:12] + (" with uncommitted changes" if dirty or dirty is None else "")


def history(cache_dir: str | Path) -> list[dict[str, Any]]:
    """The ledger's runs merged per code version, oldest first: [{"commit", "dirty", "episodes_ran",
    "first", "last"}] (first/last: the runs' dates). [] when there is no ledger. A line that is not a
    ledger record (a damaged file) is skipped."""
    path = Path(cache_dir) / LEDGER_NAME
    if not path.is_file():
        return []
    merged: dict[tuple, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            key = (rec["commit"], rec["dirty"])
            ran = int(rec["episodes_ran"])
            date = str(rec["date"])
        except (ValueError, TypeError, KeyError):
            continue
        m = merged.setdefault(key, {"commit": key[0], "dirty": key[1], "episodes_ran": 0,
                                    "first": date, "last": date})
        m["episodes_ran"] += ran
        m["last"] = date
    return list(merged.values())


def record(cache_dir: str | Path, episodes_ran: int, code: dict[str, Any] | None = None) -> None:
    """Append this run to the folder's ledger (nothing when it played no episode). `code`: default
    `code_version()`."""
    if episodes_ran <= 0:
        return
    code = code_version() if code is None else code
    path = Path(cache_dir) / LEDGER_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": code.get("commit"), "dirty": code.get("dirty"), "episodes_ran": int(episodes_ran)}
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def reuse_note(cache_dir: str | Path, reused: int, code: dict[str, Any] | None = None) -> str | None:
    """Why the `reused` episodes a run took from `cache_dir` may not be what the running code would play,
    or None. Call it before `record` adds the run itself.

    None when nothing was reused, or when every episode the ledger counts was played by the running commit
    with a clean tree and the ledger counts at least `reused` episodes. Otherwise one sentence naming the
    other code versions with their episode counts, and how many reused episodes the ledger does not account
    for."""
    if reused <= 0:
        return None
    code = code_version() if code is None else code
    runs = history(cache_dir)
    same = code.get("commit") is not None and code.get("dirty") is False
    other = [r for r in runs if not (same and r["commit"] == code["commit"] and r["dirty"] is False)]
    parts = [f"{r['episodes_ran']} at {_label(r['commit'], r['dirty'])} ({r['first'][:10]})" for r in other]
    unaccounted = reused - sum(r["episodes_ran"] for r in runs)
    if unaccounted > 0:
        parts.append(f"{unaccounted} the ledger does not account for (played before it existed, or by a run "
                     "that stopped early)")
    if not parts:
        return None
    return (f"{reused} episodes reused from cache {cache_dir} were played by other or unidentified code "
            f"({'; '.join(parts)}); the code now: {_label(code.get('commit'), code.get('dirty'))}; "
            "pass a new --out to replay them")
