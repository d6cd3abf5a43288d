"""`LocalStore`: the artifact store on a local folder (development, tests, single-machine runs).

A directory written by `put_dir` lives in a hidden version folder beside its key,
``.<name>.v-<token>/`` (its files, then CHECKSUMS.json last), and the key itself is a symlink to
it: the pointer. Replacing a directory is one atomic step, `os.replace` of a fresh symlink over
the key (POSIX rename(2)), so at every instant the key names one complete version, the old or the
new; the old version folder is removed afterwards. A kill at any point leaves at most hidden
leftovers (a partial or unreferenced version folder, a temporary link), never a missing key;
`recover_dir` removes them, and re-links the newest complete version when the key itself is
missing (a real directory from before versioned writes being moved aside, or a write by the
earlier two-rename code: ``.<name>.tmp-*`` / ``.<name>.old-*/<name>``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from envace_core.store.base import StoreError, check_key
from envace_core.store.files import CHECKSUMS, changed_files, dir_checksums, sha256_bytes, writable_dir_problem

# hidden siblings of a put_dir key `name`: version folders (v), temporary links (link) and what the
# earlier two-rename writes left (tmp: a build, old: the swapped-out version inside `old-*/<name>`)
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>v|link|tmp|old)-[A-Za-z0-9_]+$")


def _token() -> str:
    """A fresh version token: nanoseconds since the epoch (hex) + 32 random bits."""
    return f"{time.time_ns():x}{secrets.token_hex(4)}"


def _complete(folder: Path) -> bool:
    """True when `folder` holds a CHECKSUMS.json that parses and that every file matches."""
    return not changed_files(folder)


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


class LocalStore:
    """An artifact store in a local directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        try:
            if self.root.exists() and not self.root.is_dir():
                raise StoreError(f"store root {self.root} is a file, not a folder: give a folder as store.root")
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
        """Raise StoreError unless the root is a writable directory (it was created on open; tried with a
        temporary file: `os.access` says yes on read-only mounts for root)."""
        why = writable_dir_problem(self.root)
        if why:
            raise StoreError(f"store root {self.root} is not writable ({why}): fix its permissions or store.root")

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
        """Copy a directory under `key` atomically: into a new version folder, then one atomic
        pointer swap (module docstring); a replaced version is removed after the swap.

        Returns the sha256 of every file (CHECKSUMS.json itself excluded). Raises StoreError if
        `key` exists and not `overwrite` (also when another writer creates it meanwhile).
        """
        dest = self.path(key)
        if not overwrite and (dest.exists() or dest.is_symlink()):
            raise StoreError(f"artifact {key!r} already exists in {self.root}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        version = dest.parent / f".{dest.name}.v-{_token()}"
        try:
            shutil.copytree(local_dir, version)
            sums = {k: v for k, v in dir_checksums(version).items() if k != CHECKSUMS}
            (version / CHECKSUMS).write_text(json.dumps(sums, indent=2, sort_keys=True))  # complete
            old = self._point(dest, version, overwrite)  # committed
        except BaseException:
            shutil.rmtree(version, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return sums

    def _point(self, dest: Path, version: Path, overwrite: bool) -> Path | None:
        """Make `dest` a symlink to its sibling `version` in one atomic step; returns the version
        folder it pointed to before (to remove), or None."""
        try:
            os.symlink(version.name, dest)  # a new key; fails if it exists (or another writer got there first)
            return None
        except FileExistsError:
            if not overwrite:
                raise StoreError(f"artifact {dest.relative_to(self.root).as_posix()!r} already exists "
                                 f"in {self.root}") from None
        old = dest.parent / os.readlink(dest) if dest.is_symlink() else None
        if dest.is_dir() and not dest.is_symlink():  # a real directory from before versioned writes:
            old = dest.parent / f".{dest.name}.v-{_token()}"  # it becomes a version (recover_dir
            os.rename(dest, old)  # re-links it, should a kill come before the swap below)
        link = dest.parent / f".{dest.name}.link-{_token()}"
        os.symlink(version.name, link)
        os.replace(link, dest)
        return old

    def recover_dir(self, key: str) -> list[str]:
        """Finish or clean up what interrupted `put_dir` writes of `key` left (module docstring).

        When `key` is missing or its pointer dangles, the newest complete leftover version (its
        CHECKSUMS.json written last and every file matching it; newest by that file's mtime) is
        linked as `key`. Every other leftover beside `key` (partial or superseded versions,
        temporary links) is removed. Returns one line per action, for the caller to print (empty:
        nothing was left). Call it only while no `put_dir` of `key` is in flight.
        """
        dest = self.path(key)
        if not dest.parent.is_dir():
            return []
        left = sorted(p for p in dest.parent.iterdir()
                      if (m := _SIBLING.match(p.name)) and m["name"] == dest.name)
        notes: list[str] = []
        current = dest.resolve() if dest.is_dir() else None
        if current is None:
            found = [f for f in map(lambda p: self._version_in(p, dest.name), left) if f is not None]
            if found:
                newest = max(found, key=lambda f: ((f / CHECKSUMS).stat().st_mtime_ns, f.name))
                version = newest
                if newest.parent != dest.parent or _SIBLING.match(newest.name)["kind"] != "v":
                    version = dest.parent / f".{dest.name}.v-{_token()}"  # a leftover of the old code
                    os.rename(newest, version)
                link = dest.parent / f".{dest.name}.link-{_token()}"
                os.symlink(version.name, link)
                os.replace(link, dest)
                current = version.resolve()
                notes.append(f"{self.uri(key)} was missing after an interrupted write: restored the newest "
                             f"complete version it left ({newest.relative_to(dest.parent).as_posix()})")
        for p in left:
            if current is not None and not p.is_symlink() and p.resolve() == current:
                continue  # the version the key points at (temporary links always go)
            if p.exists() or p.is_symlink():
                _remove(p)
                notes.append(f"removed {p.relative_to(self.root).as_posix()}, left in the store by an "
                             "interrupted or superseded write")
        return notes

    def get_dir(self, key: str) -> Path:
        """The directory `key` itself (no copy). Raises StoreError if it is not a directory."""
        p = self.path(key)
        if not p.is_dir():
            raise StoreError(f"artifact directory {key!r} not found in {self.root}")
        return p

    def verify_dir(self, key: str) -> list[str]:
        """Files under `key` whose sha256 no longer matches its CHECKSUMS.json, missing or extra ones
        included (empty = intact); ``[CHECKSUMS.json]`` when that file is no longer a JSON object of
        {relpath: sha256}. Raises StoreError if `key` has no CHECKSUMS.json."""
        dest = self.path(key)
        if not (dest / CHECKSUMS).is_file():
            raise StoreError(f"artifact {key!r} has no CHECKSUMS.json: it was not written by put_dir")
        return changed_files(dest)

    def get_verified_dir(self, key: str) -> Path:
        """`get_dir`, after checking every file against the directory's CHECKSUMS.json (`verify_dir`).

        Raises StoreError naming the files that changed, went missing or appeared since `put_dir`
        wrote the directory (nothing is changed: the caller decides; the message says to move it aside)."""
        d = self.get_dir(key)
        bad = self.verify_dir(key)
        if bad:
            real = d.resolve()
            where = f"move {d} aside" if real == d else \
                f"delete {d} (a link) and move the folder it names, {real}, aside"
            raise StoreError(f"artifact {key!r} in {self.root} was changed after it was written (files that differ "
                             f"from its {CHECKSUMS}: {', '.join(bad)}); envace neither uses nor overwrites it: {where} "
                             "(or delete it) so that the stage that wrote it writes it again")
        return d

    @staticmethod
    def _version_in(leftover: Path, name: str) -> Path | None:
        """The complete version folder a leftover sibling holds (an old-* trash folder holds it as
        `<name>`), or None (a link, a partial build)."""
        kind = _SIBLING.match(leftover.name)["kind"]
        folder = leftover / name if kind == "old" else leftover
        if kind == "link" or folder.is_symlink() or not folder.is_dir():
            return None
        return folder if _complete(folder) else None

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Keys of the directories written by put_dir below `prefix` (sorted; hidden version
        folders and temporaries skipped, pointers followed)."""
        base = self.path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        out = []
        for folder, dirs, files in os.walk(base, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            here = Path(folder)
            if CHECKSUMS in files and here != self.root:
                out.append(here.relative_to(self.root).as_posix())
        return sorted(out)
