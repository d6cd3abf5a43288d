"""`LocalStore`: the artifact store on a local folder (development, tests, single-machine runs)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from envace_core.store.base import StoreError, check_key
from envace_core.store.files import CHECKSUMS, atomic_dir, dir_checksums, sha256_bytes


class LocalStore:
    """An artifact store in a local directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create store root {self.root}: {e}") from e

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def uri(self, key: str) -> str:
        return str(self.path(key))

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def check(self) -> None:
        """Raise StoreError unless the root is a writable directory (it was created on open)."""
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreError(f"store root {self.root} is not writable: fix its permissions or store.root")

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
            (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=2, sort_keys=True))

        try:
            atomic_dir(dest, build, exists="replace" if overwrite else "error")
        except FileExistsError:
            raise StoreError(f"artifact {key!r} already exists in {self.root}") from None
        return sums

    def get_dir(self, key: str) -> Path:
        """The directory `key` itself (no copy). Raises StoreError if it is not a directory."""
        p = self.path(key)
        if not p.is_dir():
            raise StoreError(f"artifact directory {key!r} not found in {self.root}")
        return p

    def verify_dir(self, key: str) -> list[str]:
        """Files under `key` whose sha256 no longer matches its CHECKSUMS.json (empty = intact)."""
        dest = self.path(key)
        if not (dest / CHECKSUMS).is_file():
            raise StoreError(f"artifact {key!r} has no CHECKSUMS.json: it was not written by put_dir")
        expected = json.loads((dest / CHECKSUMS).read_text())
        actual = {k: v for k, v in dir_checksums(dest).items() if k != CHECKSUMS}
        return sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Keys of the directories written by put_dir below `prefix` (sorted; temporaries skipped)."""
        base = self.path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        out = []
        for m in base.rglob(CHECKSUMS):
            rel = m.parent.relative_to(self.root)
            if m.is_file() and m.parent != self.root and not any(p.startswith(".") for p in rel.parts):
                out.append(rel.as_posix())
        return sorted(out)
