"""`open_store`: the `Store` for a store URI (a local path or s3://bucket/prefix); `init_adapter_dir`: the local
folder of an adapter given as a path or as the s3:// URI of a committed store directory."""

from __future__ import annotations

from pathlib import Path

from envace_core import EnvaceError
from envace_core.store.base import StoreError
from envace_core.store.local import LocalStore
from envace_core.store.s3 import S3Store


def open_store(root: str) -> LocalStore | S3Store:
    """Open the artifact store named by config (`store.root`): S3Store for `s3://…`, else LocalStore.

    Makes no network request; call `.check()` to fail early on bad credentials or bucket.
    """
    if root.startswith("s3://"):
        return S3Store(root)
    return LocalStore(root)


def init_adapter_dir(ref: str, setting: str = "train.init_adapter") -> Path:
    """The local directory of `train.init_adapter`: a local path, or a verified local copy of an
    s3:// URI (the store directory committed at the URI, or at its nearest ancestor that holds it,
    e.g. a registry version holding artifacts/adapter).

    Raises:
        EnvaceError: no directory at `ref` (naming `setting`); storage.StoreError for S3 failures.
    """
    if ref.startswith("s3://"):
        bucket, _, key = ref[len("s3://"):].partition("/")
        parts = [p for p in key.split("/") if p]
        store = open_store(f"s3://{bucket}")
        for i in range(len(parts), 0, -1):
            try:
                return store.get_dir("/".join(parts[:i])).joinpath(*parts[i:])
            except StoreError as e:
                if "not found" not in str(e):
                    raise
        raise EnvaceError(f"{setting}={ref!r}: no committed artifact directory at or above it")
    d = Path(ref).expanduser()
    if not d.is_dir():
        raise EnvaceError(f"{setting}={ref!r} is not a directory: give a LoRA adapter directory "
                          "(e.g. <registry>/NAME/VERSION/artifacts/adapter) or an s3:// URI of one")
    return d
