import json
import os
from pathlib import Path

import pytest

from envace_core.buildinfo import git_state
from envace_core.store.base import StoreError
from envace_core.store.files import dir_checksums
from envace_core.store.local import LocalStore
from envace_core.cli import main as cli_main
from envace_core.store.registry import BAD_SIGNATURE, UNSIGNED, Registry, RegistryError


def test_put_dir_is_atomic_and_checksummed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"abc")
    store = LocalStore(tmp_path / "store")
    sums = store.put_dir(src, "ckpt/1")
    assert set(sums) == {"a.bin"}
    assert store.verify_dir("ckpt/1") == []
    (store.path("ckpt/1") / "a.bin").write_bytes(b"tampered")
    assert store.verify_dir("ckpt/1") == ["a.bin"]
    # nothing beside the key but the one version folder its pointer names
    assert sorted(p.name for p in store.path("ckpt").iterdir()) == sorted(["1", os.readlink(store.path("ckpt/1"))])


def test_failed_copy_leaves_previous_version_intact(tmp_path, monkeypatch):
    import shutil

    store = LocalStore(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_text("v1")
    store.put_dir(src, "ckpt")
    (src / "w").write_text("v2")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copytree", boom)
    with pytest.raises(OSError):
        store.put_dir(src, "ckpt")
    assert (store.path("ckpt") / "w").read_text() == "v1"
    assert sorted(p.name for p in store.root.iterdir()) == sorted(["ckpt", os.readlink(store.path("ckpt"))])


def test_bad_keys_and_corrupt_json(tmp_path):
    store = LocalStore(tmp_path)
    with pytest.raises(StoreError):
        store.path("../escape")
    store.write_bytes("x.json", b"{not json")
    with pytest.raises(StoreError, match="corrupt"):
        store.read_json("x.json")
    with pytest.raises(StoreError, match="not found"):
        store.read_bytes("missing")


def test_registry_register_list_verify_and_refuse_duplicate(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    (art / "adapter.safetensors").write_bytes(b"weights")
    reg = Registry(tmp_path / "reg")
    path = reg.register("m", "1", art, {"dataset": {"version": "d1"}, "code": git_state()})
    man = json.loads((path / "manifest.json").read_text())
    assert man["artifacts"]["artifacts/adapter.safetensors"]
    assert reg.list() == [("m", "1")]
    assert reg.verify("m", "1") == []
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("m", "1", art, {})
    (path / "artifacts" / "adapter.safetensors").write_bytes(b"evil")
    assert reg.verify("m", "1") == ["artifacts/adapter.safetensors"]


def test_signed_manifest_detects_an_edited_metric(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVACE_REGISTRY_HMAC_KEY", "k3y")
    art = tmp_path / "art"
    art.mkdir()
    (art / "w").write_bytes(b"w")
    reg = Registry(tmp_path / "reg")
    path = reg.register("m", "1", art, {"metrics": {"pass^1": 0.1}})
    man = json.loads((path / "manifest.json").read_text())
    assert man["signature"]["alg"] == "HMAC-SHA256"
    assert reg.verify("m", "1") == []
    man["metrics"]["pass^1"] = 0.9
    (path / "manifest.json").write_text(json.dumps(man))
    assert reg.verify("m", "1") == [BAD_SIGNATURE]
    monkeypatch.setenv("ENVACE_REGISTRY_HMAC_KEY", "another key")
    man["metrics"]["pass^1"] = 0.1
    (path / "manifest.json").write_text(json.dumps(man))
    assert reg.verify("m", "1") == [BAD_SIGNATURE]  # wrong key: not trusted


def test_a_version_registered_without_a_key_is_unsigned_not_tampered(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ENVACE_REGISTRY_HMAC_KEY", raising=False)
    art = tmp_path / "art"
    art.mkdir()
    (art / "w").write_bytes(b"w")
    Registry(tmp_path / "reg").register("m", "1", art, {"metrics": {"pass^1": 0.1}})
    monkeypatch.setenv("ENVACE_REGISTRY_HMAC_KEY", "k3y")
    assert Registry(tmp_path / "reg").verify("m", "1") == [UNSIGNED]
    rc = cli_main(["--profile", "test", "--overrides", f"store.registry={tmp_path / 'reg'}", "registry", "verify",
                   "m@1"])
    out = capsys.readouterr().out
    assert rc == 1 and out.startswith("UNSIGNED m@1: every artifact matches its sha256") and "TAMPERED" not in out


def test_register_writes_every_lineage_field_the_auditors_need(tmp_path, monkeypatch, capsys):
    """Issue item 5: name+version, base model+hash, dataset DVC hash, git commit+dirty, full config,
    Flyte execution id, metrics, both gates, and sha256 of every artifact (gate reports included)."""
    from envace_core.config import load_config
    from envace_core.models import model_fingerprint
    from envace_core.stages.register import register

    monkeypatch.setenv("ENVACE_REGISTRY_HMAC_KEY", "k")
    cfg = load_config("test", {"store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "reg")}})
    store = LocalStore(cfg.store.root)
    store.write_json("validation/dataset/d1/gate.json", {"success": True, "checks": {"schema": True}})
    store.write_json("validation/r1/gate.json", {"success": True, "checks": {"fidelity": True}})
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    (base / "model.safetensors").write_bytes(b"base weights")
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    dvc = {"tracked": True, "md5": "0123abcd.dir", "remote": "/r", "dvcfile": "data.dvc"}
    dataset = {"version": "d1", "dir": "x", "n_train": 1, "n_test": 1, "gate": {"schema": True},
               "gate_key": "validation/dataset/d1/gate.json", "dvc": dvc}
    trained = {"adapter_dir": str(adapter), "base_model_dir": str(base), "run_id": "r1",
               "history": [{"iteration": 1, "train/loss": 0.5}], "learning_signal": True}
    validation = {"metrics": {"fidelity": 0.7}, "gate": {"fidelity": True}, "gate_key": "validation/r1/gate.json"}
    from envace_core.stages.compare import summarize

    comparison = summarize({"test": {"base": {"a": 1.0, "b": 0.0}, "trained": {"a": 0.0, "b": 0.0}}}, {"test": 2})
    evaluation = {"summary": {"no_rehearsal|all": {"pass^1": 0.25}}, "comparison": {"summary": comparison}}
    out = register(cfg, dataset, trained, validation, evaluation, execution_id="f1234-n0-0")
    # a model below its base is registered (the record shows what the run made), with a warning saying so
    assert "WARNING: the registered model scores below" in capsys.readouterr().out

    m = json.loads(Path(out["manifest"]).read_text())
    assert (m["name"], m["version"]) == (cfg.store.model_name, out["version"])
    assert m["base_model"] == {"ref": cfg.model.ref, "sha256": model_fingerprint(base), "fingerprint": "weights"}
    assert m["dataset"]["dvc"]["md5"] == "0123abcd.dir" and m["dataset"]["version"] == "d1"
    assert m["code"]["commit"] and isinstance(m["code"]["dirty"], bool) and m["code"]["commit_source"] == "git"
    assert m["code"]["packages"]["envace"] and m["code"]["packages"]["torch"]
    assert m["config"] == cfg.to_dict() and m["execution_id"] == "f1234-n0-0"
    assert m["metrics"]["training"]["train/loss"] == 0.5 and m["metrics"]["validation"]["fidelity"] == 0.7
    assert m["metrics"]["evaluation"] == {"no_rehearsal|all": 0.25}
    assert m["metrics"]["comparison"] == comparison and len(m["metrics"]["regressions"]) == 1
    assert m["metrics"]["regressions"][0].startswith("test: trained - base = -0.500")
    assert m["gates"] == {"dataset": {"schema": True}, "rehearsal": {"fidelity": True}}
    vdir = Path(out["path"])
    assert json.loads((vdir / "artifacts/gates/dataset.json").read_text())["checks"] == {"schema": True}
    on_disk = {f"artifacts/{k}": v for k, v in dir_checksums(vdir / "artifacts").items()}
    assert m["artifacts"] == on_disk and "artifacts/adapter/adapter_model.safetensors" in on_disk
    assert m["signature"]["alg"] == "HMAC-SHA256"
    reg = Registry(cfg.store.registry)
    assert reg.verify(out["name"], out["version"]) == [] and reg.uri(out["name"], out["version"]) == str(vdir)


def test_build_info_reads_the_baked_file_in_a_pod_without_git(tmp_path, monkeypatch):
    from envace_core.buildinfo import build_info

    for var in ("FLYTE_INTERNAL_IMAGE", "ENVACE_IMAGE", "_F_IMG_ID"):
        monkeypatch.delenv(var, raising=False)
    nogit, baked = tmp_path / "pod", tmp_path / "BUILD_INFO.json"
    nogit.mkdir()
    info = build_info(build_file=baked, repo_dir=nogit)
    assert info["commit"] is None and "not a git checkout" in info["note"] and info["image"] is None
    assert info["packages"]["envace"] and "vllm" in info["packages"]
    baked.write_text(json.dumps({"commit": "a" * 40, "source_date": "2025-06-01T12:00:00+00:00"}))
    monkeypatch.setenv("ENVACE_IMAGE", "reg.example/envace-cpu:abc")
    info = build_info(build_file=baked, repo_dir=nogit)
    assert (info["commit"], info["source_date"], info["commit_source"]) == ("a" * 40, "2025-06-01T12:00:00+00:00",
                                                                            "BUILD_INFO.json")
    assert info["dirty"] is None and "note" not in info
    assert (info["image"], info["image_source"]) == ("reg.example/envace-cpu:abc", "ENVACE_IMAGE")
    monkeypatch.setenv("FLYTE_INTERNAL_IMAGE", "reg.example/envace-train:def")
    assert build_info(build_file=baked, repo_dir=nogit)["image_source"] == "FLYTE_INTERNAL_IMAGE"
    baked.write_text("[1]")  # damaged: the checkout's own commit is used, with a note
    info = build_info(build_file=baked)
    assert info["commit_source"] == "git" and len(info["commit"]) == 40 and "not a JSON object" in info["note"]


def test_writable_checks_name_what_cannot_be_written(tmp_path):
    """The checks tools make before a model loads: a folder given as a file, a parent that is a file, a
    read-only folder (tried with a real file: root passes os.access there) and a read-only file."""
    from envace_core.store.files import writable_dir_problem, writable_file_problem

    (tmp_path / "afile").write_text("x")
    assert writable_file_problem(tmp_path / "new" / "r.json") is None and (tmp_path / "new").is_dir()
    assert writable_file_problem(tmp_path) == "a folder; give a file path"
    assert "afile is a file, not a folder" in writable_file_problem(tmp_path / "afile" / "r.json")
    assert writable_dir_problem(tmp_path / "afile").endswith("afile is a file, not a folder")
    assert "cannot write in the folder /proc" in writable_dir_problem("/proc")
    assert writable_file_problem(tmp_path / "afile") is None
    assert (tmp_path / "afile").read_text() == "x"  # tried, not touched
    long = tmp_path / ("a" * 300)  # longer than a file name may be: one line, no OSError
    assert "File name too long" in writable_dir_problem(long) and "File name too long" in writable_file_problem(long)
    if os.geteuid() != 0:  # root writes read-only files
        (tmp_path / "afile").chmod(0o444)
        assert "cannot write the file" in writable_file_problem(tmp_path / "afile")


def test_a_report_path_over_a_file_that_is_not_such_a_report_is_named(tmp_path):
    """A benchmark's --json rewrites its file and --results-md appends: neither may land on an input."""
    from envace_core.store.files import report_overwrite_problem

    (tmp_path / "tasks.parquet").write_bytes(b"PAR1")
    (tmp_path / "RESULTS.md").write_text("# results\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "report.json").write_text('{"run": {}}')
    assert "not a .json report would be overwritten" in report_overwrite_problem(tmp_path / "tasks.parquet", "json")
    assert "not a .json report" in report_overwrite_problem(tmp_path / "RESULTS.md", "json")
    assert "not a JSON report (an object)" in report_overwrite_problem(tmp_path / "list.json", "json")
    assert "not a .md report would be appended to" in report_overwrite_problem(tmp_path / "report.json", "md")
    for path, kind in ((tmp_path / "report.json", "json"), (tmp_path / "RESULTS.md", "md"),
                       (tmp_path / "new.json", "json"), (tmp_path, "json")):
        assert report_overwrite_problem(path, kind) is None, path
    assert (tmp_path / "tasks.parquet").read_bytes() == b"PAR1"


def test_a_store_root_that_is_a_file_or_unwritable_is_named(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="is a file, not a folder: give a folder as store.root"):
        LocalStore(tmp_path / "f")
    store = LocalStore(tmp_path / "s")
    store.root = Path("/proc")  # a folder nobody writes, root included (os.access says yes there)
    with pytest.raises(StoreError, match="is not writable"):
        store.check()


@pytest.mark.parametrize("signature", ["abc", ["x"], {"value": 123}, {"value": "\u00e9\u00e9\u00e9"}, {"alg": "x"}])
def test_a_malformed_signature_field_fails_verification_without_a_traceback(tmp_path, monkeypatch, signature):
    monkeypatch.setenv("ENVACE_REGISTRY_HMAC_KEY", "k3y")
    art = tmp_path / "art"
    art.mkdir()
    (art / "w").write_bytes(b"w")
    reg = Registry(tmp_path / "reg")
    path = reg.register("m", "1", art, {})
    man = json.loads((path / "manifest.json").read_text())
    man["signature"] = signature
    (path / "manifest.json").write_text(json.dumps(man))
    assert reg.verify("m", "1") == [UNSIGNED if signature == {"alg": "x"} else BAD_SIGNATURE]


@pytest.mark.parametrize("content, problem", [("[" * 100_000, "nested too deep"),
                                              ('{"n": ' + "9" * 5000 + "}", "digits")])
def test_a_manifest_python_cannot_parse_is_corrupt_not_a_traceback(tmp_path, monkeypatch, content, problem):
    monkeypatch.delenv("ENVACE_REGISTRY_HMAC_KEY", raising=False)
    art = tmp_path / "art"
    art.mkdir()
    (art / "w").write_bytes(b"w")
    reg = Registry(tmp_path / "reg")
    (reg.register("m", "1", art, {}) / "manifest.json").write_text(content)
    bad = reg.verify("m", "1")
    assert len(bad) == 1 and bad[0].startswith("manifest.json (") and problem in bad[0]
    with pytest.raises(RegistryError, match="is corrupt"):
        reg.show("m", "1")


def test_verify_says_which_artifacts_are_changed_missing_or_not_in_the_manifest(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ENVACE_REGISTRY_HMAC_KEY", raising=False)
    art = tmp_path / "art"
    art.mkdir()
    for name in ("a", "b"):
        (art / name).write_bytes(name.encode())
    path = Registry(tmp_path / "reg").register("m", "1", art, {})
    (path / "artifacts" / "a").write_bytes(b"changed")
    (path / "artifacts" / "b").unlink()
    (path / "artifacts" / "c").write_bytes(b"extra")
    rc = cli_main(["--profile", "test", "--overrides", f"store.registry={tmp_path / 'reg'}", "registry", "verify",
                   "m@1"])
    assert rc == 1 and capsys.readouterr().out.splitlines() == [
        "TAMPERED m@1: 3 file(s) fail verification:", "  artifacts/a (changed)", "  artifacts/b (missing)",
        "  artifacts/c (not in the manifest)"]
