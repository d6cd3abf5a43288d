"""A Flyte local run of the main workflow on a 1-task, 1-step config with a tiny random model."""

import json
from pathlib import Path


def test_train_workflow_runs_locally_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Flyte's local sandbox and any relative paths stay in tmp
    from workflows.train import train

    overrides = json.dumps({
        "model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
        "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")},
    })
    out = json.loads(train(profile="test", overrides=overrides))
    manifest = json.loads(Path(out["manifest"]).read_text())
    assert manifest["dataset"]["n_train"] == 1 and manifest["dataset"]["version"]
    assert manifest["base_model"]["sha256"] and manifest["code"]
    assert manifest["config"]["profile"] == "test"
    assert any(k.startswith("artifacts/adapter/") for k in manifest["artifacts"])
    assert "no_rehearsal|all" in manifest["metrics"]["evaluation"]
    assert "parallel:2|all" in manifest["metrics"]["evaluation"]

    from envace_core.lineage import Registry

    reg = Registry(tmp_path / "registry")
    assert reg.list() == [(out["name"], out["version"])]
    assert reg.verify(out["name"], out["version"]) == []


def test_workflow_rejects_bad_config_with_a_clear_error(tmp_path, monkeypatch):
    import pytest

    monkeypatch.chdir(tmp_path)
    from workflows.train import train

    with pytest.raises(Exception, match="unknown domain"):
        train(profile="test", overrides="data.domains=[nope]")
