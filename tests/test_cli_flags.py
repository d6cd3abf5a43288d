"""Command-line flags that set a config value, and override text, files and --set: bad input is one
`envace: error:` line naming the flag or setting with exit code 2, valid input keeps working."""

import json
import re

import pytest

from envace_core.cli import main, merged_overrides
from envace_core.config import ConfigError, apply_setting, load_config, parse_overrides
from envace_core.models import ModelRefError, ResolvedModel
from envace_core.training.policy import load_engine


@pytest.fixture
def p(tmp_path):
    return ["--profile", "test", "--overrides", f"store.root={tmp_path}/store,store.registry={tmp_path}/reg"]


def _err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("envace: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("ref, says", [("hf://x", "scheme 'hf'"), ("s3://A/x", "not a valid S3 URI"),
                                       ("bogus:x", "scheme 'bogus'")])
def test_rehearse_model_flag_is_checked_like_model_ref(p, capsys, ref, says):
    err = _err(capsys, [*p, "rehearse", "--task", "airline/3", "--model", ref])
    assert f"--model {ref!r} (the setting model.ref)" in err and says in err


@pytest.mark.parametrize("flag", ["--model", "--adapter"])
@pytest.mark.parametrize("value", ["", " "])
def test_rehearse_empty_model_or_adapter_is_refused(p, capsys, flag, value):
    assert f"{flag} is empty" in _err(capsys, [*p, "rehearse", "--task", "airline/3", flag, value])


def test_eval_model_flag_is_checked_before_loading(p, capsys, tmp_path):
    err = _err(capsys, [*p, "eval", "--model", "hf://x", "--bench", "tau2:airline", "--limit", "1",
                        "--out", str(tmp_path / "ev")])
    assert "--model 'hf://x': has the scheme 'hf', which envace does not read" in err


def test_load_engine_names_the_flag_for_a_bad_base_ref():
    cfg = load_config("test")
    with pytest.raises(ModelRefError, match=r"^--model 's3://A/x' \(the setting model.ref\).*not a valid S3 URI"):
        load_engine(cfg, ResolvedModel(ref="s3://A/x", base_ref="s3://A/x"))
    assert cfg.model.ref == "bundled:smollm2-135m-instruct"  # the caller's config is untouched


def test_apply_setting_keeps_a_valid_value_and_names_flag_and_setting():
    cfg = load_config("test")
    apply_setting(cfg, "store.registry", "/tmp/reg", "--registry")
    assert cfg.store.registry == "/tmp/reg"
    with pytest.raises(ConfigError, match=r"--registry 'hf://x' \(the setting store.registry\)"):
        apply_setting(cfg, "store.registry", "hf://x", "--registry")
    assert cfg.store.registry == "/tmp/reg"


def test_adapt_tools_registry_flag(p, capsys, tmp_path):
    err = _err(capsys, [*p, "adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools",
                        str(tmp_path / "t.json"), "--registry", "hf://x"])
    assert "--registry 'hf://x' (the setting store.registry)" in err


def test_set_twice_and_set_domains_against_domain(p, capsys, tmp_path):
    base = [*p, "adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools", str(tmp_path / "t.json")]
    assert "--set train.iterations is given twice" in _err(
        capsys, [*base, "--set", "train.iterations=1", "--set", "train.iterations=2"])
    err = _err(capsys, [*base, "--set", "data.domains=[airline]", "--domain", "retail"])
    assert "data.domains=['airline']" in err and "--domain 'retail'" in err
    assert merged_overrides("train.iterations=1", ["train.iterations=3", "train.seed=2"]) == \
        {"train": {"iterations": 3, "seed": 2}}  # --set wins over --overrides


@pytest.mark.parametrize("value", ["", " "])
def test_empty_overrides_flag_means_none(capsys, value):
    """`make train` runs `envace --profile P --overrides '$(OVERRIDES)' config --check` with OVERRIDES
    empty by default: that must be the profile unchanged (`config` here; `--check` also makes the store)."""
    assert main(["--profile", "cpu-smoke", "--overrides", value, "config"]) == 0
    assert "envace: error" not in capsys.readouterr().err
    assert parse_overrides(value) == {}
    assert load_config("cpu-smoke", value) == load_config("cpu-smoke")


def test_config_markdown_checks_the_overrides_first(capsys):
    assert "train.iterations: Input should be greater than or equal to 1" in _err(
        capsys, ["--overrides", "train.iterations=0", "config", "--markdown"])


@pytest.mark.parametrize("content", [{"train": {"iterations": 2.0}}, {"train": {"iterations": 1e3}},
                                     {"data": {"synthetic_levels": [1.0, 2]}},
                                     {"rollout": {"max_new_tokens_rehearse_per_tool": {"calculate": 5.0}}}])
def test_json_file_floats_are_refused_for_integer_settings(tmp_path, content):
    f = tmp_path / "o.json"
    f.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match="expects an integer, not the number"):
        load_config("test", str(f))


def test_json_file_positions_name_the_item(tmp_path):
    f = tmp_path / "o.json"
    f.write_text('{"data": {"synthetic_levels": [1, 2.0]}, "rollout": {"max_new_tokens_rehearse_per_tool": '
                 '{"calculate": 5.0}}}')
    with pytest.raises(ConfigError) as e:
        load_config("test", str(f))
    assert "data.synthetic_levels[1]: expects an integer, not the number 2.0: write 2" in str(e.value)
    assert "rollout.max_new_tokens_rehearse_per_tool.calculate: expects an integer" in str(e.value)
    f.write_text('{"train": {"iterations": 2, "learning_rate": 1}}')
    assert load_config("test", str(f)).train.iterations == 2


