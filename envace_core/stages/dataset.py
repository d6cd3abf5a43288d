"""The curated dataset on the store: parquet + manifest written by `curate`, read by training and evaluation."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    pass
from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.store.files import CHECKSUMS, changed_files, sha256_bytes
from envace_core.store.uri import open_store
from envace_core.types import Task, ToolCall, ToolSpec


# ----------------------------------------------------------------------------------------- curate
def task_record(t: Task) -> dict[str, Any]:
    rec = {"id": t.id, "domain": t.domain, "split": t.split,
           "first_user_message": t.first_user_message, "user_scenario": t.user_scenario,
           "gold_actions": json.dumps([a.model_dump() for a in t.gold_actions], sort_keys=True),
           "source": json.dumps(t.source, sort_keys=True)}
    # Tool-learning columns only when set, so datasets without them keep their version hash.
    if t.tools_added:
        rec["tools_added"] = json.dumps([s.model_dump() for s in t.tools_added], sort_keys=True)
    if t.tools_hidden:
        rec["tools_hidden"] = json.dumps(sorted(t.tools_hidden))
    return rec


def _json_column(r: dict[str, Any], key: str) -> list:
    v = r.get(key)
    return json.loads(v) if isinstance(v, str) and v else []  # absent, or NaN in a mixed frame


def _json_field(r: dict[str, Any], key: str, kind: type) -> Any:
    """Column `key` of record `r`: a JSON text decoding to a `kind`. Raises KeyError (missing), ValueError
    naming the column (not a string, not JSON, another JSON type)."""
    v = r[key]
    if not isinstance(v, str):
        raise ValueError(f"column {key!r} must be a JSON text, got {type(v).__name__}")
    try:
        out = json.loads(v)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"column {key!r} is not JSON: {e}") from None
    if not isinstance(out, kind):
        raise ValueError(f"column {key!r} must hold a JSON {'list' if kind is list else 'object'}, "
                         f"got {type(out).__name__}")
    return out


def task_from_record(r: dict[str, Any]) -> Task:
    """The `Task` of one record as `task_record` writes it (a row of tasks.parquet). Raises KeyError for a
    missing column, ValueError naming the column for one that does not decode (pydantic's
    ValidationError is a ValueError), TypeError for a gold action that is not an object."""
    gold = _json_field(r, "gold_actions", list)
    if not all(isinstance(a, dict) for a in gold):
        raise ValueError("column 'gold_actions' must be a JSON list of objects")
    return Task(id=r["id"], domain=r["domain"], split=r["split"],
                first_user_message=r["first_user_message"], user_scenario=r["user_scenario"],
                gold_actions=[ToolCall(**a) for a in gold],
                source=_json_field(r, "source", dict),
                tools_added=[ToolSpec(**s) for s in _json_column(r, "tools_added")],
                tools_hidden=_json_column(r, "tools_hidden"))


def _one_line(e: BaseException, limit: int = 300) -> str:
    """`e` as ``Type: message`` on one line (pydantic's messages span lines), at most `limit` characters."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_tasks_file(path: str | Path) -> list[Task]:
    """Every task of a tasks file, all splits: a curated dataset folder (its ``tasks.parquet``), a
    ``tasks.parquet`` itself, or a ``.json`` list of `task_record` records (as
    ``benchmarks/rehearsal_effect.py --heldout`` writes its held-out set).

    Raises EnvaceError naming the path when it is missing, not a regular file, of another kind, unreadable
    (including JSON nested too deep to decode), a dataset folder (or its tasks.parquet) whose files differ
    from the folder's CHECKSUMS.json (naming them), or holds a record that is not a task record (the
    record's index, the column and what is wrong), all on one line."""
    try:
        p = Path(path).expanduser()
        folder = p if p.is_dir() else p.parent if p.name == "tasks.parquet" else None
        if p.is_dir():
            p = p / "tasks.parquet"
        exists, regular = p.exists(), p.is_file()
    except (OSError, RuntimeError) as e:  # a name too long, ~user without a home, ...
        raise EnvaceError(f"tasks file {str(path)[:200]!r} cannot be opened: {_one_line(e)}") from e
    if folder is not None and (folder / CHECKSUMS).is_file():  # a dataset folder as the store wrote it, or its file
        changed = changed_files(folder)
        if changed:
            raise EnvaceError(f"dataset folder {folder} was changed after it was written (files that differ from its "
                              f"{CHECKSUMS}: {', '.join(changed)}): curate it again, or give an intact copy")
    if not exists:
        raise EnvaceError(f"tasks file {p} does not exist: give a curated dataset folder "
                          "(<store>/datasets/<version>), its tasks.parquet, or a .json list of task records")
    if not regular:
        raise EnvaceError(f"tasks file {p} is not a regular file")
    kind = p.suffix.lower()
    if kind not in (".parquet", ".json"):
        raise EnvaceError(f"tasks file {p}: expected tasks.parquet or a .json list of task records")
    try:
        records = pd.read_parquet(p).to_dict("records") if kind == ".parquet" else json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as e:  # pyarrow's and json's decode errors are ValueErrors
        raise EnvaceError(f"tasks file {p} cannot be read: {_one_line(e)}") from e
    if not isinstance(records, list):
        raise EnvaceError(f"tasks file {p}: expected a list of task records, got {type(records).__name__}")
    tasks = []
    for i, r in enumerate(records):
        try:
            if not isinstance(r, dict):
                raise TypeError(f"a {type(r).__name__}, not an object")
            tasks.append(task_from_record(r))
        except (KeyError, TypeError, ValueError) as e:
            raise EnvaceError(f"tasks file {p}: record {i} is not a task record ({_one_line(e)})") from e
    return tasks


def write_dataset(cfg: RunConfig, records: list[dict[str, Any]], gate: Any,
                  manifest: dict[str, Any]) -> dict[str, Any]:
    """Write gated task records (`task_record`) as the dataset `datasets/<version>` of the store.

    `version` = the first 16 hex digits of the sha256 of the records' canonical JSON, so the same
    tasks always get the same version and re-writing one is a no-op; tasks.parquet and
    manifest.json ({"version", **manifest}) go in with one `put_dir`. The passing `gate`'s results
    (`gates.GateResult`) are saved to `validation/dataset/<version>/gate.json`. Used by `curate`
    and tool learning (`tool_learning.adapt`). A dataset of this version already in the store is reused
    after checking its files against their checksums (store.StoreError, naming them, if any changed).
    Returns {"store", "key", "dir", "version",
    "train_version" (the same hash over the train split's records alone: what a warm start depends
    on), "gate", "gate_key"} (`load_dataset` takes it)."""
    version = sha256_bytes(json.dumps(records, sort_keys=True).encode())[:16]
    train = [r for r in records if r["split"] == cfg.data.train_split]
    train_version = sha256_bytes(json.dumps(train, sort_keys=True).encode())[:16]
    store = open_store(cfg.store.root)
    key, gate_key = f"datasets/{version}", f"validation/dataset/{version}/gate.json"
    if store.exists(f"{key}/manifest.json") and store.exists(f"{key}/{CHECKSUMS}"):
        store.get_verified_dir(key)  # reused only if intact (a changed file raises StoreError, naming it)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            pd.DataFrame(records).to_parquet(Path(tmp) / "tasks.parquet", index=False)
            (Path(tmp) / "manifest.json").write_text(json.dumps({"version": version, **manifest}, indent=2))
            store.put_dir(tmp, key)
    store.write_json(gate_key, gate.to_dict())
    return {"store": cfg.store.root, "key": key, "dir": store.uri(key), "version": version,
            "train_version": train_version, "gate": gate.checks, "gate_key": gate_key}


def load_dataset(dataset: dict[str, Any], split: str) -> list[Task]:
    """The tasks of one split of a curated dataset (fetched from the artifact store if remote), its files
    checked against their checksums first. Raises store.StoreError naming the files of a dataset changed
    since curate wrote it, EnvaceError for a missing tasks.parquet."""
    path = open_store(dataset["store"]).get_verified_dir(dataset["key"]) / "tasks.parquet"
    if not path.is_file():
        raise EnvaceError(f"dataset file {path} is missing: re-run the curate stage")
    df = pd.read_parquet(path)
    return [task_from_record(r) for r in df[df["split"] == split].to_dict("records")]
