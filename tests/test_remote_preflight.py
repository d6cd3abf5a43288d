"""Preflight of a remote (cluster) execution: a store, registry, DVC remote or model that is a pod-local
path, a placeholder, or S3 that cannot be used fails in seconds with one message naming each setting
(envace_core/stages/preflight.py `check_remote_settings`), against a loopback moto server."""

import socket
import time
import uuid

import pytest

from envace_core import TransientError
from envace_core.config import ConfigError, load_config
from envace_core.stages.preflight import preflight


def _cfg(**over):
    return load_config("test", over)


def _problems(err) -> list[str]:
    return [line[4:] for line in str(err.value).splitlines() if line.startswith("  - ")]


def test_local_paths_are_refused_on_a_remote_run_but_fine_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no DVC repo here; data.dvc=off in the test profile anyway
    cfg = _cfg(store={"root": str(tmp_path / "store"), "registry": str(tmp_path / "reg")})
    preflight(cfg)  # a local run keeps working with local folders
    with pytest.raises(ConfigError) as err:
        preflight(cfg, remote=True)
    problems = _problems(err)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"store.root={str(tmp_path / 'store')!r} is a local path: on a cluster each "
                                  "stage runs in its own pod") and "set store.root=s3://" in problems[0]
    assert problems[1].startswith("store.registry=") and "set store.registry=s3://" in problems[1]
    model = _cfg(model={"ref": str(tmp_path)}, store={"root": "s3://xx1/y", "registry": "s3://CHANGE-ME/r"})
    with pytest.raises(ConfigError, match=r"model.ref=.* is a local path.*bundled:smollm2") as err:
        preflight(model, remote=True)
    assert "not this machine's disk" in str(err.value)  # an input the pod cannot see, not an output it loses
    assert "later stages would not find" in problems[0]
    assert any(p.startswith("store.registry='s3://CHANGE-ME/r' is a placeholder") for p in _problems(err))


def test_the_gpu_profile_placeholders_fail_in_one_message_without_any_request(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        preflight(load_config("gpu-8b"), remote=True)
    assert time.perf_counter() - t0 < 5
    settings = [p.split("=", 1)[0] for p in _problems(err)]
    assert settings == ["store.root", "store.registry", "model.ref", "data.dvc_remote"], str(err.value)
    assert all("is a placeholder: set " in p for p in _problems(err))


def test_a_local_default_dvc_remote_is_refused_and_require_needs_a_repo(tmp_path, monkeypatch, s3_server):
    from dvc.repo import Repo

    repo = tmp_path / "image"  # .dvc/ with envace's committed default remote, as the image carries it
    repo.mkdir()
    Repo.init(str(repo), no_scm=True).close()
    (repo / ".dvc" / "config").write_text("[core]\n    remote = envace\n['remote \"envace\"']\n"
                                          "    url = ../.envace/dvc-remote\n")
    monkeypatch.chdir(repo)
    s3 = {"root": f"{s3_server.root}/store", "registry": f"{s3_server.root}/reg"}
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(store=s3, data={"dvc": "auto"}), remote=True)
    (problem,) = _problems(err)
    assert problem.startswith("data.dvc_remote (unset: the default DVC remote 'envace' of ")
    assert "is a local path" in problem and "data.dvc_remote=s3://BUCKET/PREFIX, or data.dvc=off" in problem
    preflight(_cfg(store=s3, data={"dvc": "auto", "dvc_remote": f"{s3_server.root}/dvc"}), remote=True)
    monkeypatch.chdir(tmp_path)  # no DVC repository at all
    with pytest.raises(ConfigError, match="data.dvc=require but no DVC repository"):
        preflight(_cfg(store=s3, data={"dvc": "require"}), remote=True)
    preflight(_cfg(store=s3, data={"dvc": "auto"}), remote=True)  # auto skips DVC and records why


def test_s3_settings_are_probed_bucket_credentials_endpoint_and_model(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = s3_server.root
    good = {"root": f"{root}/store", "registry": f"{root}/reg"}
    preflight(_cfg(store=good), remote=True)

    with pytest.raises(ConfigError) as err:
        preflight(_cfg(store={**good, "registry": "s3://envace-no-such-bucket/reg"},
                       model={"ref": f"{root}/models/none"}), remote=True)
    problems = _problems(err)
    assert len(problems) == 2, problems
    assert problems[0].startswith("store.registry='s3://envace-no-such-bucket/reg': bucket "
                                  "'envace-no-such-bucket' does not exist") and "fix store.registry" in problems[0]
    assert problems[1].startswith(f"model.ref='{root}/models/none' holds no config.json")
    assert not isinstance(err.value, TransientError)

    s3_server.client.put_object(Bucket=s3_server.bucket, Key="models/tiny/config.json", Body=b"{}")
    preflight(_cfg(store=good, model={"ref": f"{root}/models/tiny"}), remote=True)

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match=r"store.root='s3://.*': no AWS credentials found"):
        preflight(_cfg(store=good), remote=True)


