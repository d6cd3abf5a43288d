"""`open_store`: the `Store` for a store URI (a local path or s3://bucket/prefix); `committed_dir`: where an
s3:// URI lies in the store layout (the committed directory at or above it); `init_adapter_dir`: the local
folder of an adapter given as a path or as the s3:// URI of a committed store directory or a path inside one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.store.files import CHECKSUMS
from envace_core.store.local import LocalStore
from envace_core.store.s3 import S3Store


def open_store(root: str) -> LocalStore | S3Store:
    """Open the artifact store named by config (`store.root`): S3Store for `s3://…`, else LocalStore.

    Makes no network request; call `.check()` to fail early on bad credentials or bucket.
    """
    if root.startswith("s3://"):
        return S3Store(root)
    return LocalStore(root)


def committed_dir(ref: str, setting: str = "train.init_adapter",
                  **options: Any) -> tuple[S3Store, str, str, dict[str, str]]:
    """Where the s3:// URI `ref` lies in the store layout, without downloading any file: the nearest
    directory committed at or above it (its CHECKSUMS.json; e.g. a registry version NAME/VERSION for
    ``.../NAME/VERSION/artifacts/adapter``). One GET per level tried, deepest first.

    Returns (an S3Store of `ref`'s bucket, built with `options` (timeouts, tries; `S3Store`) and naming
    `setting` in its errors; the key of that directory; the path of `ref` below it, "" when `ref` is the
    directory itself; the files at or below `ref` as the commit lists them, {path below `ref`: sha256}).

    Raises:
        EnvaceError naming `setting`: nothing is committed at or above `ref`, or the directory committed
            above it holds no file below `ref`; StoreError for S3 failures (no credentials, no such bucket,
            unreachable: TransientStoreError).
    """
    bucket, _, key = ref[len("s3://"):].partition("/")
    parts = [p for p in key.split("/") if p]
    store = S3Store(f"s3://{bucket}", setting=setting, **options)
    for i in range(len(parts), 0, -1):
        sums = store.checksums("/".join(parts[:i]))
        if sums is None:
            continue
        rel = "/".join(parts[i:])
        below = f"{rel}/" if rel else ""
        files = {p[len(below):]: sha for p, sha in sums.items() if p.startswith(below)}
        if rel and not files:  # the nearest commit decides: a path it does not hold is not there
            raise EnvaceError(f"{setting}={ref!r}: the directory committed at {store.uri('/'.join(parts[:i]))} "
                              f"holds nothing under {rel}/")
        return store, "/".join(parts[:i]), rel, files
    raise EnvaceError(f"{setting}={ref!r}: no committed artifact directory at or above it (no {CHECKSUMS} "
                      "there or in a folder above): give a folder envace wrote to an S3 store or registry, e.g. "
                      "the adapter URI `envace warm-start` prints or a registry version's .../artifacts/adapter")


def init_adapter_dir(ref: str, setting: str = "train.init_adapter") -> Path:
    """The local directory of `train.init_adapter`: a local path, or a verified local copy of an
    s3:// URI (`committed_dir`: the store directory committed at the URI, or at its nearest ancestor
    that holds a folder at the URI, e.g. a registry version holding artifacts/adapter).

    Raises:
        EnvaceError: no directory at `ref` (naming `setting`); storage.StoreError for S3 failures.
    """
    if ref.startswith("s3://"):
        store, key, rel, _ = committed_dir(ref, setting)
        return store.get_dir(key) / rel
    d = Path(ref).expanduser()
    if not d.is_dir():
        raise EnvaceError(f"{setting}={ref!r} is not a directory: give a LoRA adapter directory "
                          "(e.g. <registry>/NAME/VERSION/artifacts/adapter) or an s3:// URI of one")
    return d
