"""Lineage manifests and the model registry.

A registered model version is a directory `<registry>/<name>/<version>/` holding the model artifacts
(the LoRA adapter, the config) and `manifest.json`: base model and its hash, dataset hash, git
commit and dirty flag, the full resolved config, metrics, gate results, the execution id and the
sha256 of every artifact. The version directory is built in a temporary sibling and renamed into
place, so a registry reader never sees half a version; registering an existing version is refused.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.storage import atomic_dir, dir_checksums

MANIFEST = "manifest.json"
HMAC_KEY_ENV = "ENVACE_REGISTRY_HMAC_KEY"  # the signing key comes from the environment, never from config


def _signing_key() -> bytes | None:
    key = os.environ.get(HMAC_KEY_ENV)
    return key.encode() if key else None


def manifest_signature(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 (RFC 2104) over the canonical JSON of the manifest without its `signature` field."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


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
            full = json.loads(json.dumps(full, default=str))  # what is signed is what is stored
            key = _signing_key()
            if key:
                full["signature"] = {"alg": "HMAC-SHA256", "value": manifest_signature(full, key)}
            (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True))

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
        """What fails verification (empty = ok): every artifact whose sha256 differs from the manifest,
        is missing or is extra, and `manifest.json (signature)` when a signing key is configured
        ($ENVACE_REGISTRY_HMAC_KEY) and the manifest's HMAC is absent or does not match (an edited
        manifest)."""
        manifest = self.show(name, version)
        vdir = self.version_dir(name, version)
        actual = {f"artifacts/{k}": v for k, v in dir_checksums(vdir / "artifacts").items()}
        expected = manifest["artifacts"]
        bad = sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))
        key = _signing_key()
        if key is not None:
            sig = (manifest.get("signature") or {}).get("value", "")
            if not hmac.compare_digest(sig, manifest_signature(manifest, key)):
                bad.append(f"{MANIFEST} (signature)")
        return bad
