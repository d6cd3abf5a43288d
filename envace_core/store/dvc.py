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

Outside a DVC repo (a tarball without `.dvc/`), mode "auto" skips DVC with a printed reason and
returns `{"tracked": False, "reason": ...}` (recorded as such in the lineage); mode "require"
raises DVCError instead; "off" skips silently (tracked: False, reason "off").

A DVC repo without git (a container image that carries `.dvc/` and `data.dvc` but no `.git`) is
used without SCM, as `dvc init --no-scm` repos are (DVC's `core.no_scm`: `dvc.scm.SCM(root,
no_scm=True)` passed to `dvc.repo.Repo(scm=...)`): `dvc add` and `dvc push` work, nothing is
git-ignored or staged, and the result says `"scm": "none"` with the reason. The dataset's md5
reaches the lineage either way; `data.dvc` written there cannot be committed, but the pushed
content is addressed by that md5 in the remote.
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


def _repo_root(data: DataConfig) -> Path | None:
    """The DVC repo curate uses: `data.dvc_repo`, else the nearest one at or above the cwd; None if none."""
    root = Path(data.dvc_repo).resolve() if data.dvc_repo else find_repo()
    return root if root is not None and (root / ".dvc").is_dir() else None


def push_target(data: DataConfig) -> tuple[str | None, str]:
    """(url, where it came from) of the DVC remote `track_dataset` would push to, without pushing:
    `data.dvc_remote`, else the repo's default remote, else the `<repo>/.envace/dvc-remote` fallback
    (relative urls made absolute as DVC does). (None, why) when DVC would not run (data.dvc=off, no
    DVC repository). Raises DVCError if the repo's `.dvc/config` cannot be read."""
    if data.dvc == "off":
        return None, "data.dvc=off"
    root = _repo_root(data)
    if root is None:
        return None, f"no DVC repository (.dvc/) at {data.dvc_repo or f'{os.getcwd()} or above'}"
    from dvc.repo import Repo

    try:
        with Repo(str(root), scm=_scm(root)) as probe:
            default = probe.config["core"].get("remote")
            default_url = probe.config["remote"].get(default, {}).get("url") if default else None
    except Exception as e:  # noqa: BLE001  DVC's config errors have no common base but DvcException
        raise DVCError(f"cannot read the DVC config of {root}: {type(e).__name__}: {e}") from None
    url, _ = remote_url(root, data, default_url)
    where = ("data.dvc_remote" if data.dvc_remote else
             f"the default DVC remote {default!r} of {root}/.dvc/config" if default_url else
             f"the fallback {DEFAULT_LOCAL_REMOTE} (the repo has no default DVC remote)")
    return url, where


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
    root = _repo_root(data)
    if root is None:
        where = data.dvc_repo or f"{os.getcwd()} or above"
        return _skip(data, f"no DVC repository (.dvc/) at {where}; run curate from the envace "
                           "checkout, or `git init && dvc init` there, or set data.dvc_repo")
    target = root / data.dvc_path
    src = store.get_dir(key)

    def build(tmp: Path) -> None:
        shutil.copytree(src, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(CHECKSUMS))
        tmp.chmod(0o755)  # mkdtemp made it private; the dataset folder is for everyone who can read the repo

    atomic_dir(target, build)
    out = _add_and_push(root, data, _scm(root))
    out.update(dvc_md5(root / f"{data.dvc_path}.dvc"), tracked=True, repo=str(root),
               dvcfile=f"{data.dvc_path}.dvc", path=data.dvc_path,
               seconds=round(time.perf_counter() - t0, 3))
    pin = (pin_advice(root, out["dvcfile"]) if out["scm"] == "git"
           else f"{out['scm_reason']}; the lineage records the md5.")
    print(f"[curate] DVC: {out['dvcfile']} -> md5 {out['md5']}; pushed {out['pushed']} new file(s) "
          f"to {out['remote']} ({out['seconds']:.2f}s). {pin}")
    return out


def pin_advice(root: Path, dvcfile: str) -> str:
    """What to do with `dvcfile` (relative to the git work tree `root`) after `dvc add`: commit it when git
    shows it changed or untracked, nothing when the committed file already pins these bytes."""
    import subprocess

    try:
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", dvcfile],
                            capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"Commit {dvcfile} if git shows it changed, to pin this dataset."
    return f"Commit {dvcfile} to pin this dataset." if st else f"{dvcfile} as committed already pins this dataset."


def _scm(root: Path) -> Any:
    """The git repo at or above `root` as DVC's `Git`, or DVC's `NoSCM` when there is none (or no git)."""
    from dvc.scm import SCM, SCMError

    try:
        return SCM(str(root))
    except SCMError:
        return SCM(str(root), no_scm=True)


def _add_and_push(root: Path, data: DataConfig, scm: Any) -> dict[str, Any]:
    """Run `dvc add` and `dvc push` in the repo at `root` with `scm` (`_scm`);
    {"remote": url, "pushed": n files, "scm": "git" | "none", ["scm_reason"]}."""
    from dvc.repo import Repo
    from dvc.scm import NoSCM

    url = ""
    no_git = isinstance(scm, NoSCM)
    try:
        with Repo(str(root), scm=scm) as probe:
            default = probe.config["core"].get("remote")
            default_url = probe.config["remote"].get(default, {}).get("url") if default else None
        url, override = remote_url(root, data, default_url)
        # an override is a remote of its own for this process only (.dvc/config is not edited); merging
        # its url into the default remote would mix keys of two remote types
        name = OVERRIDE_NAME if override else default
        with Repo(str(root), scm=scm, remote=name, remote_config={"url": url} if override else None) as repo:
            repo.scm_context.quiet = True  # we print our own "commit data.dvc" hint
            target = str(root / data.dvc_path)  # absolute: DVC resolves relative targets against the cwd
            repo.add(target)
            pushed = repo.push(targets=[target], remote=name)
    except Exception as e:  # noqa: BLE001  DVC remotes raise their own errors (s3fs: OSError, botocore: NoCredentialsError)
        raise DVCError(f"DVC failed in {root} (dataset {data.dvc_path!r}, remote "
                       f"{url or '?'}): {type(e).__name__}: {e}. Fix the DVC remote (data.dvc_remote, "
                       "`dvc remote modify`, the AWS environment) or set data.dvc=off") from None
    out: dict[str, Any] = {"remote": str(url), "pushed": pushed}  # DVC made a relative config url absolute
    if no_git:
        out.update(scm="none", scm_reason=f"no git repository at or above {root} (e.g. a container image "
                   "without .git): DVC ran without SCM; data.dvc cannot be committed here")
    else:
        out["scm"] = "git"
    return out
