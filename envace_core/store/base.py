"""The artifact-store contract: the `Store` protocol that `LocalStore` and `S3Store` both satisfy, and its errors."""

from __future__ import annotations

from pathlib import Path

from envace_core import EnvaceError


class StoreError(EnvaceError):
    """An artifact is missing, corrupt, or the store root is unusable."""


def check_key(key: str) -> str:
    parts = Path(key).parts
    if not key or Path(key).is_absolute() or ".." in parts:
        raise StoreError(f"invalid artifact key {key!r}: use a relative path without '..'")
    return key
