"""`open_store`: the `Store` for a store URI (a local path or s3://bucket/prefix)."""

from __future__ import annotations

from envace_core.store.local import LocalStore
from envace_core.store.s3 import S3Store


def open_store(root: str) -> LocalStore | S3Store:
    """Open the artifact store named by config (`store.root`): S3Store for `s3://…`, else LocalStore.

    Makes no network request; call `.check()` to fail early on bad credentials or bucket.
    """
    if root.startswith("s3://"):
        return S3Store(root)
    return LocalStore(root)
