"""The CLI's config check and registry commands give one clear error for bad input."""

import json

import pytest

from envace_core.cli import main


@pytest.mark.parametrize("override, fragment", [
    ("model.ref=/no/such/model", "not a directory with config.json"),
    ("train.iteratons=2", "train.iteratons: unknown setting; did you mean train.iterations?"),
    ("train.zzz=2", "train.zzz: unknown setting; train has: advantage_scale, "),
    ("validat.min_fidelity=0.1", "validat: unknown setting; did you mean validate?"),
    ("validate.min_fidelty=0.1", "validate.min_fidelty: unknown setting; did you mean validate.min_fidelity?"),
    ("rollout.group_size=0", "rollout.group_size"),
    ("data.domains=[nope]", "unknown domain"),
    ("{not yaml: [", "neither a file"),
])
def test_config_check_names_the_bad_field(override, fragment, capsys):
    assert main(["--overrides", override, "config", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("envace: error:") and fragment in err


def test_s3_model_without_credentials_fails_fast(monkeypatch, capsys):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    assert main(["--overrides", "model.ref=s3://nobucket/model", "config", "--check"]) == 2
    assert "no AWS credentials" in capsys.readouterr().err


def test_config_prints_the_resolved_profile(tiny_model_dir, tmp_path, capsys):
    over = json.dumps({"model": {"ref": str(tiny_model_dir)}, "store": {"root": str(tmp_path / "s"),
                                                                        "registry": str(tmp_path / "r")}})
    assert main(["--profile", "test", "--overrides", over, "config", "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == "test"


def test_registry_show_unknown_and_bad_ref(tmp_path, capsys):
    over = f"store.registry={tmp_path / 'r'}"
    assert main(["--overrides", over, "registry", "show", "nope@1"]) == 2
    assert "not registered" in capsys.readouterr().err
    assert main(["--overrides", over, "registry", "verify", "nope"]) == 2
    assert "NAME@VERSION" in capsys.readouterr().err


def test_registry_show_and_verify_take_the_registry_ref_form_too(tmp_path, capsys):
    """`registry:NAME@VERSION`, as train.init_adapter and `envace eval --model` take it, names the same version."""
    from envace_core.store.registry import Registry

    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "w.txt").write_text("weights")
    Registry(str(tmp_path / "r")).register("policy", "v1", tmp_path / "art", {"base_model": {"ref": "x"}})
    over = f"store.registry={tmp_path / 'r'}"
    for ref in ("policy@v1", "registry:policy@v1"):
        assert main(["--overrides", over, "registry", "show", ref]) == 0
        assert json.loads(capsys.readouterr().out)["version"] == "v1"
        assert main(["--overrides", over, "registry", "verify", ref]) == 0
        assert "OK policy@v1" in capsys.readouterr().out


def test_empty_registry_list_says_so_and_train_refuses_a_registry_model_ref(tmp_path, capsys):
    over = f"store.registry={tmp_path / 'r'}"
    (tmp_path / "r").mkdir()  # an empty registry (a missing folder is an error: test_preflight_remote_settings.py)
    assert main(["--overrides", over, "registry", "list"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "no models registered" in out.err
    assert main(["--overrides", "model.ref=registry:envace-policy@1", "config", "--check"]) == 2
    assert "envace eval --model" in capsys.readouterr().err


def test_a_missing_overrides_file_is_named(capsys):
    assert main(["--overrides", str("/nonexistent/run.yaml"), "config", "--check"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _no_aws(monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


def test_an_s3_init_adapter_without_credentials_fails_the_check_before_curate(monkeypatch, capsys):
    _no_aws(monkeypatch)
    assert main(["--overrides", "train.init_adapter=s3://nobucket/adapter", "config", "--check"]) == 2
    err = capsys.readouterr().err
    assert "train.init_adapter='s3://nobucket/adapter': no AWS credentials" in err


@pytest.mark.parametrize("override, fragment", [
    ("reward.judge_model=/nope", "reward.judge_model '/nope' is not a directory with config.json"),
    ("reward.name=judge,reward.judge_model=registry:p@1", "reward.judge_model is a base model"),
    ("train.lora_target_modules=[q_proj,nosuch]", "['nosuch'] match no module of the base model; its linear "
                                                 "layers are named down_proj, gate_proj, k_proj"),
])
def test_config_check_resolves_the_judge_model_and_the_lora_targets(override, fragment, tiny_model_dir, tmp_path,
                                                                     capsys):
    local = f"model.ref={tiny_model_dir},store.root={tmp_path / 's'},store.registry={tmp_path / 'r'}"
    assert main(["--profile", "test", "--overrides", f"{local},{override}", "config", "--check"]) == 2
    assert fragment in capsys.readouterr().err
    assert main(["--profile", "test", "--overrides", f"{local},reward.judge_model={tiny_model_dir}",
                 "config", "--check"]) == 0


def test_the_trainer_names_the_lora_setting_when_peft_finds_no_target(tiny_model_dir):
    from envace_core.config import TrainConfig
    from envace_core.models import LoraTargetError, load_model, load_tokenizer
    from envace_core.training.trainer import PolicyTrainer

    with pytest.raises(LoraTargetError, match=r"train.lora_target_modules=\['nosuch'\].*named .*q_proj"):
        PolicyTrainer(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir),
                      TrainConfig(lora_target_modules=["nosuch"]), compute_dtype="float32")


@pytest.mark.parametrize("flag, url", [("--user-url", "notaurl"), ("--user-url", "ftp://host/v1"),
                                       ("--user-url", "http://"), ("--judge-url", "localhost:8000/v1"),
                                       ("--user-url", "http://[::1/v1")])
def test_eval_refuses_a_url_that_is_not_http_before_any_work(flag, url, tmp_path, capsys):
    assert main(["eval", "--model", "bundled:smollm2-135m-instruct", "--bench", "bfcl:simple", flag, url,
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {url!r} is not an http(s) URL with a host" in err and "http://localhost:8000/v1" in err


def test_eval_refuses_an_out_folder_it_cannot_create_before_any_work(tmp_path, capsys):
    from envace_core.evaluation.options import EvalOptions

    assert main(["eval", "--model", "bundled:smollm2-135m-instruct", "--bench", "bfcl:simple",
                 "--out", "/proc/nope"]) == 2
    assert "--out '/proc/nope': cannot write there" in capsys.readouterr().err
    EvalOptions(model="m", benches="bfcl:simple", out=str(tmp_path / "a" / "b"), user_url="http://127.0.0.1:8000/v1").check()
    assert (tmp_path / "a" / "b").is_dir()


@pytest.mark.parametrize("argv, fragment", [
    (["--profile", "test", "config", "--profile", "cpu-smoke"], "--profile is given both before ('test') and after "
                                                              "('cpu-smoke') the subcommand"),
    (["--overrides", "train.iterations=2", "config", "--overrides", "rollout.group_size=2"],
     "--overrides is given both before"),
    (["--profile", "test", "adapt-tools", "--model", "m", "--tools", "t.json", "--config", "cpu-smoke"],
     "name different profiles"),
    (["--overrides", "train.iterations=2", "rollout.group_size=2", "config"], "quote the whole list"),
    (["--overrides", "train.iterations", "=", "2", "config"], "quote the whole list"),
    (["config", "--overrides=train.iterations=2", "rollout.group_size=2"], "quote the whole list"),
])
def test_global_options_given_twice_or_split_by_the_shell_are_argparse_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as ex:
        main(argv)
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "envace: error:" in err


def test_global_options_work_before_or_after_the_subcommand(capsys):
    for argv in (["--profile", "test", "--overrides", "train.iterations=3", "config"],
                 ["config", "--profile", "test", "--overrides", "train.iterations=3"],
                 ["--profile", "test", "config", "--overrides", "train.iterations=3"]):
        assert main(argv) == 0
        cfg = json.loads(capsys.readouterr().out)
        assert (cfg["profile"], cfg["train"]["iterations"]) == ("test", 3)
    assert main(["config"]) == 0 and json.loads(capsys.readouterr().out)["profile"] == "cpu-smoke"
