"""A local run's preflight checks every S3 location it will use, as it checks `store.root`: an s3://
`store.registry` and an s3:// `data.dvc_remote` without credentials or bucket fail in seconds naming the
setting (not at the register stage, or after curate); reading a local registry never creates its folder;
`check_adapter_dir` (`envace rehearse --adapter`) reads an s3:// adapter or names its URI intact."""

from __future__ import annotations

import json

import pytest

from envace_core.cli import main
from envace_core.config import ConfigError, load_config
from envace_core.models import AdapterError, check_adapter_dir
from envace_core.stages.preflight import preflight
from envace_core.store.base import StoreError
from envace_core.store.registry import Registry, RegistryError

NO_BUCKET = "s3://no-such-bucket-xyz"


def _no_aws(monkeypatch):
    """No AWS credentials anywhere (the module's moto fixture may have set fake ones)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


def _local(tmp_path, **over):
    store = {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry"), **over.pop("store", {})}
    return load_config("test", {"store": store, **over})


# ------------------------------------------------------------------------------- store.registry
def test_an_s3_registry_without_credentials_fails_the_local_preflight(tmp_path, monkeypatch, capsys):
    _no_aws(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match=rf"^store.registry='{NO_BUCKET}/reg': no AWS credentials found"):
        preflight(_local(tmp_path, store={"registry": f"{NO_BUCKET}/reg"}))
    over = f"store.root={tmp_path / 'store'},store.registry={NO_BUCKET}/reg"
    assert main(["--profile", "test", "--overrides", over, "config", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"envace: error: store.registry='{NO_BUCKET}/reg': no AWS credentials")


def test_an_s3_registry_bucket_is_probed_and_a_local_one_is_writable(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    preflight(_local(tmp_path, store={"registry": f"{s3_server.root}/reg"}))
    with pytest.raises(StoreError, match=r"store.registry='s3://envace-no-such-bucket/reg': bucket "
                                         r"'envace-no-such-bucket' does not exist.*fix store.registry"):
        preflight(_local(tmp_path, store={"registry": "s3://envace-no-such-bucket/reg"}))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(RegistryError, match=r"cannot use .*a-file as the model registry \(store.registry\): "
                                            r".*is a file, not a folder"):
        preflight(_local(tmp_path, store={"registry": str(tmp_path / "a-file")}))
    preflight(_local(tmp_path))  # a run will register here: the check makes the folder, as before
    assert (tmp_path / "registry").is_dir()


# ------------------------------------------------------------------------------ data.dvc_remote
def test_an_s3_dvc_remote_without_credentials_fails_the_local_preflight(tmp_path, monkeypatch, capsys):
    _no_aws(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^data.dvc_remote='{NO_BUCKET}/dvc': no AWS credentials found"):
        preflight(_local(tmp_path, data={"dvc": "auto", "dvc_remote": f"{NO_BUCKET}/dvc"}))
    preflight(_local(tmp_path, data={"dvc": "off", "dvc_remote": f"{NO_BUCKET}/dvc"}))  # DVC will not push
    over = f"store.root={tmp_path / 's'},store.registry={tmp_path / 'r'},data.dvc=auto,data.dvc_remote={NO_BUCKET}/dvc"
    assert main(["--profile", "test", "--overrides", over, "config", "--check"]) == 2
    assert capsys.readouterr().err.startswith(f"envace: error: data.dvc_remote='{NO_BUCKET}/dvc': no AWS credentials")


def test_an_s3_dvc_remote_bucket_is_probed(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    preflight(_local(tmp_path, data={"dvc": "auto", "dvc_remote": f"{s3_server.root}/dvc"}))
    with pytest.raises(ConfigError, match=r"data.dvc_remote='s3://envace-no-such-bucket/dvc': bucket "
                                          r"'envace-no-such-bucket' does not exist.*fix data.dvc_remote"):
        preflight(_local(tmp_path, data={"dvc": "require", "dvc_remote": "s3://envace-no-such-bucket/dvc"}))


# ------------------------------------------------------------------------- reading the registry
def test_reading_a_missing_local_registry_says_so_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "misspelt" / "folder"
    reg = Registry(missing)
    for read in (reg.list, lambda: reg.show("m", "1"), lambda: reg.verify("m", "1"), lambda: reg.local_dir("m", "1")):
        with pytest.raises(RegistryError, match=r"model registry folder .*misspelt/folder \(store.registry\) "
                                                r"does not exist: nothing is registered there; fix store.registry"):
            read()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(RegistryError, match=r"a-file \(store.registry\) is a file, not a folder: nothing is "
                                            r"registered there; give store.registry a folder$"):
        Registry(tmp_path / "a-file").list()
    assert main(["--overrides", f"store.registry={missing}", "registry", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("envace: error: the model registry folder") and "does not exist" in err
    assert not (tmp_path / "misspelt").exists()
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "w").write_bytes(b"w")
    reg.register("m", "1", tmp_path / "art", {})  # writing makes the folder
    assert reg.list() == [("m", "1")]
    with pytest.raises(RegistryError, match="m@2 is not registered in"):
        reg.show("m", "2")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(RegistryError, match="is a file, not a folder"):
        Registry(tmp_path / "a-file").list()


# ------------------------------------------------------------------------- an s3:// LoRA adapter
def test_an_s3_adapter_without_credentials_keeps_its_uri(tmp_path, monkeypatch, capsys):
    _no_aws(monkeypatch)
    with pytest.raises(AdapterError, match=rf"^LoRA adapter '{NO_BUCKET}/adapter': no AWS credentials found"):
        check_adapter_dir(f"{NO_BUCKET}/adapter")
    with pytest.raises(AdapterError, match=r"^LoRA adapter 'hf://org/adapter': give a local LoRA adapter folder "
                                           r"or an s3:// URI"):
        check_adapter_dir("hf://org/adapter")
    over = json.dumps({"store": {"root": str(tmp_path / "s"), "registry": str(tmp_path / "r")}})
    assert main(["--profile", "test", "--overrides", over, "rehearse", "--task", "airline/3",
                 "--adapter", f"{NO_BUCKET}/adapter"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"envace: error: LoRA adapter '{NO_BUCKET}/adapter': no AWS credentials")
    assert len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from envace_core.models import load_model

    d = tmp_path_factory.mktemp("adapters") / "adapter"
    get_peft_model(load_model(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(d)
    return d


def test_an_s3_adapter_in_a_registry_is_read_like_train_init_adapter(s3_server, tiny_adapter, tiny_model_dir,
                                                                     tmp_path, monkeypatch):
    import shutil

    from peft import PeftModel

    from envace_core.training.policy import load_policy

    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_adapter, tmp_path / "art" / "adapter")
    reg = Registry(f"{s3_server.root}/reg")
    reg.register("policy", "v1", tmp_path / "art", {})
    uri = f"{s3_server.root}/reg/policy/v1/artifacts/adapter"
    (got,) = check_adapter_dir(uri)
    assert got.is_relative_to(tmp_path / "cache")
    assert (got / "adapter_model.safetensors").read_bytes() == (tiny_adapter / "adapter_model.safetensors").read_bytes()
    cfg = load_config("test", {"model": {"compute_dtype": "float32", "ref": str(tiny_model_dir)}})
    model, _, _ = load_policy(cfg, uri)  # what `envace rehearse --adapter s3://...` loads
    assert isinstance(model, PeftModel) and model.peft_config["default"].r == 2
    for bad in (f"{s3_server.root}/reg/policy/v2/artifacts/adapter", f"{s3_server.root}/reg/policy/v1/nothing"):
        with pytest.raises(AdapterError, match=rf"^LoRA adapter '{bad}': no adapter folder written by envace there"):
            check_adapter_dir(bad)
    with pytest.raises(AdapterError, match=r"LoRA adapter 's3://envace-no-such-bucket/a': bucket "
                                           r"'envace-no-such-bucket' does not exist"):
        check_adapter_dir("s3://envace-no-such-bucket/a")
