"""Files: content hashes, per-directory checksums, atomic writes, "can this be written" checks made before a run,
and the JSONL reader shared by the resume caches."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def dir_checksums(directory: str | Path) -> dict[str, str]:
    """sha256 of every file below `directory`, keyed by POSIX relative path (sorted)."""
    root = Path(directory)
    return {p.relative_to(root).as_posix(): sha256_path(p)
            for p in sorted(root.rglob("*")) if p.is_file()}


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary sibling renamed into place (parent folders made):
    a reader sees the old file or the new one, never half of it. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def writable_dir_problem(directory: str | Path) -> str | None:
    """Why files cannot be written in `directory` (made, with its parents, if missing), or None when they can.

    Tried with a temporary file, not `os.access`, which says yes on read-only mounts and on /proc for root. A
    tool calls this before any model loads, so that a report or a cache it cannot write never costs a run."""
    d = Path(directory).expanduser()
    try:
        if d.exists() and not d.is_dir():
            return f"{d} is a file, not a folder"
    except OSError as e:  # a name longer than the file system allows (ENAMETOOLONG), ...
        return f"cannot use the path {str(d)[:80]}{'…' if len(str(d)) > 80 else ''} ({e.strerror or e})"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot make the folder {d} ({e.strerror or e})"
    try:
        tempfile.TemporaryFile(dir=d).close()
    except OSError as e:
        return f"cannot write in the folder {d} ({e.strerror or e})"
    return None


def writable_file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be written as a file, or None when it can: a folder is refused, its parent folder is
    made and tried as `writable_dir_problem` does, and an existing file is opened for appending (nothing
    written, its content and times unchanged)."""
    p = Path(path).expanduser()
    try:
        if p.is_dir():
            return "a folder; give a file path"
    except OSError as e:  # a name longer than the file system allows (ENAMETOOLONG), ...
        return f"cannot use the path ({e.strerror or e})"
    why = writable_dir_problem(p.parent)
    if why is None and p.exists():
        try:
            open(p, "a").close()
        except OSError as e:
            why = f"cannot write the file ({e.strerror or e})"
    return why


def report_overwrite_problem(path: str | Path, kind: str) -> str | None:
    """Why writing a report of `kind` ("json": a JSON object, rewritten whole; "md": markdown, appended to) at
    `path` would damage a file that is not such a report, or None: an existing file whose name does not end
    in ``.json`` / ``.md``, or for "json" whose content is not a JSON object (a dataset's tasks.parquet, a
    RESULTS.md, a task list). A missing file or a folder is left to `writable_file_problem`."""
    import json

    p = Path(path).expanduser()
    try:
        if not p.is_file():
            return None
    except OSError:  # a name the file system refuses: no file there to damage
        return None
    if p.suffix != f".{kind}":
        return f"an existing file that is not a .{kind} report would be " + (
            "appended to" if kind == "md" else "overwritten") + "; give a new path"
    if kind == "json":
        try:
            ok = isinstance(json.loads(p.read_text()), dict)
        except (OSError, UnicodeDecodeError, ValueError):
            ok = False
        if not ok:
            return "an existing file that is not a JSON report (an object) would be overwritten; give a new path"
    return None


def read_jsonl(path: Path, check: Callable[[Any], Any] | None = None) -> list:
    """The records of a JSONL cache, each passed through `check` (which raises ValueError / TypeError /
    KeyError on a record of the wrong shape, e.g. a pydantic ValidationError). A line that is not JSON (cut
    by a kill mid-write) or has the wrong shape is skipped, so that work is redone; one warning per file
    names it (the evaluation harness and evaluation.tau2 resume caches)."""
    if not path.is_file():
        return []
    out, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(check(rec) if check else rec)
        except (ValueError, TypeError, KeyError, AttributeError):  # JSONDecodeError is a ValueError
            bad += 1
    if bad:
        warnings.warn(f"eval cache {path}: skipped {bad} malformed line(s); recomputing those entries",
                      RuntimeWarning, stacklevel=2)
    return out


def atomic_dir(final: str | Path, build: Callable[[Path], None], exists: str = "replace") -> Path:
    """Build a directory with `build(tmp)` in a temporary sibling of `final`, then rename it into place.

    A reader never sees a half-built directory and a failed or killed build leaves nothing under
    `final`. `exists` says what to do when `final` already exists: "replace" (swap it out only
    after the new one is complete), "keep" (return it without building), or "error" (raise
    FileExistsError; also raised if another writer creates it meanwhile).
    """
    final = Path(final)
    if final.exists() and exists != "replace":
        if exists == "keep":
            return final
        raise FileExistsError(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        if final.exists() and exists == "replace":
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, trash / final.name)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.rename(tmp, final)  # fails if another writer got there first
            except OSError:
                if exists == "keep" and final.is_dir():
                    shutil.rmtree(tmp, ignore_errors=True)
                    return final
                raise FileExistsError(final) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


CHECKSUMS = "CHECKSUMS.json"  # the per-directory manifest {relpath: sha256}; on S3 also the commit object


def changed_files(folder: str | Path) -> list[str]:
    """Files of `folder` whose sha256 differs from its CHECKSUMS.json, missing and extra ones included (sorted
    relative paths; empty = intact), or ``[CHECKSUMS.json]`` when that file cannot be read or is not a JSON
    object of {relpath: sha256}."""
    folder = Path(folder)
    try:
        expected = json.loads((folder / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return [CHECKSUMS]
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        return [CHECKSUMS]
    actual = {k: v for k, v in dir_checksums(folder).items() if k != CHECKSUMS}
    return sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))


def cache_root() -> Path:
    """Where envace caches derived files (dequantised models, S3 downloads): $ENVACE_CACHE or ~/.cache/envace."""
    return Path(os.environ.get("ENVACE_CACHE", Path.home() / ".cache" / "envace"))
