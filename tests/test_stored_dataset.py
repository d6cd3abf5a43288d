"""A curated dataset in the artifact store is used only while its files match their checksums: a changed
parquet or manifest stops curate (which would reuse it) and every stage that loads it, naming the files, and
nothing in the store is rewritten."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.config import load_config
from envace_core.stages.curate import curate
from envace_core.stages.dataset import load_dataset
from envace_core.store.base import StoreError
from envace_core.store.files import dir_checksums


def _cfg(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no DVC repo here: curate skips DVC tracking
    return load_config("test", {"store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "reg")},
                                "data": {"max_train_tasks_per_domain": 2, "max_test_tasks_per_domain": 1}})


@pytest.mark.parametrize("damage", ["rows_dropped", "manifest_edited", "checksums_not_json"])
def test_a_changed_stored_dataset_is_refused_by_curate_and_by_every_loader(tmp_path, monkeypatch, damage):
    cfg = _cfg(tmp_path, monkeypatch)
    ds = curate(cfg)
    d = Path(ds["dir"])
    assert load_dataset(ds, cfg.data.train_split)
    if damage == "rows_dropped":  # a parquet cut to its first rows
        pd.read_parquet(d / "tasks.parquet").head(1).to_parquet(d / "tasks.parquet", index=False)
        name = "tasks.parquet"
    elif damage == "manifest_edited":
        (d / "manifest.json").write_text((d / "manifest.json").read_text().replace('"version"', '"version" ', 1))
        name = "manifest.json"
    else:
        (d / "CHECKSUMS.json").write_text("{bad")
        name = "CHECKSUMS.json"
    before = dir_checksums(d)
    needle = rf"was changed after it was written \(files that differ from its CHECKSUMS.json: [^)]*{name}\)"
    with pytest.raises(StoreError, match=needle):
        load_dataset(ds, cfg.data.train_split)
    with pytest.raises(StoreError, match=needle):
        curate(cfg)
    assert dir_checksums(d) == before  # nothing rewritten


def test_an_intact_stored_dataset_is_reused(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, monkeypatch)
    first = curate(cfg)
    again = curate(cfg)
    assert again["version"] == first["version"] and again["dir"] == first["dir"]


def test_a_changed_dataset_folder_given_as_a_tasks_file_is_refused(tmp_path, monkeypatch):
    """`envace rehearse --tasks <dataset folder>` and the benchmarks read a folder as curate wrote it."""
    from envace_core import EnvaceError
    from envace_core.stages.dataset import read_tasks_file

    cfg = _cfg(tmp_path, monkeypatch)
    d = Path(curate(cfg)["dir"])
    assert read_tasks_file(d)
    pd.read_parquet(d / "tasks.parquet").head(1).to_parquet(d / "tasks.parquet", index=False)
    with pytest.raises(EnvaceError, match=r"dataset folder .* was changed after it was written \(files that differ "
                                          r"from its CHECKSUMS.json: tasks.parquet\)"):
        read_tasks_file(d)
    with pytest.raises(EnvaceError, match=r"dataset folder .* was changed after it was written"):
        read_tasks_file(d / "tasks.parquet")  # the folder's own file, named directly
