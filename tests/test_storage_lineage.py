import json

import pytest

from envace_core.lineage import Registry, RegistryError, git_state
from envace_core.storage import LocalStore, StoreError


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
    # no temporary siblings are left behind
    assert sorted(p.name for p in store.path("ckpt").iterdir()) == ["1"]


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
    assert sorted(p.name for p in store.root.iterdir()) == ["ckpt"]


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
    assert reg.verify("m", "1") == ["manifest.json (signature)"]
    monkeypatch.setenv("ENVACE_REGISTRY_HMAC_KEY", "another key")
    man["metrics"]["pass^1"] = 0.1
    (path / "manifest.json").write_text(json.dumps(man))
    assert reg.verify("m", "1") == ["manifest.json (signature)"]  # wrong key: not trusted
