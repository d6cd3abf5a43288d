"""benchmarks/validate_models.py: the validate stage's REHEARSE measurement over several models, cached per
model fingerprint in its JSON, with clear errors for a wrong dataset folder or JSON path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from tests.benchmark_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
vm = load_benchmark("validate_models")


def _metrics(value: float) -> dict:
    ci = {c: {"mean": value, "ci95": [value / 2, value], "n": 4} for c in vm.COLUMNS}
    return {"transitions": 4, "ci": ci, "seconds": 1.0}


def test_a_rerun_measures_only_models_it_has_not_measured(tmp_path, monkeypatch, capsys):
    measured: list[str] = []
    monkeypatch.setattr(vm, "dataset_record", lambda d, split: {"version": "v1", "store": d, "key": "k"})
    monkeypatch.setattr(vm, "measure", lambda cfg, ds, model: measured.append(model.ref) or _metrics(0.5))
    out = tmp_path / "r.json"
    argv = ["--dataset", str(tmp_path), "--json", str(out), "--models", "base=bundled:smollm2-135m-instruct"]
    assert vm.main(argv) == 0 and measured == ["bundled:smollm2-135m-instruct"]
    first = json.loads(out.read_text())["models"]["base"]
    assert first["dataset"] == "v1" and first["metrics"]["ci"]["fidelity"]["mean"] == 0.5
    assert "| base | 4 | 0.500 [0.25, 0.50]" in capsys.readouterr().out
    assert vm.main(argv) == 0 and len(measured) == 1  # cached: same model, dataset and settings
    assert vm.main(argv + ["--overrides", "validate.max_transitions=8"]) == 0 and len(measured) == 2


def test_bad_dataset_folder_and_json_path_are_named(tmp_path):
    with pytest.raises(vm.BenchmarkError, match="no readable manifest.json"):
        vm.dataset_record(str(tmp_path), "train")
    (tmp_path / "d").mkdir()
    with pytest.raises(vm.BenchmarkError, match="is a folder"):
        vm.main(["--dataset", str(tmp_path), "--json", str(tmp_path / "d"), "--models", "b=bundled:smollm2-135m-instruct"])


@pytest.mark.parametrize("text", ["[1, 2]", "null", '{"models": []}', '{"models": {"base": "x"}}'])
def test_a_json_that_is_not_a_report_is_refused_before_anything_runs(tmp_path, text):
    bad = tmp_path / "r.json"
    bad.write_text(text)
    with pytest.raises(vm.BenchmarkError, match="not a validate_models report"):
        vm.main(["--dataset", str(tmp_path), "--json", str(bad),
                 "--models", "b=bundled:smollm2-135m-instruct"])
    assert bad.read_text() == text  # left as it was
    with pytest.raises(vm.BenchmarkError, match="does not exist or is not writable"):
        vm.read_report(bad / "x.json")  # its folder is a file


@pytest.mark.parametrize("manifest", ["{}", "[]", '{"version": 3}'])
def test_a_manifest_without_a_version_is_named(tmp_path, manifest):
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(vm.BenchmarkError, match='has no "version"'):
        vm.dataset_record(str(tmp_path), "train")


def test_an_unknown_model_is_refused_before_any_loads(tmp_path, monkeypatch):
    from envace_core import EnvaceError

    monkeypatch.setattr(vm, "dataset_record", lambda d, split: {"version": "v1", "store": d, "key": "k"})
    monkeypatch.setattr(vm, "measure", lambda *a: pytest.fail("measured"))
    with pytest.raises(EnvaceError):
        vm.main(["--dataset", str(tmp_path), "--json", str(tmp_path / "r.json"),
                 "--models", "ok=bundled:smollm2-135m-instruct,a=bundled:nope"])
