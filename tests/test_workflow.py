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

    from envace_core.store.registry import Registry

    reg = Registry(tmp_path / "registry")
    assert reg.list() == [(out["name"], out["version"])]
    assert reg.verify(out["name"], out["version"]) == []

    # the training metrics, as TensorBoard event files beside the run's checkpoint
    from envace_core.training.tracking import read_scalars

    [run] = list((tmp_path / "store" / "runs").iterdir())
    scalars = read_scalars(run / "tensorboard")
    assert [step for step, _ in scalars["frac_zero_std"]] == [1] and "seconds" in scalars


def test_workflow_rejects_bad_config_with_a_clear_error(tmp_path, monkeypatch):
    import pytest

    monkeypatch.chdir(tmp_path)
    from workflows.train import train

    with pytest.raises(Exception, match="unknown domain"):
        train(profile="test", overrides="data.domains=[nope]")


def test_workflow_with_an_s3_artifact_store_resumes_from_s3(s3_server, tiny_model_dir, tmp_path,
                                                            monkeypatch):
    """Datasets and checkpoints in S3 (a real moto server on loopback); a re-run resumes from S3."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    from envace_core.config import load_config
    from envace_core.stages.curate import curate
    from envace_core.stages.train import rollout_and_train
    from envace_core.store.uri import open_store

    cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                               "store": {"root": f"{s3_server.root}/envace",
                                         "registry": str(tmp_path / "registry")}})
    ds = curate(cfg)
    first = rollout_and_train(cfg, ds)
    store = open_store(cfg.store.root)
    assert store.exists(f"runs/{first['run_id']}/checkpoint/state.json")
    import shutil

    shutil.rmtree(tmp_path / "cache")  # a fresh machine: nothing local, everything from S3
    again = rollout_and_train(cfg, ds)
    assert again["history"] == first["history"]  # resumed, not retrained
    assert (Path(again["adapter_dir"]) / "adapter_config.json").is_file()


def test_weekly_retrain_launch_plan_is_scheduled_with_the_gpu_profile():
    from workflows.train import weekly_retrain

    assert weekly_retrain.schedule.cron_schedule.schedule == "0 3 * * 0"
    assert weekly_retrain.fixed_inputs.literals["profile"].scalar.primitive.string_value == "gpu-8b"
