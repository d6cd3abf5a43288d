"""Lineage manifests and the model registry.

A registered model version holds the model artifacts (the LoRA adapter, the config, reports) and
`manifest.json`: base model and its hash, dataset version and DVC md5, the code version
(`buildinfo.build_info`: git commit, dirty flag, image, package versions), the full resolved config,
metrics, gate results, the execution id and the sha256 of every artifact, signed with HMAC-SHA256
when $ENVACE_REGISTRY_HMAC_KEY is set. The registry is a local directory (`<registry>/<name>/<version>/`,
built in a temporary sibling and renamed into place) or `s3://bucket/prefix` (one `storage.S3Store`
directory per version, committed last), so a registry reader never sees half a version; registering
an existing version is refused.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from envace_core import EnvaceError, TransientError
from envace_core.store.base import StoreError
from envace_core.store.files import (
    CHECKSUMS,
    atomic_dir,
    dir_checksums,
    writable_dir_problem,
)
from envace_core.store.s3 import S3Store

MANIFEST = "manifest.json"
HMAC_KEY_ENV = "ENVACE_REGISTRY_HMAC_KEY"  # the signing key comes from the environment, never from config
# what `Registry.verify` lists for a manifest whose signature fails while a signing key is set
UNSIGNED = f"manifest.json (no signature: registered while ${HMAC_KEY_ENV} was not set)"
BAD_SIGNATURE = "manifest.json (signature does not match: edited after registration, or signed with another key)"


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


class CorruptManifestError(RegistryError):
    """A registered version's manifest.json is not a manifest: unreadable, not a JSON object, no artifacts.
    `problem` says what is wrong (the message's middle part)."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


def manifest_problem(manifest: Any, name: str, version: str) -> str | None:
    """What makes decoded manifest.json content unusable as `name@version`'s manifest, or None: not a JSON
    object, no ``artifacts`` object of {"artifacts/<relpath>": sha256} (at least one), or a ``name`` /
    ``version`` field naming another version (fields a hand-made manifest may lack are not required)."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    arts = manifest.get("artifacts")
    if not isinstance(arts, dict) or not arts:
        return "it records no artifacts"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in arts.items()):
        return "its artifacts are not {path: sha256} strings"
    for field, want in (("name", name), ("version", version)):
        if field in manifest and manifest[field] != want:
            return f"its {field} is {manifest[field]!r}, not {want!r}"
    return None


class Registry:
    """A model registry in a local directory or under `s3://bucket/prefix`.

    Local: version `<root>/<name>/<version>/` = `artifacts/` + `manifest.json`, built in a temporary
    sibling and renamed into place. S3: the same files as one `storage.S3Store` directory
    `<prefix>/<name>/<version>` (content-addressed objects, then the CHECKSUMS.json commit object
    last, written with If-None-Match), so a reader never sees half a version and an upload that
    dies midway registers nothing. Opening a registry makes no request and creates nothing (a local
    folder is made by the first `register`); `check` tries it before a run. Endpoint, region and
    credentials of an S3 registry come from the standard AWS environment/config (see store/s3.py).
    """

    def __init__(self, root: str | Path):
        self._s3 = S3Store(str(root), setting="store.registry") if str(root).startswith("s3://") else None
        if self._s3 is not None:
            self.root: Any = self._s3.root
            return
        self.root = Path(root).expanduser().resolve()

    def check(self) -> None:
        """Check that models can be registered here, before a run that will register one: an S3 registry's
        credentials, endpoint and bucket (`S3Store.check`, one HeadBucket); a local folder is made if missing
        and tried with a temporary file.

        Raises:
            RegistryError: the local folder cannot be made or written; StoreError naming store.registry for
                an S3 registry that cannot be used (store.s3.TransientStoreError when a retry may fix it).
        """
        if self._s3 is not None:
            self._s3.check()
            return
        why = writable_dir_problem(self.root)
        if why:
            raise RegistryError(f"cannot use {self.root} as the model registry (store.registry): {why}")

    def _local_root(self, ref: str = "") -> None:
        """For reading a local registry: RegistryError when its folder does not exist or is a file (reads
        never create it); the message starts with `ref` (NAME@VERSION) is not registered, when given."""
        if not os.path.isdir(self.root):  # (False, not OSError, for a name over the filesystem's limit)
            exists = os.path.exists(self.root)
            what = "is a file, not a folder" if exists else "does not exist"
            head = f"{ref} is not registered: " if ref else ""
            fix = "give store.registry a folder" if exists else \
                "fix store.registry if it is misspelt (registering the first model creates the folder)"
            raise RegistryError(f"{head}the model registry folder {self.root} (store.registry) {what}: nothing is "
                                f"registered there; {fix}")

    def version_dir(self, name: str, version: str) -> Path:
        """The local directory of `name@version` (RegistryError for an invalid name or an S3 registry)."""
        _check_ref(name, version)
        if self._s3 is not None:
            raise RegistryError(f"{self.uri(name, version)} is in S3 and has no local directory")
        return self.root / name / version

    def local_dir(self, name: str, version: str) -> Path:
        """A local directory holding `name@version` (`artifacts/` + `manifest.json`), for loading it.

        Local registry: the version directory itself. S3 registry: a download (`S3Store.get_dir`,
        every file's sha256 checked against the version's commit object) into the content-addressed
        cache `$ENVACE_CACHE/s3-store/<bucket>/<prefix>/<name>/<version>@<sha256 of the commit>`, so
        a second call downloads nothing. Check it against its manifest with `verify_copy`.

        Raises:
            RegistryError: not registered, or an S3 object differs from the commit or is missing;
            store.s3.TransientStoreError when S3 failed in a way a retry may fix.
        """
        if self._s3 is None:
            vdir = self.version_dir(name, version)
            if not (vdir / MANIFEST).is_file():
                self._no_local_manifest(name, version)
            return vdir
        _check_ref(name, version)
        try:
            return self._s3.get_dir(f"{name}/{version}")
        except StoreError as e:
            if isinstance(e, TransientError):
                raise
            if "not found" in str(e):
                raise RegistryError(f"{name}@{version} is not registered in {self.root}") from None
            raise RegistryError(f"{name}@{version} ({self.uri(name, version)}) fails verification: {e}") from None

    def verify_copy(self, vdir: str | Path) -> list[str]:
        """What fails verification in a local copy `vdir` of a version (`local_dir`), as `verify`
        reports it: artifacts whose sha256 differs from `vdir/manifest.json`, missing or extra ones,
        and `UNSIGNED` / `BAD_SIGNATURE` when a signing key is set and the HMAC is absent / does not match.

        Raises:
            RegistryError: `vdir/manifest.json` is missing or not JSON.
        """
        path = Path(vdir) / MANIFEST
        try:
            manifest = json.loads(path.read_bytes())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RegistryError(f"{path} is missing or corrupt ({type(e).__name__}): this copy cannot be "
                                "trusted") from None
        actual = {f"artifacts/{k}": v for k, v in dir_checksums(Path(vdir) / "artifacts").items()}
        return _differences(manifest, actual)

    def uri(self, name: str, version: str) -> str:
        """Where `name@version` lives: its directory path, or its s3:// URI."""
        _check_ref(name, version)
        return self._s3.uri(f"{name}/{version}") if self._s3 else str(self.root / name / version)

    def register(self, name: str, version: str, artifacts_dir: str | Path,
                 manifest: dict[str, Any]) -> Path | str:
        """Copy `artifacts_dir` and write the manifest (with artifact hashes) as `name@version`.

        The manifest gains name, version, registered_at, `artifacts` {"artifacts/<relpath>": sha256}
        and, when $ENVACE_REGISTRY_HMAC_KEY is set, `signature` (HMAC-SHA256). Returns the version
        directory (a Path), or its s3:// URI (a str) for an S3 registry.

        A local registry's folder is made if missing.

        Raises:
            RegistryError: the version already exists (versions are immutable), also when another
                writer registered it concurrently; the local folder cannot be made or written (`check`);
                S3 failures as storage.StoreError.
        """
        _check_ref(name, version)
        if self._s3 is None:
            self.check()
        if self._exists(name, version):
            raise RegistryError(f"{name}@{version} is already registered at {self.uri(name, version)}; "
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
            if self._s3 is None:
                return atomic_dir(self.version_dir(name, version), build, exists="error")
            with tempfile.TemporaryDirectory() as tmp:
                build(Path(tmp))
                self._s3.put_dir(tmp, f"{name}/{version}", overwrite=False)
            return self.uri(name, version)
        except FileExistsError:
            raise RegistryError(f"{name}@{version} was registered concurrently") from None
        except StoreError as e:
            if "already exists" in str(e):
                raise RegistryError(f"{name}@{version} was registered concurrently") from None
            raise

    def _exists(self, name: str, version: str) -> bool:
        if self._s3 is None:
            return self.version_dir(name, version).exists()
        return self._s3.exists(f"{name}/{version}/{CHECKSUMS}")

    def list(self) -> list[tuple[str, str]]:
        """(name, version) of every registered model, sorted; S3 uploads that never committed are skipped.

        Raises:
            RegistryError: a local registry folder that does not exist (listing does not create it) or
                is a file; StoreError for an S3 registry that cannot be read.
        """
        if self._s3 is None:
            self._local_root()
            return sorted((d.parent.name, d.name) for d in self.root.glob("*/*")
                          if (d / MANIFEST).is_file())
        return sorted(tuple(k.split("/")) for k in self._s3.list_dirs() if k.count("/") == 1)  # type: ignore[misc]

    def show(self, name: str, version: str) -> dict[str, Any]:
        """The manifest of `name@version`. RegistryError if it is not registered or corrupt."""
        _check_ref(name, version)
        try:
            raw = self._read_manifest(name, version)
            manifest = json.loads(raw)
            problem = manifest_problem(manifest, name, version)
        except (ValueError, RecursionError, StoreError) as e:  # ValueError: JSON / UTF-8 / a 5 000-digit int
            if isinstance(e, TransientError):
                raise
            if isinstance(e, StoreError) and "not found" in str(e):
                raise RegistryError(f"{name}@{version} is not registered in {self.root}") from None
            problem = str(e)[:200] if not isinstance(e, RecursionError) else "its JSON is nested too deep to read"
        if problem is not None:
            raise CorruptManifestError(f"the manifest of {name}@{version} ({self.uri(name, version)}/{MANIFEST}) "
                                       f"is corrupt: {problem}; this version cannot be trusted", problem)
        return manifest

    def _read_manifest(self, name: str, version: str) -> bytes:
        if self._s3 is not None:
            return self._s3.read_bytes(f"{name}/{version}/{MANIFEST}")
        path = self.version_dir(name, version) / MANIFEST
        if not os.path.isfile(path):  # (False, not OSError, for a name over the filesystem's limit)
            self._no_local_manifest(name, version)
        return path.read_bytes()

    def _no_local_manifest(self, name: str, version: str) -> NoReturn:
        """RegistryError for a local `name@version` without manifest.json: no registry folder, a version folder
        left without its manifest (its artifacts cannot be verified), or not registered."""
        self._local_root(f"{name}@{version}")
        vdir = self.version_dir(name, version)
        if os.path.isdir(vdir):
            raise RegistryError(f"{name}@{version} at {vdir} has no {MANIFEST}, so its artifacts cannot be verified")
        raise RegistryError(f"{name}@{version} is not registered in {self.root}")

    def _actual_artifacts(self, name: str, version: str) -> dict[str, str]:
        """{"artifacts/<relpath>": sha256 of what is stored now}; S3 objects that no longer match
        their commit (or are gone) get the value "tampered"."""
        if self._s3 is None:
            vdir = self.version_dir(name, version)
            return {f"artifacts/{k}": v for k, v in dir_checksums(vdir / "artifacts").items()}
        key = f"{name}/{version}"
        bad = set(self._s3.verify_dir(key))
        sums = self._s3.read_json(f"{key}/{CHECKSUMS}")
        return {rel: "tampered" if rel in bad else sha for rel, sha in sums.items()
                if rel.startswith("artifacts/")}

    def verify(self, name: str, version: str) -> list[str]:
        """What fails verification (empty = ok): every artifact whose sha256 differs from the manifest,
        is missing or is extra, and `UNSIGNED` / `BAD_SIGNATURE` when a signing key is configured
        ($ENVACE_REGISTRY_HMAC_KEY) and the manifest's HMAC is absent / does not match (an edited
        manifest, or another key). On S3 every object is streamed and hashed; if the manifest object itself no longer
        matches its commit, the result lists `manifest.json` and every other file that fails.

        A manifest that is not one (`manifest_problem`) is listed as ``manifest.json (<what is wrong>)``.

        Raises:
            RegistryError: `name@version` is not registered.
        """
        try:
            manifest = self.show(name, version)
        except RegistryError as e:
            broken = self._broken_s3_manifest(name, version)
            if broken is not None:
                return broken
            if isinstance(e, CorruptManifestError):
                return [f"{MANIFEST} ({e.problem})"]
            raise
        return _differences(manifest, self._actual_artifacts(name, version))

    def _broken_s3_manifest(self, name: str, version: str) -> list[str] | None:
        """For an S3 version whose manifest object no longer matches its commit: every file that
        fails (manifest.json included); None otherwise (local, not registered, other errors)."""
        if self._s3 is None or not self._exists(name, version):
            return None
        bad = self._s3.verify_dir(f"{name}/{version}")
        return bad if MANIFEST in bad else None


def base_model_ref(manifest: dict[str, Any]) -> str | None:
    """The manifest's ``base_model.ref`` (the base model the adapter's LoRA deltas fit), or None when it
    records none (no ``base_model`` object, or a ref that is not a non-empty string)."""
    recorded = manifest.get("base_model")
    ref = recorded.get("ref") if isinstance(recorded, dict) else None
    return ref if isinstance(ref, str) and ref else None


def _differences(manifest: dict[str, Any], actual: dict[str, str]) -> list[str]:
    """Artifacts whose sha256 in `actual` differs from the manifest's (missing and extra ones too),
    plus `UNSIGNED` or `BAD_SIGNATURE` when a signing key is set and the manifest has no HMAC or another one."""
    expected = manifest.get("artifacts") or {}
    bad = sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))
    key = _signing_key()
    if key is not None:
        sig = manifest.get("signature")
        value = sig.get("value") if isinstance(sig, dict) else sig
        if not value:
            bad.append(UNSIGNED)
        elif not isinstance(value, str) or not hmac.compare_digest(
                value.encode("utf-8", "replace"), manifest_signature(manifest, key).encode()):
            bad.append(BAD_SIGNATURE)
    return bad


def _check_ref(name: str, version: str) -> None:
    for part in (name, version):
        if not part or "/" in part or part.startswith("."):
            raise RegistryError(f"invalid model name/version {part!r}")
