"""`train.init_adapter=registry:NAME@VERSION` starts a run from a registered model's adapter: the
resolved config (what every stage reads and the lineage records) names the verified version's
artifacts/adapter, in a local or an S3 registry (loopback moto server, `s3_server`); a version that is
missing, tampered, adapter-less or trained over another base model is refused before any work."""

from __future__ import annotations

import json
import shutil

import pytest

from envace_core.cli import main
from envace_core.config import ConfigError, load_config
from envace_core.stages.preflight import preflight, resolve_and_check, resolve_references
from envace_core.store.registry import HMAC_KEY_ENV, Registry
from envace_core.training.loop import load_init_adapter
from tests.test_trainer import make_trainer


@pytest.fixture(autouse=True)
def unsigned(monkeypatch):
    """Manifests unsigned, as registered here: no $ENVACE_REGISTRY_HMAC_KEY from another test of this worker
    (a key would make the hand-edited manifests below fail on their signature first)."""
    monkeypatch.delenv(HMAC_KEY_ENV, raising=False)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """A shared LoRA adapter as the trainer saves it (random B, so loading it changes the weights)."""
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    make_trainer(tiny_model_dir, lora_b_seed=5).save_adapter(str(out))
    return out


def _register(root, adapter, base_ref, version="v1", with_adapter=True):
    """Register `adapter` as policy@`version` in the registry at `root`, over the base model `base_ref`."""
    art = root.parent / f"art-{version}"
    art.mkdir(parents=True)
    if with_adapter:
        shutil.copytree(adapter, art / "adapter")
    (art / "report.json").write_text("{}")
    Registry(root).register("policy", version, art, {"base_model": {"ref": base_ref}})


def _cfg(tmp_path, model_dir, ref, registry):
    return load_config("test", {"model": {"ref": str(model_dir), "compute_dtype": "float32"},
                                "train": {"init_adapter": ref},
                                "store": {"root": str(tmp_path / "store"), "registry": str(registry)}})


def test_a_local_registry_version_resolves_to_its_verified_adapter_and_loads(adapter, tiny_model_dir, tmp_path):
    reg = tmp_path / "reg"
    _register(reg, adapter, str(tiny_model_dir))
    cfg = _cfg(tmp_path, tiny_model_dir, "registry:policy@v1", reg)
    got = resolve_references(cfg)
    assert got.train.init_adapter == str(reg.resolve() / "policy" / "v1" / "artifacts" / "adapter")
    assert cfg.train.init_adapter == "registry:policy@v1"  # the caller's config is not changed
    preflight(got)
    trainer = make_trainer(tiny_model_dir, lora_b_seed=None)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_B" in k}
    load_init_adapter(trainer, got.train.init_adapter)
    after = {k: v for k, v in trainer.model.state_dict().items() if "lora_B" in k}
    assert any(not (before[k] == after[k]).all() for k in before)
    # any other value passes through unchanged
    plain = _cfg(tmp_path, tiny_model_dir, str(adapter), reg)
    assert resolve_references(plain) is plain


def test_bad_registry_refs_are_refused_naming_the_setting(adapter, tiny_model_dir, tmp_path):
    reg = tmp_path / "reg"
    _register(reg, adapter, str(tiny_model_dir), "v1")
    _register(reg, adapter, "bundled:smollm2-135m-instruct", "other-base")
    _register(reg, adapter, str(tiny_model_dir), "no-adapter", with_adapter=False)

    def refused(ref, match):
        with pytest.raises(ConfigError, match=match) as e:
            resolve_references(_cfg(tmp_path, tiny_model_dir, ref, reg))
        assert "train.init_adapter=" in str(e.value)

    refused("registry:policy@v9", "not registered")
    refused("registry:policy@other-base", "set model.ref=bundled:smollm2-135m-instruct")
    refused("registry:policy@no-adapter", "no artifacts/adapter")
    for version, base in (("string-base", "bundled:smollm2-135m-instruct"), ("no-base", None)):
        _register(reg, adapter, str(tiny_model_dir), version)  # a manifest edited by hand: no base_model.ref
        manifest = reg / "policy" / version / "manifest.json"
        m = json.loads(manifest.read_text())
        m["base_model"] = base
        manifest.write_text(json.dumps(m))
        refused(f"registry:policy@{version}", "records no base_model.ref")
    _register(reg, adapter, str(tiny_model_dir), "no-manifest")
    (reg / "policy" / "no-manifest" / "manifest.json").unlink()
    refused("registry:policy@no-manifest", "has no manifest.json")
    weights = reg / "policy" / "v1" / "artifacts" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, other bytes
    refused("registry:policy@v1", "fails verification.*adapter_model.safetensors")


