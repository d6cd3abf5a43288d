"""DVC data versioning (envace_core/store/dvc.py): curate DVC-tracks the dataset, a fresh git clone
`dvc pull`s byte-identical files, S3 DVC remotes on a loopback moto server, and the no-repo cases."""

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from envace_core.config import ConfigError, DataConfig, load_config
from envace_core.store.dvc import REMOTE_NAME, DVCError, dvc_md5, track_dataset
from envace_core.store.files import dir_checksums
from envace_core.store.local import LocalStore

ROOT = Path(__file__).resolve().parent.parent


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


def _dvc(cwd, *args):
    """The `dvc` command line of this venv (DVC_NO_ANALYTICS is inherited from envace_core)."""
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True,
                          check=False)


def _dvc_repo(path: Path, remote: str | None = None) -> Path:
    """A git repo with `dvc init` and, if given, a default DVC remote named envace."""
    from dvc.repo import Repo

    path.mkdir(parents=True)
    _git(path, "init", "-q")
    Repo.init(str(path)).close()
    if remote:
        (path / ".dvc" / "config").write_text(f"[core]\n    remote = envace\n['remote \"envace\"']\n"
                                              f"    url = {remote}\n")
    return path


def _dataset(tmp_path, **files) -> tuple[LocalStore, str]:
    store = LocalStore(tmp_path / "store")
    src = tmp_path / "ds-src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    store.put_dir(src, "datasets/v1")
    return store, "datasets/v1"


def test_curate_tracks_the_dataset_and_a_fresh_clone_pulls_identical_bytes(tmp_path, monkeypatch):
    remote = tmp_path / "dvc-remote"
    origin = _dvc_repo(tmp_path / "origin", remote=str(remote))
    monkeypatch.chdir(origin)  # curate finds the DVC repo from the current directory, as `make train` does
    from envace_core.stages.curate import curate

    cfg = load_config("test", {"store": {"root": str(tmp_path / "store")}, "data": {"dvc": "require"}})
    ds = curate(cfg)
    dvc = ds["dvc"]
    assert dvc["tracked"] and dvc["md5"].endswith(".dir") and dvc["pushed"] == 3  # 2 files + .dir listing
    assert dvc["md5"] == dvc_md5(origin / "data.dvc")["md5"] and Path(dvc["remote"]) == remote
    store_dir = LocalStore(tmp_path / "store").get_dir(ds["key"])
    sums = {k: v for k, v in dir_checksums(store_dir).items() if k != "CHECKSUMS.json"}
    assert dir_checksums(origin / "data") == sums == {"manifest.json": sums["manifest.json"],
                                                      "tasks.parquet": sums["tasks.parquet"]}
    assert "/data" in (origin / ".gitignore").read_text().split()  # the data itself stays out of git

    _git(origin, "add", ".dvc/config", ".dvcignore", ".gitignore", "data.dvc")
    _git(origin, "commit", "-q", "-m", "dataset")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(origin), str(clone))
    assert not (clone / "data").exists() and (clone / "data.dvc").is_file()
    pulled = _dvc(clone, "pull")
    assert pulled.returncode == 0, pulled.stderr
    assert dir_checksums(clone / "data") == sums  # byte-identical
    assert dvc_md5(clone / "data.dvc")["md5"] == dvc["md5"]
    assert _dvc(clone, "status").stdout.strip().startswith("Data and pipelines are up to date")

    # the same dataset again: nothing new to push, the md5 is stable
    again = curate(cfg)["dvc"]
    assert again["md5"] == dvc["md5"] and again["pushed"] == 0


def test_push_to_an_s3_dvc_remote_and_pull_it_into_a_clone(s3_server, tmp_path):
    repo = _dvc_repo(tmp_path / "repo", remote=str(tmp_path / "unused-local-remote"))
    store, key = _dataset(tmp_path, **{"tasks.parquet": b"\x00parquet" * 1000, "manifest.json": b"{}"})
    url = f"{s3_server.root}/dvc-{uuid.uuid4().hex[:6]}"
    config_before = (repo / ".dvc" / "config").read_text()
    data = DataConfig(dvc="require", dvc_repo=str(repo), dvc_remote=url)
    out = track_dataset(store, key, data)
    assert out["remote"] == url and out["pushed"] == 3
    prefix = url.split("/", 3)[3]
    listed = s3_server.client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/files/md5/")
    keys = {o["Key"] for o in listed["Contents"]}
    assert f"{prefix}/files/md5/{out['md5'][:2]}/{out['md5'][2:]}" in keys and len(keys) == 3
    # the override applies to this run only: .dvc/config is untouched and holds no credentials
    assert (repo / ".dvc" / "config").read_text() == config_before
    assert not (repo / "unused-local-remote").exists()

    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "dataset")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(repo), str(clone))
    from dvc.repo import Repo

    with Repo(str(clone), remote="s3", remote_config={"url": url}) as r:
        r.pull()
    assert dir_checksums(clone / "data") == dir_checksums(repo / "data")
    assert (clone / "data" / "tasks.parquet").read_bytes() == b"\x00parquet" * 1000


