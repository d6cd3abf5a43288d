"""The artifact store: checkpoints, datasets and models, written atomically with sha256 checksums.

A store is addressed by a root (a local directory today; `s3://` arrives with the S3 backend).
Keys are POSIX relative paths ("datasets/<hash>/train.parquet"). Every write lands in a temporary
sibling first and is renamed into place, so a reader never sees a half-written artifact and a
killed writer leaves nothing behind under the final key.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from envace_core import EnvaceError


class StoreError(EnvaceError):
    """An artifact is missing, corrupt, or the store root is unusable."""


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


def _check_key(key: str) -> str:
    parts = Path(key).parts
    if not key or Path(key).is_absolute() or ".." in parts:
        raise StoreError(f"invalid artifact key {key!r}: use a relative path without '..'")
    return key


class LocalStore:
    """An artifact store in a local directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create store root {self.root}: {e}") from e

    def path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def uri(self, key: str) -> str:
        return str(self.path(key))

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def write_bytes(self, key: str, data: bytes) -> str:
        """Atomically write `data` under `key`; returns its sha256."""
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return sha256_bytes(data)

    def write_json(self, key: str, obj: Any) -> str:
        return self.write_bytes(key, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def read_bytes(self, key: str) -> bytes:
        p = self.path(key)
        if not p.is_file():
            raise StoreError(f"artifact {key!r} not found in {self.root}")
        return p.read_bytes()

    def read_json(self, key: str) -> Any:
        try:
            return json.loads(self.read_bytes(key))
        except json.JSONDecodeError as e:
            raise StoreError(f"artifact {key!r} in {self.root} is not valid JSON (corrupt?): {e}") from e

    def put_dir(self, local_dir: str | Path, key: str, overwrite: bool = True) -> dict[str, str]:
        """Copy a directory under `key` atomically (copy to a temp sibling, then rename).

        Returns the sha256 of every file. Raises StoreError if `key` exists and not `overwrite`.
        """
        dest = self.path(key)
        sums: dict[str, str] = {}

        def build(tmp: Path) -> None:
            shutil.copytree(local_dir, tmp, dirs_exist_ok=True)
            sums.update(dir_checksums(tmp))
            (tmp / "CHECKSUMS.json").write_text(json.dumps(sums, indent=2, sort_keys=True))

        try:
            atomic_dir(dest, build, exists="replace" if overwrite else "error")
        except FileExistsError:
            raise StoreError(f"artifact {key!r} already exists in {self.root}") from None
        return sums

    def verify_dir(self, key: str) -> list[str]:
        """Files under `key` whose sha256 no longer matches its CHECKSUMS.json (empty = intact)."""
        dest = self.path(key)
        if not (dest / "CHECKSUMS.json").is_file():
            raise StoreError(f"artifact {key!r} has no CHECKSUMS.json: it was not written by put_dir")
        expected = json.loads((dest / "CHECKSUMS.json").read_text())
        actual = {k: v for k, v in dir_checksums(dest).items() if k != "CHECKSUMS.json"}
        return sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))


def open_store(root: str) -> LocalStore:
    """Open the artifact store named by config (`store.root`)."""
    if root.startswith("s3://"):
        raise StoreError("S3 artifact stores are not available in this version; use a local directory")
    return LocalStore(root)