def test_an_unreachable_endpoint_fails_within_seconds_and_is_probed_once(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    bucket = f"b-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(store={"root": f"s3://{bucket}/s", "registry": f"s3://other-{bucket}/r"}), remote=True)
    assert time.perf_counter() - t0 < 15
    problems = _problems(err)
    assert "cannot reach S3" in problems[0] and problems[0].startswith("store.root=")
    assert problems[1].endswith("not checked, S3 is unusable (above)")


@pytest.mark.parametrize("over, named", [
    ({"store": {"root": "S3://Bkt/x"}}, "store.root='S3://Bkt/x' has the scheme 'S3'"),
    ({"store": {"registry": "s3:/bkt/reg"}}, "store.registry='s3:/bkt/reg' has the scheme 's3'"),
    ({"store": {"registry": "s3://bkt//reg"}}, "store.registry='s3://bkt//reg' is not a valid S3 URI"),
    ({"store": {"root": "s3://bkt/store train.iterations=5"}}, "holds another override after a space"),
    ({"model": {"ref": "hf://Qwen/Qwen3-8B"}}, "model.ref='hf://Qwen/Qwen3-8B' has the scheme 'hf'"),
    ({"data": {"dvc_remote": "s3://Upper/dvc"}}, "data.dvc_remote='s3://Upper/dvc' is not a valid S3 URI"),
])
def test_malformed_locations_are_refused_when_the_config_loads(over, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        _cfg(**over)


def test_a_local_check_names_every_placeholder_without_asking_s3(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with pytest.raises(ConfigError) as err:
        preflight(load_config("gpu-8b"))
    assert [p.split("=")[0] for p in _problems(err)] == ["store.root", "store.registry", "model.ref", "data.dvc_remote"]
    assert all("is a placeholder" in p for p in _problems(err))


def test_adapter_judge_and_registry_refs_are_checked_before_any_work(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = s3_server.root
    good = {"root": f"{root}/store", "registry": f"{root}/reg"}
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(store=good, train={"init_adapter": f"{root}/adapters/none"},
                       reward={"name": "judge", "judge_model": str(tmp_path)}), remote=True)
    problems = _problems(err)
    assert problems[0].startswith(f"train.init_adapter='{root}/adapters/none': no committed artifact directory")
    assert problems[1].startswith("reward.judge_model=") and "is a local path" in problems[1]
    with pytest.raises(ConfigError, match=r"model.ref='registry:p@v1': registry:NAME@VERSION refs name a trained "
                                          r"adapter .*model.ref is a base model"):
        _cfg(store=good, model={"ref": "registry:p@v1"})  # refused when the config loads, before any check
    with pytest.raises(ConfigError, match=r"data.dvc_repo='/nonexistent' holds no .dvc/"):
        preflight(_cfg(data={"dvc": "auto", "dvc_repo": "/nonexistent"}))


def test_the_schedule_overrides_are_refused_at_registration_not_at_the_first_run():
    from workflows.train import SCHEDULE_OVERRIDES_ENV, schedule_overrides

    assert schedule_overrides({}) == ""
    with pytest.raises(ConfigError,
                       match=r"(?s)" + SCHEDULE_OVERRIDES_ENV + r".*stor: unknown setting; did you mean store\?"):
        schedule_overrides({SCHEDULE_OVERRIDES_ENV: "stor.root=s3://bkt/x"})
    with pytest.raises(ConfigError) as err:
        schedule_overrides({SCHEDULE_OVERRIDES_ENV: "store.root=/local/store"})
    assert any(p.startswith("store.root='/local/store' is a local path") for p in _problems(err))
    ok = ("store.root=s3://bkt/store,store.registry=s3://bkt/reg,model.ref=s3://bkt/m,"
          "data.dvc_remote=s3://bkt/dvc")
    assert schedule_overrides({SCHEDULE_OVERRIDES_ENV: ok}) == ok  # form only: no request to S3


def test_model_device_cuda_without_cuda_fails_a_local_check_but_not_a_cluster_one(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    import torch

    from envace_core.stages import preflight as pf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _cfg(model={"ref": str(tiny_model_dir), "device": "cuda"},
               store={"root": str(tmp_path / "s"), "registry": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match=r"model.device=cuda but torch sees no CUDA device.*config --remote"):
        preflight(cfg)
    monkeypatch.setattr(pf, "check_remote_settings", lambda cfg: None)  # only the CUDA check is of interest here
    preflight(cfg, remote=True)  # the pods that train have the GPUs this machine lacks