def test_an_s3_registry_version_resolves_to_its_uri(s3_server, adapter, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    art = tmp_path / "art"
    shutil.copytree(adapter, art / "adapter")
    Registry(f"{s3_server.root}/reg").register("policy", "v1", art, {"base_model": {"ref": str(tiny_model_dir)}})
    got = resolve_references(_cfg(tmp_path, tiny_model_dir, "registry:policy@v1", f"{s3_server.root}/reg"))
    assert got.train.init_adapter == f"{s3_server.root}/reg/policy/v1/artifacts/adapter"
    preflight(got)  # the s3:// adapter check: the version's commit object lists the weights


def test_config_check_prints_the_resolved_adapter(adapter, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    reg = tmp_path / "reg"
    _register(reg, adapter, str(tiny_model_dir))
    overrides = (f"model.ref={tiny_model_dir},model.compute_dtype=float32,train.init_adapter=registry:policy@v1,"
                 f"store.root={tmp_path / 'store'},store.registry={reg}")
    assert main(["config", "--profile", "test", "--overrides", overrides, "--check"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["init_adapter"] == str(reg.resolve() / "policy" / "v1" / "artifacts" / "adapter")


@pytest.mark.parametrize("ref", ["registry:policy", "registry:@v1", "registry:policy@", "registry:policy @v1",
                                 "registry:a@b@c", "registry:../../etc@v1", "registry:p@.hidden", "registry:a/b@v1"])
def test_a_malformed_registry_ref_fails_when_the_config_loads(ref, tmp_path):
    with pytest.raises(ConfigError, match="write registry:NAME@VERSION"):
        load_config("test", {"train": {"init_adapter": ref}})


@pytest.mark.parametrize("setting", ["train.init_adapter", "model.ref", "reward.judge_model"])
def test_a_registry_ref_yaml_read_as_a_mapping_is_named_as_such(setting):
    """``registry: policy@v1`` (a space after the colon) is a YAML mapping, not pydantic's "not a string"."""
    with pytest.raises(ConfigError, match=f"{setting} was read as a mapping .*without a space after the colon"):
        load_config("test", f"{setting}={{registry: policy@v1}}")
    section, key = setting.split(".")
    with pytest.raises(ConfigError, match="registry: policy@v1"):
        load_config("test", {section: {key: {"registry": "policy@v1"}}})
    with pytest.raises(ConfigError, match="expects a string"):  # other non-strings: the field's type check
        load_config("test", {section: {key: 5}})


def test_a_cluster_check_names_a_local_registry_instead_of_reading_it(tmp_path):
    cfg = load_config("test", {"train": {"init_adapter": "registry:policy@v1"}, "data": {"dvc": "off"},
                               "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "nope")}})
    assert resolve_references(cfg, remote=True) is cfg  # not read here: the cluster check names it
    with pytest.raises(ConfigError, match=r"store.registry=.* is a local path") as e:
        preflight(cfg, remote=True)
    assert "not registered" not in str(e.value)


def test_a_cluster_check_lists_every_problem_before_reading_an_s3_registry(s3_server, tmp_path):
    """On a cluster the settings' report comes first: a registry version that cannot be read (here: not
    registered) does not hide the local paths a pod cannot reach; once they are fixed, the version is named."""
    reg = f"{s3_server.root}/reg"
    over = {"train": {"init_adapter": "registry:policy@v9"}, "model": {"ref": "bundled:smollm2-135m-instruct"},
            "store": {"root": f"{s3_server.root}/store", "registry": reg},
            "reward": {"name": "judge", "judge_model": str(tmp_path)}}
    with pytest.raises(ConfigError) as e:
        resolve_and_check(load_config("test", over), remote=True)
    assert "reward.judge_model=" in str(e.value) and "is a local path" in str(e.value)
    assert "policy@v9" not in str(e.value)
    del over["reward"]
    with pytest.raises(ConfigError, match=r"train.init_adapter='registry:policy@v9': .*choose another version"):
        resolve_and_check(load_config("test", over), remote=True)


def test_a_registry_ref_with_nothing_after_the_colon_says_so():
    with pytest.raises(ConfigError, match=r"train.init_adapter=registry: names nothing after the colon"):
        load_config("test", "train.init_adapter=registry:")


@pytest.mark.parametrize("setting", ["model.ref", "reward.judge_model"])
def test_an_unknown_bundled_model_is_refused_when_the_config_loads(setting):
    with pytest.raises(ConfigError, match=rf"{setting}='bundled:smollm2' is an unknown bundled model: the only "
                                          r"one is 'bundled:smollm2-135m-instruct'"):
        load_config("test", f"{setting}=bundled:smollm2")


def test_a_model_setting_with_nothing_after_the_colon_offers_the_bundled_model():
    with pytest.raises(ConfigError, match=r"model.ref=bundled: names nothing after the colon: write e.g. "
                                          r"bundled:smollm2-135m-instruct, an s3:// URI"):
        load_config("test", "model.ref=bundled:")