@pytest.mark.parametrize("over, key, want", [
    ("store.root=/tmp/brk/my #store", "root", "/tmp/brk/my #store"),
    ("data.dvc_path=#x", "dvc_path", "#x"),
    ("data.dvc_path=a #x", "dvc_path", "a #x"),
    ("data.dvc_path=&a x", "dvc_path", "&a x"),
    ("data.dvc_path=!!int 5", "dvc_path", "!!int 5"),
    ("data.dvc_path='q #x'", "dvc_path", "q #x"),
    ("data.dvc_path= plain ", "dvc_path", "plain"),
])
def test_text_settings_keep_hash_anchor_and_tag_as_typed(over, key, want):
    cfg = load_config("test", over)
    assert getattr(cfg.store if key == "root" else cfg.data, key) == want


def test_a_text_setting_is_checked_on_all_it_was_given():
    with pytest.raises(ConfigError, match=r"store.model_name='foo #1' is not a registry name"):
        load_config("test", "store.model_name=foo #1")


@pytest.mark.parametrize("over, what", [("train.iterations=2 #x", "a comment"), ("train.iterations=!!int 5", "a tag"),
                                        ("train.iterations=&a 5", "an anchor"),
                                        ("data.domains=[airline] #x", "a comment")])
def test_other_settings_refuse_what_yaml_would_drop(over, what):
    with pytest.raises(ConfigError, match=re.escape(f"override {over!r}: the value holds {what}")):
        load_config("test", over)


@pytest.mark.parametrize("over", ["store.root: /tmp/brk/a=b", "store: {root: /tmp/brk/a=b}",
                                  "{store.root: /tmp/brk/a=b}"])
def test_yaml_text_with_equals_in_a_value(over):
    assert load_config("test", over).store.root == "/tmp/brk/a=b"


@pytest.mark.parametrize("ending", ["", "\n"])
def test_files_are_yaml_whatever_their_content(tmp_path, ending):
    f = tmp_path / "o.yaml"
    f.write_text("store.root: /tmp/brk/a=b" + ending)
    assert load_config("test", str(f)).store.root == "/tmp/brk/a=b"
    f.write_text("train.iterations=4" + ending)
    with pytest.raises(ConfigError, match="a file holds YAML or JSON: write train.iterations: 4"):
        load_config("test", str(f))


def test_pairs_are_still_pairs():
    cfg = load_config("test", "train.iterations=4,store.root=/tmp/a:b,data.dvc_path=x=y")
    assert (cfg.train.iterations, cfg.store.root, cfg.data.dvc_path) == (4, "/tmp/a:b", "x=y")
    with pytest.raises(ConfigError, match="is not a setting name"):
        load_config("test", "train iterations=4")


def test_wording_of_empty_domains_folders_and_missing_files(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="data.domains is empty"):
        load_config("test", "data.domains=[]")
    (tmp_path / "x.yaml").mkdir()
    with pytest.raises(ConfigError, match="'.*x.yaml' is a folder"):
        load_config("test", str(tmp_path / "x.yaml"))
    monkeypatch.chdir(tmp_path)
    for missing in ("x.txt", "sub/o", "o.yml"):
        with pytest.raises(ConfigError, match=f"config overrides file '{missing}' does not exist"):
            load_config("test", missing)


@pytest.mark.parametrize("argv, flag, extra", [
    (["eval", "--model", "/x", "--bench", "tau2:airline", "--bench", "bfcl:simple"], "--bench", "comma-separated"),
    (["eval", "--model", "/x", "--bench", "tau2:airline", "--out", "a", "--out", "b"], "--out", "give it once"),
    (["rehearse", "--task", "airline/0", "--task", "airline/1"], "--task", "give it once"),
    (["rehearse", "--list", "airline", "--list=retail"], "--list", "give it once")])
def test_a_value_option_given_twice_is_an_error(capsys, argv, flag, extra):
    """argparse keeps the last of two values silently (a second --bench replaced the first); envace names it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and f"argument {flag}: given twice" in err and extra in err


def test_benchmark_scripts_refuse_an_option_given_twice(tmp_path, capsys):
    from tests.benchmark_loader import load_benchmark

    fc = load_benchmark("first_call", "first_call_twice")
    with pytest.raises(SystemExit) as e:
        fc.main(["--models", "a=bundled:smollm2-135m-instruct", "--limit", "1", "--limit", "2"])
    assert e.value.code == 2 and "argument --limit: given twice (1 and 2)" in capsys.readouterr().err


@pytest.mark.parametrize("ref", ["s3://", "s3://A/x", "s3://bucket//x"])
def test_check_model_ref_refuses_a_malformed_s3_uri_before_any_download(ref):
    """Scripts call check_model_ref before hours of work; an S3 base is fetched only at load, so its URI's
    syntax is what can be checked then (as model.ref's is)."""
    from envace_core.models import check_model_ref

    with pytest.raises(ModelRefError, match=f"--model '{re.escape(ref)}': is not a valid S3 URI"):
        check_model_ref(ref, load_config("test"))


@pytest.mark.parametrize("flag", ["--check", "--remote"])
def test_config_markdown_refuses_a_check_flag_it_would_ignore(p, capsys, flag):
    err = _err(capsys, [*p, "config", "--markdown", flag])
    assert f"drop {flag}" in err and "checks nothing" in err
    assert capsys.readouterr().out == ""  # no table printed either


def test_registry_list_refuses_a_model_reference(p, capsys, tmp_path):
    err = _err(capsys, [*p, "registry", "list", "foo@1"])
    assert "registry list takes no NAME@VERSION (got 'foo@1')" in err and "registry show foo@1" in err
    (tmp_path / "reg").mkdir()  # an empty registry: listing a missing folder is an error
    assert main([*p, "registry", "list"]) == 0