def test_an_unreachable_s3_remote_is_a_clear_dvc_error(s3_server, tmp_path, monkeypatch):
    repo = _dvc_repo(tmp_path / "repo")
    store, key = _dataset(tmp_path, a=b"1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit-value-42")
    data = DataConfig(dvc_repo=str(repo), dvc_remote="s3://envace-no-such-bucket/dvc")
    with pytest.raises(DVCError, match="envace-no-such-bucket.*data.dvc=off") as err:
        track_dataset(store, key, data)
    assert "sekrit" not in str(err.value)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    nocreds = DataConfig(dvc_repo=str(repo), dvc_remote=f"{s3_server.root}/dvc")
    with pytest.raises(DVCError, match="NoCredentialsError.*the AWS environment"):
        track_dataset(store, key, nocreds)


def test_outside_a_dvc_repo_auto_skips_require_fails_off_is_silent(tmp_path, monkeypatch, capsys):
    store, key = _dataset(tmp_path, a=b"1")
    plain = tmp_path / "plain"  # a git checkout without .dvc/, e.g. a Flyte container's code copy
    plain.mkdir()
    _git(plain, "init", "-q")
    monkeypatch.chdir(plain)
    out = track_dataset(store, key, DataConfig())
    assert out["tracked"] is False and "no DVC repository" in out["reason"]
    assert "not tracking the dataset" in capsys.readouterr().out
    assert not (plain / "data").exists() and not (plain / "data.dvc").exists()
    with pytest.raises(DVCError, match="data.dvc=require but no DVC repository"):
        track_dataset(store, key, DataConfig(dvc="require"))
    assert track_dataset(store, key, DataConfig(dvc="off"))["tracked"] is False
    assert capsys.readouterr().out == ""
    with pytest.raises(DVCError, match="no DVC repository"):
        track_dataset(store, key, DataConfig(dvc="require", dvc_repo=str(plain)))


@pytest.mark.parametrize("bad", ["/abs", "../up", ".", ".dvc/x"])
def test_dvc_path_must_stay_inside_the_repo(bad):
    with pytest.raises(ConfigError, match="dvc_path"):
        load_config("test", {"data": {"dvc_path": bad}})


def test_committed_dvc_files_pin_the_default_dataset():
    """The repo's data.dvc (generated by curate on the cpu-smoke profile) and its default remote."""
    out = yaml.safe_load((ROOT / "data.dvc").read_text())["outs"][0]
    assert out["path"] == "data" and out["md5"].endswith(".dir") and out["nfiles"] >= 2
    conf = (ROOT / ".dvc" / "config").read_text()
    assert f"remote = {REMOTE_NAME}" in conf and "url = ../.envace/dvc-remote" in conf
    assert "/data" in (ROOT / ".gitignore").read_text().split()


def test_a_dvc_repo_without_git_is_tracked_without_scm(tmp_path, monkeypatch, capsys):
    """A container image carries .dvc/ and data.dvc but no .git: DVC runs without SCM, the md5 is recorded."""
    from dvc.repo import Repo

    image = tmp_path / "image"
    image.mkdir()
    Repo.init(str(image), no_scm=True).close()
    remote = tmp_path / "remote"  # the committed .dvc/config (no core.no_scm), as registration copies it
    (image / ".dvc" / "config").write_text(f"[core]\n    remote = envace\n['remote \"envace\"']\n    url = {remote}\n")
    store, key = _dataset(tmp_path, **{"tasks.parquet": b"rows", "manifest.json": b"{}"})
    monkeypatch.chdir(image)
    out = track_dataset(store, key, DataConfig(dvc="require"))
    assert out["tracked"] and out["scm"] == "none" and "no git repository" in out["scm_reason"]
    assert out["md5"] == dvc_md5(image / "data.dvc")["md5"] and out["pushed"] == 3
    assert dir_checksums(image / "data") == {k: v for k, v in dir_checksums(store.get_dir(key)).items()
                                             if k != "CHECKSUMS.json"}
    assert not (image / ".gitignore").exists() and "cannot be committed here" in capsys.readouterr().out


def test_pin_advice_says_commit_only_when_git_shows_the_dvc_file_changed(tmp_path):
    from envace_core.store.dvc import pin_advice

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "data.dvc").write_text("outs:\n- md5: a.dir\n")
    assert pin_advice(repo, "data.dvc") == "Commit data.dvc to pin this dataset."  # untracked
    _git(repo, "add", "data.dvc")
    _git(repo, "commit", "-q", "-m", "pin")
    assert pin_advice(repo, "data.dvc") == "data.dvc as committed already pins this dataset."
    (repo / "data.dvc").write_text("outs:\n- md5: b.dir\n")
    assert pin_advice(repo, "data.dvc") == "Commit data.dvc to pin this dataset."  # a new dataset
    assert "if git shows it changed" in pin_advice(tmp_path / "gone", "data.dvc")  # git cannot run there
