"""An s3:// `train.init_adapter` passes the preflight exactly when the train stage can load it: the
preflight reads the CHECKSUMS.json of the store directory committed at or above the URI (what
`store.uri.init_adapter_dir` downloads) and the adapter_config.json files, never the weights; what
it refuses, `init_adapter_dir` + `training.loop.load_init_adapter` refuse too. Against a loopback
moto server (`s3_server`)."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from envace_core import EnvaceError, TransientError
from envace_core.config import ConfigError, load_config
from envace_core.models import AdapterError
from envace_core.stages.preflight import preflight
from envace_core.store.registry import Registry
from envace_core.store.uri import init_adapter_dir, open_store
from envace_core.training.loop import load_init_adapter
from envace_core.training.trainer import AdapterLoadError
from tests.test_trainer import make_trainer

NO_BUCKET = "s3://no-such-bucket-xyz"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """A shared and a per-role LoRA adapter as the trainer saves them (random B: not a fresh LoRA)."""
    out = tmp_path_factory.mktemp("adapters")
    make_trainer(tiny_model_dir, lora_b_seed=5).save_adapter(str(out / "shared"))
    make_trainer(tiny_model_dir, lora_b_seed=6, policy_per_role=True).save_adapter(str(out / "per_role"))
    return out


@pytest.fixture(scope="module")
def uploaded(s3_server, adapters, tmp_path_factory):
    """The adapters in S3 as envace writes them: registry versions (reg/policy/v1 shared, reg/policy/v2
    per-role, each one committed directory holding artifacts/adapter), a store directory committed at the
    adapter itself (adapters/a1) and one committed without an adapter (adapters/empty)."""
    tmp = tmp_path_factory.mktemp("upload")
    reg = Registry(f"{s3_server.root}/reg")
    for version, which in (("v1", "shared"), ("v2", "per_role")):
        shutil.copytree(adapters / which, tmp / version / "adapter")
        reg.register("policy", version, tmp / version, {})
    store = open_store(s3_server.root)
    store.put_dir(adapters / "shared", "adapters/a1")
    (tmp / "empty").mkdir()
    (tmp / "empty" / "notes.txt").write_text("no adapter here")
    store.put_dir(tmp / "empty", "adapters/empty")
    return s3_server.root


def _cfg(tmp_path, model_dir, adapter, **train):
    return load_config("test", {"model": {"ref": str(model_dir), "compute_dtype": "float32"},
                                "train": {"init_adapter": adapter, **train},
                                "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "reg")}})


@pytest.mark.parametrize("path, per_role", [
    ("reg/policy/v1/artifacts/adapter", False),  # a registry version's adapter: a path inside its commit
    ("reg/policy/v2/artifacts/adapter", True),   # the same with act/ and rehearse/
    ("adapters/a1", False),                      # a directory committed at the adapter itself
])
def test_an_s3_init_adapter_passes_preflight_and_loads(uploaded, adapters, tiny_model_dir, tmp_path, monkeypatch,
                                                       path, per_role):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    uri = f"{uploaded}/{path}"
    cfg = _cfg(tmp_path, tiny_model_dir, uri, policy_per_role=per_role)
    preflight(cfg)
    assert not (tmp_path / "cache").exists()  # the preflight downloaded nothing
    got = init_adapter_dir(uri)
    assert got.is_relative_to(tmp_path / "cache")
    src = adapters / ("per_role" if per_role else "shared")
    for f in ["act/", "rehearse/"] if per_role else [""]:
        name = f"{f}adapter_model.safetensors"
        assert (got / name).read_bytes() == (src / name).read_bytes()
    load_init_adapter(make_trainer(tiny_model_dir, lora_b_seed=None, policy_per_role=per_role), uri)
    # a cluster run's preflight reads it the same way (after probing its bucket)
    s3 = {"root": f"{uploaded}/store", "registry": f"{uploaded}/reg"}
    preflight(load_config("test", {"train": {"init_adapter": uri, "policy_per_role": per_role}, "store": s3}),
              remote=True)


def test_an_s3_init_adapter_the_loader_refuses_fails_preflight_naming_it(uploaded, tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))

    def refused(uri, error, match, **train):
        with pytest.raises(error, match=match):
            preflight(_cfg(tmp_path, tiny_model_dir, uri, **train))

    # nothing committed at or above it: the loader finds no directory either
    none = f"{uploaded}/adapters/none"
    refused(none, EnvaceError, rf"^train.init_adapter='{none}': no committed artifact directory at or above it")
    with pytest.raises(EnvaceError, match="no committed artifact directory"):
        init_adapter_dir(none)
    # a path the registry version's commit does not hold
    missing = f"{uploaded}/reg/policy/v1/artifacts/nothing"
    refused(missing, EnvaceError, rf"^train.init_adapter='{missing}': the directory committed at .*/reg/policy/v1 "
                                  r"holds nothing under artifacts/nothing/")
    with pytest.raises(EnvaceError, match="holds nothing under artifacts/nothing/"):
        init_adapter_dir(missing)
    # committed directories without an adapter_config.json at the URI: the loader finds none either
    empty = f"{uploaded}/adapters/empty"
    refused(empty, EnvaceError, rf"^train.init_adapter='{empty}' holds no LoRA adapter \(adapter_config.json")
    version = f"{uploaded}/reg/policy/v1"
    refused(version, EnvaceError, rf"^train.init_adapter='{version}' holds no LoRA adapter .*; one is below it: "
                                  rf"train.init_adapter={version}/artifacts/adapter$")
    refused(f"{uploaded}/reg/policy/v2", EnvaceError, r"one is below it: train.init_adapter=.*/v2/artifacts/adapter$")
    for uri in (empty, version):
        with pytest.raises(AdapterLoadError, match=rf"train.init_adapter='{uri}'.*adapter_config.json is missing"):
            load_init_adapter(make_trainer(tiny_model_dir, lora_b_seed=None), uri)
    # an adapter of another layout or other LoRA settings than train.*
    shared = f"{version}/artifacts/adapter"
    refused(shared, AdapterError, r"holds one shared adapter, but train.policy_per_role=true", policy_per_role=True)
    refused(f"{uploaded}/reg/policy/v2/artifacts/adapter", AdapterError,
            r"holds per-role act/ and rehearse/ adapters, but train.policy_per_role=false")
    refused(shared, AdapterError, rf"^train.init_adapter='{shared}': {shared}/adapter_config.json has \(r, "
                                  r"lora_alpha, target_modules\).*use the adapter's LoRA settings", lora_r=4)
    with pytest.raises(AdapterLoadError, match=r"\(r, alpha, target_modules\)"):
        load_init_adapter(make_trainer(tiny_model_dir, lora_b_seed=None, lora_r=4), shared)
    # no such bucket; and a cluster run's preflight names the setting among its problems
    refused("s3://envace-no-such-bucket/a", ConfigError, r"^train.init_adapter='s3://envace-no-such-bucket/a': "
                                                         r"bucket 'envace-no-such-bucket' does not exist")
    s3 = {"root": f"{uploaded}/store", "registry": f"{uploaded}/reg"}
    with pytest.raises(ConfigError, match=rf"\n  - train.init_adapter='{empty}' holds no LoRA adapter"):
        preflight(load_config("test", {"train": {"init_adapter": empty}, "store": s3}), remote=True)


def test_an_s3_init_adapter_without_credentials_or_endpoint_fails_fast_naming_it(s3_server, tiny_model_dir,
                                                                                  tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"{NO_BUCKET}/adapter"
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    t0 = time.perf_counter()
    with pytest.raises(TransientError, match=rf"^train.init_adapter='{uri}': cannot reach S3 .*AWS_ENDPOINT_URL"):
        preflight(_cfg(tmp_path, tiny_model_dir, uri))
    assert time.perf_counter() - t0 < 15
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    with pytest.raises(ConfigError, match=rf"^train.init_adapter='{uri}': no AWS credentials found"):
        preflight(_cfg(tmp_path, tiny_model_dir, uri))
