"""Data versioning with DVC: the curated dataset as a folder tracked by `<dvc_path>.dvc` (`data.dvc`).

`track_dataset(store, key, cfg.data)` copies a curated dataset folder (tasks.parquet + manifest.json) to
`<repo>/<dvc_path>` (default `data/`, gitignored), runs `dvc add` (which writes `data.dvc`: the
folder's DVC md5, `<md5>.dir`) and `dvc push`es the content to a DVC remote, all through DVC's own
Python API (`dvc.repo.Repo`). Committing `data.dvc` to git then pins the exact dataset: on a fresh
clone `dvc pull` restores byte-identical files from the remote.

Which remote: `data.dvc_remote` if set (a directory, relative to the repo root, or
`s3://bucket/prefix`), else the repo's default DVC remote (envace commits `.dvc/config` with the
remote `envace` -> `.envace/dvc-remote`), else `<repo>/.envace/dvc-remote`. S3 remotes use dvc-s3,
which reads the endpoint, region and credentials from the standard AWS environment/config only.

Outside a DVC repo (a Flyte container, a tarball without `.dvc/`), mode "auto" skips DVC with a
printed reason and returns `{"tracked": False, "reason": ...}` (recorded as such in the lineage);
mode "require" raises DVCError instead; "off" skips silently (tracked: False, reason "off").
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from envace_core import EnvaceError
from envace_core.config import DataConfig
from envace_core.store.files import CHECKSUMS, atomic_dir

REMOTE_NAME = "envace"  # the remote envace's committed .dvc/config names as the default
OVERRIDE_NAME = "envace-run"  # the in-process remote for data.dvc_remote (or the fallback directory)
DEFAULT_LOCAL_REMOTE = ".envace/dvc-remote"  # relative to the repo root; gitignored


class DVCError(EnvaceError):
    """DVC could not track or push the dataset (not a DVC repo under 'require', lock, remote)."""


def find_repo(start: str | Path | None = None) -> Path | None:
    """The nearest directory at or above `start` (default: the current directory) holding `.dvc/`."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    try:
        return Path(Repo.find_root(str(start or os.getcwd())))
    except NotDvcRepoError:
        return None


def dvc_md5(dvcfile: str | Path) -> dict[str, Any]:
    """`outs[0]` of a .dvc file: {"md5": "<hex>.dir", "size": bytes, "nfiles": n, "path": ...}.

    Raises DVCError if the file is missing or has no md5 output.
    """
    try:
        outs = (yaml.safe_load(Path(dvcfile).read_text()) or {}).get("outs") or [{}]
    except (OSError, yaml.YAMLError) as e:
        raise DVCError(f"cannot read {dvcfile}: {e}; re-run curate to rewrite it") from e
    if not outs[0].get("md5"):
        raise DVCError(f"{dvcfile} has no outs[0].md5: re-run curate (or `dvc add`) to rewrite it")
    return {k: outs[0][k] for k in ("md5", "size", "nfiles", "path") if k in outs[0]}


def _skip(data: DataConfig, reason: str) -> dict[str, Any]:
    if data.dvc == "require":
        raise DVCError(f"data.dvc=require but {reason}")
    if data.dvc == "auto":
        print(f"[curate] DVC: not tracking the dataset: {reason} (set data.dvc=off to silence this)")
    return {"tracked": False, "reason": reason}


def remote_url(repo_root: Path, data: DataConfig, default: str | None) -> tuple[str, bool]:
    """(url, is_override): `data.dvc_remote` (made absolute), else the repo's default remote, else
    `<repo>/.envace/dvc-remote`. `default` is the url of the repo's default remote, if any."""
    url = data.dvc_remote or (None if default else DEFAULT_LOCAL_REMOTE)
    if url is None:
        return str(default), False
    if "://" not in url:
        url = str((repo_root / url).resolve())
    return url, True


def track_dataset(store: Any, key: str, data: DataConfig) -> dict[str, Any]:
    """`dvc add` + `dvc push` the curated dataset directory `key` of artifact `store` as
    `<repo>/<data.dvc_path>`.

    Copies every file of the store's committed directory (`store.get_dir(key)`: verified, so DVC
    tracks exactly the store's bytes) but its CHECKSUMS.json into the tracked folder (built in a
    temporary sibling and renamed into place). Returns {"tracked": True, "md5": "<hex>.dir",
    "size", "nfiles", "dvcfile", "path", "repo", "remote", "pushed", "seconds"}, or
    {"tracked": False, "reason"} when skipped (see the module docstring).

    Raises:
        DVCError: not in a DVC repo under data.dvc=require; DVC failed to add (e.g. another
            process holds the repo lock) or to push (remote unreachable, no credentials); after a
            failed push `data.dvc` is already rewritten, so re-run curate once the remote works.
    """
    if data.dvc == "off":
        return {"tracked": False, "reason": "off (data.dvc=off)"}
    t0 = time.perf_counter()
    root = Path(data.dvc_repo).resolve() if data.dvc_repo else find_repo()
    if root is None or not (root / ".dvc").is_dir():
        where = data.dvc_repo or f"{os.getcwd()} or above"
        return _skip(data, f"no DVC repository (.dvc/) at {where}; run curate from the envace "
                           "checkout, or `git init && dvc init` there, or set data.dvc_repo")
    target = root / data.dvc_path
    src = store.get_dir(key)

    def build(tmp: Path) -> None:
        shutil.copytree(src, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(CHECKSUMS))
        tmp.chmod(0o755)  # mkdtemp made it private; the dataset folder is for everyone who can read the repo

    atomic_dir(target, build)
    out = _add_and_push(root, data)
    out.update(dvc_md5(root / f"{data.dvc_path}.dvc"), tracked=True, repo=str(root),
               dvcfile=f"{data.dvc_path}.dvc", path=data.dvc_path,
               seconds=round(time.perf_counter() - t0, 3))
    print(f"[curate] DVC: {out['dvcfile']} -> md5 {out['md5']}; pushed {out['pushed']} new file(s) "
          f"to {out['remote']} ({out['seconds']:.2f}s). Commit {out['dvcfile']} to pin this dataset.")
    return out


def _add_and_push(root: Path, data: DataConfig) -> dict[str, Any]:
    """Run `dvc add` and `dvc push` in the repo at `root`; {"remote": url, "pushed": n files}."""
    from dvc.repo import Repo

    url = ""
    try:
        with Repo(str(root)) as probe:
            default = probe.config["core"].get("remote")
            default_url = probe.config["remote"].get(default, {}).get("url") if default else None
        url, override = remote_url(root, data, default_url)
        # an override is a remote of its own for this process only (.dvc/config is not edited); merging
        # its url into the default remote would mix keys of two remote types
        name = OVERRIDE_NAME if override else default
        with Repo(str(root), remote=name, remote_config={"url": url} if override else None) as repo:
            repo.scm_context.quiet = True  # we print our own "commit data.dvc" hint
            target = str(root / data.dvc_path)  # absolute: DVC resolves relative targets against the cwd
            repo.add(target)
            pushed = repo.push(targets=[target], remote=name)
    except Exception as e:  # noqa: BLE001  DVC remotes raise their own errors (s3fs: OSError, botocore: NoCredentialsError)
        raise DVCError(f"DVC failed in {root} (dataset {data.dvc_path!r}, remote "
                       f"{url or '?'}): {type(e).__name__}: {e}. Fix the DVC remote (data.dvc_remote, "
                       "`dvc remote modify`, the AWS environment) or set data.dvc=off") from None
    return {"remote": str(url), "pushed": pushed}  # DVC made a relative config url absolute
