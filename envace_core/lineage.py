"""Lineage manifests and the model registry.

A registered model version is a directory `<registry>/<name>/<version>/` holding the model artifacts
(the LoRA adapter, the config) and `manifest.json`: base model and its hash, dataset hash, git
commit and dirty flag, the full resolved config, metrics, gate results, the execution id and the
sha256 of every artifact. The version directory is built in a temporary sibling and renamed into
place, so a registry reader never sees half a version; registering an existing version is refused.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.storage import atomic_dir, dir_checksums

MANIFEST = "manifest.json"


class RegistryError(EnvaceError):
    """A registry operation was refused (duplicate version, missing model, tampered artifact)."""


def git_state(repo_dir: str | Path | None = None) -> dict[str, Any]:
    """The code version: git commit and whether the working tree had uncommitted changes."""
    cwd = str(repo_dir or Path(__file__).resolve().parent.parent)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=cwd, capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "note": "not a git checkout"}
    return {"commit": commit, "dirty": dirty}


class Registry:
    """A model registry in a local directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RegistryError(f"cannot use {self.root} as the model registry (store.registry): {e}") from e

    def version_dir(self, name: str, version: str) -> Path:
        for part in (name, version):
            if not part or "/" in part or part.startswith("."):
                raise RegistryError(f"invalid model name/version {part!r}")
        return self.root / name / version

    def register(self, name: str, version: str, artifacts_dir: str | Path,
                 manifest: dict[str, Any]) -> Path:
        """Copy `artifacts_dir` and write the manifest (with artifact hashes) as `name@version`.

        Raises:
            RegistryError: the version already exists (versions are immutable).
        """
        final = self.version_dir(name, version)
        if final.exists():
            raise RegistryError(f"{name}@{version} is already registered at {final}; "
                                "versions are immutable: register a new version")

        def build(tmp: Path) -> None:
            shutil.copytree(artifacts_dir, tmp / "artifacts")
            full = {
                **manifest,
                "name": name,
                "version": version,
                "registered_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "artifacts": {f"artifacts/{k}": v for k, v in dir_checksums(tmp / "artifacts").items()},
            }
            (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True, default=str))

        try:
            atomic_dir(final, build, exists="error")
        except FileExistsError:
            raise RegistryError(f"{name}@{version} was registered concurrently") from None
        return final

    def list(self) -> list[tuple[str, str]]:
        return sorted((d.parent.name, d.name) for d in self.root.glob("*/*")
                      if (d / MANIFEST).is_file())

    def show(self, name: str, version: str) -> dict[str, Any]:
        path = self.version_dir(name, version) / MANIFEST
        if not path.is_file():
            raise RegistryError(f"{name}@{version} is not registered in {self.root}")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RegistryError(f"the manifest of {name}@{version} ({path}) is corrupt: {e}; "
                                "this version cannot be trusted") from e

    def verify(self, name: str, version: str) -> list[str]:
        """Artifacts whose sha256 differs from the manifest, or that are missing/extra (empty = ok)."""
        manifest = self.show(name, version)
        vdir = self.version_dir(name, version)
        actual = {f"artifacts/{k}": v for k, v in dir_checksums(vdir / "artifacts").items()}
        expected = manifest["artifacts"]
        return sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))
