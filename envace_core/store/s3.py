"""`S3Store`: the artifact store on S3 or any S3-compatible server (boto3), with checksum-verified transfers.

Failures are `StoreError`s whose message names the URI and the fix. Those that may pass on retry
(connection refused, dropped or timed out; HTTP 5xx; throttling: SlowDown, Throttling,
RequestTimeout, HTTP 429; an upload whose checksum did not verify), raised after botocore's own
retries (`retries` of the client: standard mode, 5 attempts unless the AWS config says otherwise)
gave up, are `TransientStoreError`s, also `envace_core.TransientError`, so an orchestrator may run
the stage again. Permanent ones (no such bucket, access denied, no credentials, a missing or
corrupt artifact) are plain `StoreError`s.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from envace_core import TransientError
from envace_core.store.base import StoreError, check_key
from envace_core.store.files import (
    CHECKSUMS,
    atomic_dir,
    cache_root,
    dir_checksums,
    sha256_bytes,
    sha256_path,
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- S3 --

_MiB = 1 << 20

# S3 error codes that mean "try again later" (AWS S3 API reference, "Error responses"; botocore's
# standard retry mode treats the same codes as throttling/transient: botocore/retries/standard.py)
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable", "PriorRequestNotComplete",
})


_LOADER: list[Any] = []  # botocore's data loader, shared by every client this process creates


def _share_loader(core: Any) -> None:
    """Give botocore session `core` the process's data loader, which caches the parsed S3 service model
    and endpoint rules (about half a second per client otherwise); credentials stay per session."""
    if _LOADER:
        core.register_component("data_loader", _LOADER[0])
    else:
        _LOADER.append(core.get_component("data_loader"))


class TransientStoreError(StoreError, TransientError):
    """An S3 failure that may pass on retry (see the module docstring); the message names the URI."""


def _b64_sha256(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class S3Store:
    """An artifact store under `s3://bucket/prefix`, with the same methods as LocalStore.

    Opening it makes no request (the boto3 client is created on first use). `cache_dir` (default
    `$ENVACE_CACHE/s3-store/<bucket>/<prefix>`) receives `get_dir` downloads. Files of
    `multipart_threshold` bytes or more are uploaded and downloaded in parts of
    `multipart_chunksize` bytes (S3 needs parts of at least 5 MiB), `max_concurrency` at a time.
    `connect_timeout` and `read_timeout` are seconds per request; `max_attempts` (tries per request,
    first included) overrides the AWS config's `max_attempts` (default 5 when that says nothing).
    `setting` is the config field the root came from, named in error messages.
    See the module docstring for the layout and why readers never see a half-written directory.
    """

    def __init__(self, root: str, cache_dir: str | Path | None = None, *,
                 multipart_threshold: int = 64 * _MiB, multipart_chunksize: int = 16 * _MiB,
                 max_concurrency: int = 8, connect_timeout: float = 10, read_timeout: float = 60,
                 max_attempts: int | None = None, setting: str = "store.root"):
        if not root.startswith("s3://"):
            raise StoreError(f"not an S3 store root: {root!r} (expected s3://bucket[/prefix])")
        bucket, _, prefix = root[len("s3://"):].partition("/")
        if not bucket:
            raise StoreError(f"S3 store root {root!r} names no bucket: use s3://bucket[/prefix]")
        self.bucket = bucket
        self.prefix = "/".join(PurePosixPath(prefix).parts) if prefix.strip("/") else ""
        self.root = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir else cache_root() / "s3-store" / bucket / self.prefix
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.max_concurrency = max_concurrency
        self.connect_timeout, self.read_timeout, self.max_attempts = connect_timeout, read_timeout, max_attempts
        self.setting = setting
        self._client = None
        self._bucket_ok = False

    # -- plumbing --------------------------------------------------------------------------

    @property
    def client(self):
        """The boto3 S3 client (endpoint, region and credentials from the AWS environment)."""
        if self._client is None:
            try:
                import boto3
                import botocore.session
                from botocore.config import Config
            except ImportError:
                raise StoreError("s3:// stores need boto3: pip install boto3") from None
            try:
                core = botocore.session.get_session()
                _share_loader(core)
                retries: dict[str, Any] = {}  # defaults only where env/config files say nothing
                if core.get_config_variable("retry_mode") is None:
                    retries["mode"] = "standard"
                if self.max_attempts is not None:
                    retries["total_max_attempts"] = self.max_attempts
                elif core.get_config_variable("max_attempts") is None:
                    retries["total_max_attempts"] = 5
                self._client = boto3.session.Session(botocore_session=core).client(
                    "s3", config=Config(connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                                        retries=retries))
            except Exception as e:  # noqa: BLE001  (bad region/endpoint/profile in the environment)
                raise StoreError(f"cannot configure an S3 client for {self.root}: {type(e).__name__}: {e} "
                                 "(check AWS_ENDPOINT_URL, AWS_REGION and AWS_PROFILE)") from None
        return self._client

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold,
                              multipart_chunksize=self.multipart_chunksize,
                              max_concurrency=self.max_concurrency,
                              preferred_transfer_client="classic")

    def _key(self, key: str) -> str:
        """Normalised store key ('a//b/./c' -> 'a/b/c'); StoreError for absolute or '..' keys."""
        return "/".join(PurePosixPath(check_key(key)).parts)

    def _obj(self, key: str) -> str:
        """The S3 object key of a (normalised) store key."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, e: BaseException, action: str, key: str | None) -> StoreError:
        """A StoreError for a boto3/botocore failure: says what, where and how to fix; no secrets.
        A `TransientStoreError` for the failures that may pass on retry (module docstring)."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            HTTPClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        where = self.uri(key) if key is not None else f"s3://{self.bucket}"
        inner = getattr(e, "last_exception", None) or e.__context__  # boto3 wraps botocore errors
        if not isinstance(e, (ClientError, BotoCoreError)) and isinstance(inner, (ClientError, BotoCoreError)):
            e = inner
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(
                f"no AWS credentials found to {action} {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary ones), or AWS_PROFILE naming "
                "a profile in ~/.aws/credentials, or run where an instance/container role is available")
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", "?"))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket" or (code in ("404", "NotFound") and key is None):
                endpoint = getattr(getattr(self._client, "meta", None), "endpoint_url", None) or "the AWS default"
                return StoreError(f"bucket {self.bucket!r} does not exist (trying to {action} {where} at endpoint "
                                  f"{endpoint}): create it or fix {self.setting} (or AWS_ENDPOINT_URL, if that "
                                  "endpoint is not your S3 service)")
            if code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "InvalidToken", "AllAccessDisabled") or status == 403:
                return StoreError(f"access denied ({code}) trying to {action} {where} in bucket "
                                  f"{self.bucket!r}: check the AWS credentials and their permissions")
            msg = str(err.get("Message", "")).strip()
            transient = code in TRANSIENT_CODES or status == 429 or (isinstance(status, int) and status >= 500)
            return (TransientStoreError if transient else StoreError)(
                f"S3 error {code} (HTTP {status}) trying to {action} {where}" + (f": {msg}" if msg else "")
                + ("; it may pass on retry (gave up after retries)" if transient else ""))
        if isinstance(e, (BotoConnectionError, HTTPClientError)):  # refused, dropped, timed out
            return TransientStoreError(f"cannot reach S3 to {action} {where} (gave up after retries): {e}; "
                                       "check AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 and the network")
        return StoreError(f"S3 failure trying to {action} {where}: {type(e).__name__}: {e}")

    @contextmanager
    def _errors(self, action: str, key: str | None) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            from boto3.exceptions import Boto3Error
        except ImportError:  # pragma: no cover
            Boto3Error = ClientError  # type: ignore[misc,assignment]
        try:
            yield
        except (BotoCoreError, ClientError, Boto3Error) as e:
            raise self._error(e, action, key) from None

    @staticmethod
    def _is_missing(e: BaseException) -> bool:
        from botocore.exceptions import ClientError

        if not isinstance(e, ClientError):
            return False
        code = str(e.response.get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def _head(self, key: str) -> dict | None:
        """head_object of store key `key`, or None if it does not exist (StoreError if the bucket doesn't)."""
        from botocore.exceptions import ClientError

        with self._errors("look up", key):
            try:
                return self.client.head_object(Bucket=self.bucket, Key=self._obj(key))
            except ClientError as e:
                if not self._is_missing(e):
                    raise
        self._require_bucket(key)  # HEAD can't tell a missing key from a missing bucket
        return None

    def _require_bucket(self, key: str | None) -> None:
        if not self._bucket_ok:
            with self._errors("open", key):
                try:
                    self.client.head_bucket(Bucket=self.bucket)
                except Exception as e:
                    if self._is_missing(e):
                        raise StoreError(f"bucket {self.bucket!r} does not exist (trying to open "
                                         f"{self.uri(key) if key else self.root}): create it or fix "
                                         f"{self.setting}") from None
                    raise
            self._bucket_ok = True

    def _get(self, key: str) -> bytes | None:
        """Body of the object at store key `key`, or None if absent; verifies its sha256 metadata."""
        from botocore.exceptions import ClientError

        with self._errors("read", key):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._obj(key))
            except ClientError as e:
                if self._is_missing(e):
                    return None
                raise
            data = r["Body"].read()
        want = r.get("Metadata", {}).get("sha256")
        if want and sha256_bytes(data) != want:
            raise StoreError(f"artifact {self.uri(key)} is corrupt: sha256 {sha256_bytes(data)} != {want} "
                             "recorded at upload; rewrite it")
        return data

    def _manifest(self, key: str) -> tuple[dict[str, str], bytes] | None:
        """The commit object of directory `key` as ({relpath: sha256}, raw bytes), or None."""
        raw = self._get(f"{key}/{CHECKSUMS}")
        if raw is None:
            return None
        try:
            sums = json.loads(raw)
        except ValueError as e:
            sums = f"{e}"
        if not isinstance(sums, dict):
            raise StoreError(f"commit object {self.uri(f'{key}/{CHECKSUMS}')} is corrupt: {sums!r}")
        return sums, raw

    def _inside_dir(self, key: str) -> tuple[str, str, str] | None:
        """(directory key, relpath, sha256) if `key` names a file of a committed directory."""
        parts = key.split("/")
        for i in range(len(parts) - 1, 0, -1):
            d, rel = "/".join(parts[:i]), "/".join(parts[i:])
            found = self._manifest(d)
            if found is not None:  # the nearest committed ancestor decides
                sha = found[0].get(rel)
                return (d, rel, sha) if sha else None
        return None

    # -- the store API ---------------------------------------------------------------------

    def path(self, key: str) -> Path:
        """S3 artifacts have no local path: raises StoreError pointing to get_dir/read_bytes."""
        raise StoreError(f"{self.uri(key)} is in S3 and has no local path: use get_dir(key) for a "
                         "local copy of a directory, or read_bytes(key) for a file")

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._obj(self._key(key))}"

    def check(self) -> None:
        """One request (HeadBucket): StoreError if credentials, endpoint or bucket are unusable."""
        self._bucket_ok = False
        self._require_bucket(None)

    def exists(self, key: str) -> bool:
        """True for an object, a committed put_dir directory, or a file inside one.

        A directory whose upload failed midway has no commit object and does not exist.
        """
        key = self._key(key)
        if self._head(key) is not None or self._head(f"{key}/{CHECKSUMS}") is not None:
            return True
        return self._inside_dir(key) is not None

    def write_bytes(self, key: str, data: bytes) -> str:
        """Write `data` as one object (one PUT: atomic) verified by SHA256; returns its sha256 (hex)."""
        key = self._key(key)
        digest = hashlib.sha256(data).digest()
        with self._errors("write", key):
            r = self.client.put_object(Bucket=self.bucket, Key=self._obj(key), Body=data,
                                       ChecksumAlgorithm="SHA256", Metadata={"sha256": digest.hex()})
        got = r.get("ChecksumSHA256")
        if got and got != _b64_sha256(digest):
            raise TransientStoreError(f"upload of {self.uri(key)} was corrupted in transit (SHA256 mismatch); retry")
        log.debug("wrote %s (%d bytes)", self.uri(key), len(data))
        return digest.hex()

    def write_json(self, key: str, obj: Any) -> str:
        return self.write_bytes(key, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def read_bytes(self, key: str) -> bytes:
        """The object `key`, or the file `key` of a committed directory (sha256-verified).

        Raises StoreError if absent, corrupt, or S3 is unusable.
        """
        key = self._key(key)
        data = self._get(key)
        if data is not None:
            return data
        inside = self._inside_dir(key)
        if inside is not None:
            d, rel, sha = inside
            data = self._get(f"{d}/objects/{sha}")
            if data is None:
                raise StoreError(f"file {rel!r} of {self.uri(d)} is missing from S3 (object objects/{sha}); "
                                 "re-upload the directory")
            if sha256_bytes(data) != sha:
                raise StoreError(f"file {rel!r} of {self.uri(d)} is corrupt in S3 "
                                 f"(sha256 {sha256_bytes(data)} != {sha} in {CHECKSUMS})")
            return data
        raise StoreError(f"artifact {key!r} not found in {self.root}")

    def read_json(self, key: str) -> Any:
        try:
            return json.loads(self.read_bytes(key))
        except json.JSONDecodeError as e:
            raise StoreError(f"artifact {key!r} in {self.root} is not valid JSON (corrupt?): {e}") from e

    def _verify_upload(self, obj_key: str, file: Path, sha: str, rel: str, key: str) -> None:
        """Compare the stored size and the server's SHA256 (full, or composite of parts) with `file`."""
        from s3transfer.utils import ChunksizeAdjuster

        with self._errors("verify", key):
            h = self.client.head_object(Bucket=self.bucket, Key=obj_key, ChecksumMode="ENABLED")
        size = file.stat().st_size
        bad = None
        if h.get("ContentLength") != size:
            bad = f"{h.get('ContentLength')} bytes stored, {size} local"
        elif h.get("ChecksumSHA256"):
            got = h["ChecksumSHA256"].split("-")[0]
            if size < self.multipart_threshold:
                want = _b64_sha256(bytes.fromhex(sha))
            else:  # composite checksum: sha256 of the parts' sha256 digests
                chunk = ChunksizeAdjuster().adjust_chunksize(self.multipart_chunksize, size)
                parts = hashlib.sha256()
                with open(file, "rb") as f:
                    while block := f.read(chunk):
                        parts.update(hashlib.sha256(block).digest())
                want = _b64_sha256(parts.digest())
            if got != want:
                bad = "server SHA256 differs from the local file"
        if bad:
            raise TransientStoreError(f"upload of {rel!r} to {self.uri(key)} did not verify ({bad}); "
                                      "nothing was committed, retry")

    def put_dir(self, local_dir: str | Path, key: str, overwrite: bool = True) -> dict[str, str]:
        """Upload a directory under `key` atomically; returns {relpath: sha256} of its files.

        Files go to content-addressed objects first (multipart above multipart_threshold bytes,
        each verified), then the commit object `<key>/CHECKSUMS.json` is written last; until then
        readers still see the previous version (or nothing). Raises StoreError on any S3 failure
        (nothing committed), and if `key` exists and not `overwrite` (checked with a conditional
        PUT, so two writers cannot both create it). `local_dir` must not change meanwhile.
        """
        key = self._key(key)
        src = Path(local_dir)
        if not src.is_dir():
            raise StoreError(f"cannot upload {src} to {self.uri(key)}: not a directory")
        sums = {rel: sha for rel, sha in dir_checksums(src).items() if rel != CHECKSUMS}
        if not overwrite and self.exists(f"{key}/{CHECKSUMS}"):
            raise StoreError(f"artifact {key!r} already exists in {self.root}")
        config = self._transfer_config()
        done: set[str] = set()
        for rel, sha in sums.items():
            if sha in done:
                continue
            obj_key = self._obj(f"{key}/objects/{sha}")
            with self._errors(f"upload {rel!r} to", key):
                self.client.upload_file(str(src / rel), self.bucket, obj_key, Config=config,
                                        ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": sha}})
            self._verify_upload(obj_key, src / rel, sha, rel, key)
            done.add(sha)
        body = json.dumps(sums, indent=2, sort_keys=True).encode()
        extra = {} if overwrite else {"IfNoneMatch": "*"}
        from botocore.exceptions import ClientError

        with self._errors("commit", key):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._obj(f"{key}/{CHECKSUMS}"), Body=body,
                                       ChecksumAlgorithm="SHA256", Metadata={"sha256": sha256_bytes(body)},
                                       **extra)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                    raise StoreError(f"artifact {key!r} already exists in {self.root}") from None
                raise
        log.debug("committed %s (%d files)", self.uri(key), len(sums))
        self._collect_garbage(key, set(sums.values()))
        return sums

    def _unreferenced(self, key: str, keep: set[str]) -> list[str]:
        """S3 object keys under `<key>/objects/` whose sha256 name is not in `keep`."""
        prefix = self._obj(f"{key}/objects/")
        return [o["Key"] for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=prefix)
                for o in page.get("Contents", []) if o["Key"][len(prefix):] not in keep]

    def _delete(self, objects: list[str]) -> None:
        for i in range(0, len(objects), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in objects[i:i + 1000]], "Quiet": True})

    def _collect_garbage(self, key: str, keep: set[str]) -> None:
        """Delete `<key>/objects/*` not in `keep` (older versions, failed uploads); best effort."""
        try:
            self._delete(self._unreferenced(key, keep))
        except Exception as e:  # noqa: BLE001  (the commit stands; stale objects only cost space)
            log.warning("could not delete stale objects under %s: %s", self.uri(key), type(e).__name__)

    def recover_dir(self, key: str) -> list[str]:
        """Clean up what interrupted `put_dir` uploads of `key` left: the objects under
        `<key>/objects/` that its commit object does not name (a partial upload, or the previous
        version when a kill came between the commit and its garbage collection; all of them when
        nothing was committed). The commit object is the atomic pointer, so there is never a
        version to restore. Returns one line per action, for the caller to print (empty: nothing
        was left). Raises StoreError if S3 is unusable. Call it only while no `put_dir` of `key`
        is in flight (its objects are not named by a commit yet).
        """
        key = self._key(key)
        found = self._manifest(key)
        with self._errors("clean up", key):
            stale = self._unreferenced(key, set(found[0].values()) if found else set())
            self._delete(stale)
        if not stale:
            return []
        what = "not named by its commit object" if found else "of an upload that was never committed"
        return [f"removed {len(stale)} object(s) under {self.uri(key)}/objects/ {what}, left by an "
                "interrupted or superseded upload"]

    def checksums(self, key: str) -> dict[str, str] | None:
        """The files of the directory committed at `key` as its commit object lists them ({relpath:
        sha256}), or None when nothing is committed there; one GET of `<key>/CHECKSUMS.json`, no file
        downloaded. Raises StoreError (a corrupt commit object, no such bucket, S3 unusable)."""
        found = self._manifest(self._key(key))
        return found[0] if found else None

    def get_dir(self, key: str) -> Path:
        """A verified local copy of the committed directory `key` (cached per commit).

        Raises StoreError if `key` has no commit object (missing, or its upload never finished),
        if a file's object is missing, or if a downloaded file's sha256 differs from the commit
        (the message names the file). The returned directory also holds CHECKSUMS.json.
        """
        key = self._key(key)
        for attempt in range(3):
            found = self._manifest(key)
            if found is None:
                raise StoreError(f"artifact directory {key!r} not found in {self.root} "
                                 f"(no {CHECKSUMS} commit object: missing, or its upload did not finish)")
            sums, raw = found
            dest = self.cache_dir / f"{key}@{sha256_bytes(raw)[:16]}"
            try:
                return atomic_dir(dest, lambda tmp, s=sums, r=raw: self._download(key, s, r, tmp), exists="keep")
            except _ObjectGone:
                if attempt == 2 or self._manifest(key) == found:
                    raise StoreError(f"artifact directory {self.uri(key)} references objects that are "
                                     "missing from S3: re-upload it") from None
                # a writer replaced the directory meanwhile: read its new commit
        raise AssertionError("unreachable")

    def _download(self, key: str, sums: dict[str, str], raw: bytes, tmp: Path) -> None:
        from botocore.exceptions import ClientError

        config = self._transfer_config()
        first: dict[str, Path] = {}
        for rel, sha in sorted(sums.items()):
            dest = tmp / rel
            if not dest.resolve().is_relative_to(tmp.resolve()):
                raise StoreError(f"commit object of {self.uri(key)} names a file outside it: {rel!r}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if sha in first:
                shutil.copyfile(first[sha], dest)
                continue
            with self._errors(f"download {rel!r} of", key):
                try:
                    self.client.download_file(self.bucket, self._obj(f"{key}/objects/{sha}"), str(dest),
                                              Config=config)
                except ClientError as e:
                    if self._is_missing(e):
                        raise _ObjectGone(rel) from None
                    raise
            got = sha256_path(dest)
            if got != sha:
                raise StoreError(f"file {rel!r} of {self.uri(key)} is corrupt in S3 "
                                 f"(sha256 {got} != {sha} in {CHECKSUMS})")
            first[sha] = dest
        (tmp / CHECKSUMS).write_bytes(raw)

    def get_verified_dir(self, key: str) -> Path:
        """`get_dir`: every downloaded file is checked against the directory's commit already."""
        return self.get_dir(key)

    def verify_dir(self, key: str) -> list[str]:
        """Files of directory `key` whose S3 object is missing or whose sha256 differs from its commit.

        Streams every object (nothing is cached). Empty list = intact. StoreError if `key` has no
        commit object.
        """
        from botocore.exceptions import ClientError

        key = self._key(key)
        found = self._manifest(key)
        if found is None:
            raise StoreError(f"artifact {key!r} has no {CHECKSUMS}: it was not written by put_dir "
                             "(or its upload did not finish)")
        bad = []
        for rel, sha in sorted(found[0].items()):
            h = hashlib.sha256()
            with self._errors(f"verify {rel!r} of", key):
                try:
                    body = self.client.get_object(Bucket=self.bucket, Key=self._obj(f"{key}/objects/{sha}"))["Body"]
                    for block in body.iter_chunks(_MiB):
                        h.update(block)
                except ClientError as e:
                    if not self._is_missing(e):
                        raise
                    bad.append(rel)
                    continue
            if h.hexdigest() != sha:
                bad.append(rel)
        return bad

    def list_objects(self, key: str = "") -> list[dict[str, Any]]:
        """Every object at or below store key `key` (default: the whole root), also objects this store
        did not write (a model folder uploaded with `aws s3 sync`), as {"key": its path below `key`,
        "size": bytes, "etag": the server's ETag (quoted, as S3 returns it)}, sorted by key.

        One LIST request per 1000 objects. Raises StoreError (bucket missing, access denied, ...;
        TransientStoreError when it may pass on retry)."""
        base = self._obj(self._key(key)) + "/" if key.strip("/") else (f"{self.prefix}/" if self.prefix else "")
        with self._errors("list", key or None):
            objs = [o for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
                    for o in page.get("Contents", [])]
        return sorted(({"key": o["Key"][len(base):], "size": o["Size"], "etag": o.get("ETag", "")}
                       for o in objs if o["Key"] != base), key=lambda o: o["key"])

    def download_file(self, key: str, dest: str | Path) -> None:
        """Download the object at store key `key` to the local file `dest` (its parent must exist),
        multipart as configured; no checksum metadata is required (for objects this store did not
        write). Raises StoreError (TransientStoreError when it may pass on retry)."""
        key = self._key(key)
        with self._errors("download", key):
            self.client.download_file(self.bucket, self._obj(key), str(dest), Config=self._transfer_config())

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Keys of committed directories below `prefix` (sorted); unfinished uploads are not listed."""
        base = self._obj(self._key(prefix) + "/") if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(f"{self.prefix}/") if self.prefix else 0
        out = []
        with self._errors("list", prefix or None):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                for o in page.get("Contents", []):
                    k = o["Key"]
                    if k.endswith(f"/{CHECKSUMS}"):
                        out.append(k[strip:-len(CHECKSUMS) - 1])
        return sorted(out)


class _ObjectGone(Exception):
    """An object named by a commit vanished during get_dir (a writer replaced the directory)."""
