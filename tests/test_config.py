"""Config loading: profiles, override syntax, and clear errors for bad input; every field documented
(meaning and math), and the README's configuration table generated from the config."""

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from envace_core.config import (
    CONFIG_TABLE_BEGIN,
    CONFIG_TABLE_END,
    ConfigError,
    RunConfig,
    config_table_markdown,
    load_config,
)

README = Path(__file__).resolve().parent.parent / "README.md"
ISSUE_REFERENCE = re.compile(r"\bissues?\b|#\d+", re.IGNORECASE)


def test_override_lists_with_commas_and_several_keys():
    cfg = load_config("cpu-smoke", "data.domains=[airline,retail],train.iterations=4,rollout.temperature=0.7")
    assert cfg.data.domains == ["airline", "retail"]
    assert cfg.train.iterations == 4 and cfg.rollout.temperature == 0.7


def test_overrides_as_yaml_json_and_file(tmp_path):
    f = tmp_path / "o.yaml"
    f.write_text("train:\n  iterations: 5\n")
    assert load_config("cpu-smoke", str(f)).train.iterations == 5
    assert load_config("cpu-smoke", '{"train": {"iterations": 6}}').train.iterations == 6


@pytest.mark.parametrize("override, fragment", [
    ("data.domains=[mock]", "only the 'base' split"),
    ("data.test_split=train", "training on the evaluation tasks"),
    ("train.iterations=[", "not valid YAML"),
    ("=3", "a.b=value"),
    ("train.lora_r=0", "train.lora_r"),
    ("train.seed=-1", "train.seed"),
    ("train.seed=2147483648", "train.seed"),  # derived seeds (seed x 1 000 003 + step) must fit 64 bits
    ("data.synthetic_seed=-1", "data.synthetic_seed"),
])
def test_bad_overrides_name_the_problem(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        load_config("cpu-smoke", override)


def test_unknown_profile():
    with pytest.raises(ConfigError, match="unknown profile"):
        load_config("nope")


def test_preflight_catches_a_bad_registry_before_any_work(tmp_path):
    from envace_core.stages.preflight import preflight
    from envace_core.store.registry import RegistryError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = load_config("cpu-smoke", {"store": {"root": str(tmp_path / "s"), "registry": str(blocker / "r")}})
    with pytest.raises(RegistryError, match="store.registry"):
        preflight(cfg)


def test_corrupt_manifest_is_a_registry_error(tmp_path):
    from envace_core.store.registry import Registry, RegistryError

    art = tmp_path / "a"
    art.mkdir()
    (art / "w").write_text("w")
    reg = Registry(tmp_path / "reg")
    path = reg.register("m", "1", art, {})
    (path / "manifest.json").write_text("{broken")
    with pytest.raises(RegistryError, match="corrupt"):
        reg.show("m", "1")
    bad = reg.verify("m", "1")  # verify lists it as what fails (exit 1), as it does a changed artifact
    assert len(bad) == 1 and bad[0].startswith("manifest.json (Expecting property name")


@pytest.mark.parametrize("content, problem", [
    ("[1, 2]", "it holds a JSON list, not an object"),
    ('{"artifacts": "x"}', "it records no artifacts"),
    ("{}", "it records no artifacts"),
    ('{"name": "other", "artifacts": {"artifacts/w": "0"}}', "its name is 'other', not 'm'"),
    ('{"artifacts": {"artifacts/w": 1}}', "its artifacts are not {path: sha256} strings"),
])
def test_a_manifest_that_is_valid_json_but_no_manifest_fails_verification(tmp_path, content, problem, monkeypatch):
    from envace_core.store.registry import CorruptManifestError, Registry

    monkeypatch.delenv("ENVACE_REGISTRY_HMAC_KEY", raising=False)
    art = tmp_path / "a"
    art.mkdir()
    (art / "w").write_text("w")
    reg = Registry(tmp_path / "reg")
    (reg.register("m", "1", art, {}) / "manifest.json").write_text(content)
    assert reg.verify("m", "1") == [f"manifest.json ({problem})"]
    with pytest.raises(CorruptManifestError, match=rf"is corrupt: {re.escape(problem)}; this version cannot be"):
        reg.show("m", "1")


def _fields(model: type[BaseModel] = RunConfig, prefix: str = ""):
    """(dotted override key, FieldInfo) of every field of `model`, sections and their fields."""
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        yield key, field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _fields(field.annotation, key + ".")


def _sections() -> list[type[BaseModel]]:
    return [RunConfig] + [f.annotation for f in RunConfig.model_fields.values()
                          if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]


def test_every_field_and_section_is_described_without_naming_an_issue():
    fields = dict(_fields())
    assert {"train.kl_beta", "validate.min_fidelity", "rehearsal.memory_max_tokens"} <= set(fields)
    assert ISSUE_REFERENCE.search("see issue 14") and ISSUE_REFERENCE.search("fixed in #12")
    assert not ISSUE_REFERENCE.search("METHOD.md §3 (Schulman et al. 2017, eq. 7)")
    missing = [k for k, f in fields.items() if not (f.description or "").strip()]
    assert not missing, f"fields without a description=: {missing}"
    naming = {k: f.description for k, f in fields.items() if ISSUE_REFERENCE.search(f.description)}
    assert not naming, f"descriptions must cite the paper, METHOD.md or a benchmark doc, not an issue: {naming}"
    for section in _sections():
        assert (section.__doc__ or "").strip(), f"{section.__name__} has no docstring"
        assert not ISSUE_REFERENCE.search(section.__doc__), f"{section.__name__}'s docstring names an issue"


@pytest.mark.parametrize("key, fragments", [
    ("train.learning_rate", ["AdamW", "per optimizer step"]),
    ("train.clip_eps", ["clip(r_t, 1−ε, 1+ε)", "METHOD.md §3"]),
    ("train.kl_beta", ["k3", "exp(ref_t − logp_t)", "METHOD.md §3"]),
    ("train.loss_agg", ["Σ_i |y_i|", "mean_i"]),
    ("train.advantage_scale", ["R_i − b", "std", "METHOD.md §3"]),
    ("train.lora_r", ["α/r", "rank"]),
    ("train.lora_alpha", ["α/r"]),
    ("train.lr_scheduler", ["cos(π(k−W)/(K−W))", "(K−k)/(K−W)"]),
    ("train.warmup_iterations", ["k/W"]),
    ("train.max_grad_norm", ["min(1, c/‖g‖₂)"]),
    ("rollout.group_size", ["G", "METHOD.md §3"]),
    ("rollout.temperature", ["softmax(logits / T)"]),
    ("rollout.max_new_tokens_act", ["token budget"]),
    ("rollout.max_new_tokens_rehearse", ["token budget"]),
    ("rehearsal.n", ["N"]),
    ("rehearsal.memory_max_tokens", ["token budget", "METHOD.md §4"]),
    ("reward.fidelity_lambda", ["R + λ·F(ô, o)", "METHOD.md §2"]),
])
def test_training_fields_state_their_formula_or_unit(key, fragments):
    description = dict(_fields())[key].description
    missing = [f for f in fragments if f not in description]
    assert not missing, f"{key}: description {description!r} lacks {missing}"


def test_readme_configuration_table_is_the_generated_one():
    text = README.read_text()
    assert text.count(CONFIG_TABLE_BEGIN) == 1 and text.count(CONFIG_TABLE_END) == 1, \
        f"README.md needs one {CONFIG_TABLE_BEGIN} ... {CONFIG_TABLE_END} block"
    block = text.split(CONFIG_TABLE_BEGIN, 1)[1].split(CONFIG_TABLE_END, 1)[0].strip()
    assert block == config_table_markdown(), (
        "README.md's configuration table differs from the config: replace the lines between "
        f"{CONFIG_TABLE_BEGIN} and {CONFIG_TABLE_END} with the output of `.venv/bin/envace config --markdown`")


def test_generated_table_has_one_row_per_field_with_default_and_profile_values():
    lines = config_table_markdown().splitlines()
    keys = [k for k, _ in _fields()]
    for k in keys:
        assert sum(line.startswith(f"| `{k}` |") or line.startswith(f"| **`{k}`** |") for line in lines) == 1, k
    assert len(lines) == 2 + len(keys)
    row = {line.split("|")[1].strip(" `*"): line for line in lines[2:]}
    assert "| `0.2` |" in row["train.clip_eps"]
    assert "gpu-8b: `8`" in row["rollout.group_size"] and "test: `2`" in row["rollout.group_size"]
    assert "cpu-smoke" not in row["rollout.group_size"]  # cpu-smoke sets G = 4, the default
    assert "| `null` |" in row["train.mini_batch_rows"] and "| `[act, rehearse]` |" in row["train.trained_roles"]
    assert "&lt;registry>" not in row["store.model_name"]  # inside a code span: shown as written


def test_cli_config_markdown_prints_the_table(capsys):
    from envace_core.cli import main

    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == config_table_markdown() + "\n"


def test_bad_values_a_new_user_tried_are_refused_with_one_line(tmp_path):
    """inf/NaN floats, empty role/module lists, a profile named in the overrides, a binary overrides file."""
    from envace_core.config import ConfigError, load_config

    for bad in ("train.learning_rate=.inf", "rollout.temperature=.inf", "train.trained_roles=[]",
                "train.lora_target_modules=[]"):
        with pytest.raises(ConfigError):
            load_config("cpu-smoke", bad)
    with pytest.raises(ConfigError, match="chosen with --profile"):
        load_config("cpu-smoke", "profile=gpu-8b")
    assert load_config("cpu-smoke", "profile=cpu-smoke").profile == "cpu-smoke"
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x00\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config("cpu-smoke", str(binary))


@pytest.mark.parametrize("override", ["data.dvc=off", "data.dvc=false", "data.dvc=False", "data.dvc='off'"])
def test_dvc_off_is_off_however_yaml_reads_it(override, tmp_path):
    assert load_config("cpu-smoke", override).data.dvc == "off"
    f = tmp_path / "o.yaml"
    f.write_text("data:\n  dvc: off\n")
    assert load_config("cpu-smoke", str(f)).data.dvc == "off"
    with pytest.raises(ConfigError, match="data.dvc"):
        load_config("cpu-smoke", "data.dvc=on")  # YAML's True is no documented value


@pytest.mark.parametrize("override, fragments", [
    ("store.model_name=a/b", ["store.model_name='a/b' is not a registry name", "letters, digits, '.', '_' and '-'"]),
    ({"store": {"model_name": 123}}, ["store.model_name: expects a string", 'the number 123', '"123"']),
    ("train.init_adapter=[a, b]", ["train.init_adapter: expects one string, but was given the list ['a', 'b']"]),
    ("store.root=s3://b1/store", ["not a valid S3 URI", "the bucket 'b1' has 2 characters"]),
    ("init_adapter=/tmp/x", ["init_adapter: unknown setting; did you mean train.init_adapter?"]),
    ("store.model_name=" + "m" * 129, ["store.model_name is 129 characters long", "at most 128"]),
    ("data.train_split=trian", ["data.train_split='trian' is not a tau2 split of every configured domain",
                                "airline: base, test, train"]),
    ("data.domains=[airline,telecom],data.test_split=small", ["data.test_split='small' is not a tau2 split",
                                                              "telecom: base, full, small, test, train"]),
    ({"data": {"domains": [True]}}, ["data.domains[0]: expects a string", "the boolean True"]),
    ("data.domains=[1]", ["unknown domain(s) ['1']"]),  # YAML text for a str item stays the text "1"
    ("train.trained_roles=[user]", ["set rollout.user_rehearse=true, or train.trained_roles=[act,rehearse]"]),
    ("rollout.source=real,train.trained_roles=[rehearse]", ["set train.trained_roles=[act]"]),
    ("data.min_dataset_rows=5,data.max_dataset_rows=3", ["data.min_dataset_rows (5) is above data.max_dataset_rows (3)",
                                                          "data.max_dataset_rows >= 5"]),
    ("data.domains=[airline,airline]", ["data.domains lists ['airline'] more than once", "data.domains=[airline]"]),
    ("rollout.vllm_kwargs={enforce_eager: true}", ["read only by rollout.engine=vllm", "set rollout.engine=vllm"]),
])
def test_settings_that_would_fail_late_or_train_nothing_are_refused_at_load(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config("cpu-smoke", override)
    missing = [f for f in fragments if f not in str(err.value)]
    assert not missing, str(err.value)


def test_a_model_name_of_the_longest_length_loads():
    assert load_config("cpu-smoke", "store.model_name=" + "m" * 128).store.model_name == "m" * 128


@pytest.mark.parametrize("override", ["data.domains=[]", "data.domains=[mars]"])
def test_the_domains_an_error_lists_are_exactly_those_accepted(override):
    with pytest.raises(ConfigError) as err:
        load_config("cpu-smoke", override)
    listed = re.search(r"\[('[a-z]+'(?:, '[a-z]+')*)\]\s*$", str(err.value).splitlines()[1]).group(1)
    domains = [d.strip("'") for d in listed.split(", ")]
    assert domains == ["airline", "retail", "telecom"], str(err.value)  # not mock: it has no train/test split
    for d in domains:
        assert load_config("cpu-smoke", f"data.domains=[{d}]").data.domains == [d]
    with pytest.raises(ConfigError, match="only the 'base' split"):
        load_config("cpu-smoke", "data.domains=[mock]")


def test_fine_combinations_still_load():
    cfg = load_config("cpu-smoke", "rollout.user_rehearse=true,train.trained_roles=[act,rehearse,user]")
    assert cfg.train.trained_roles == ["act", "rehearse", "user"]
    assert load_config("cpu-smoke", "data.min_dataset_rows=3,data.max_dataset_rows=3").data.max_dataset_rows == 3
    assert load_config("cpu-smoke", "rollout.engine=vllm,rollout.vllm_kwargs={enforce_eager: true}").rollout.vllm_kwargs
    assert load_config("cpu-smoke", "store.model_name=my_policy-2.1").store.model_name == "my_policy-2.1"
    assert load_config("cpu-smoke", "store.model_name='123'").store.model_name == "123"
    assert load_config("cpu-smoke", "store.model_name=123").store.model_name == "123"  # the text as typed


def test_a_rehearse_budget_for_no_tool_of_the_domains_is_warned_about():
    from envace_core.config_checks import UnusedSettingWarning

    with pytest.warns(UnusedSettingWarning, match=r"'get_user_detials'.*did you mean 'get_user_details'"):
        load_config("test", {"rollout": {"max_new_tokens_rehearse_per_tool": {"get_user_detials": 10}}})


@pytest.mark.parametrize("override, fragment", [
    ("train.iterations=1,,rollout.group_size=2", "empty item"),
    ("train.iterations=1,", "empty item"),
    ("train.iterations=1,train.iterations=2", "set train.iterations twice"),
    ("train.iterations=1,train={iterations: 3}", "set train.iterations twice"),
    ("train=1,train.iterations=2", "set train and also train.iterations"),
    ("train.iterations=1 rollout.group_size=2", "holds another override after a space"),
    ("train.iterations=1;rollout.group_size=2", "holds another override after a space or ';'"),
    ("train iterations=2", "'train iterations' is not a setting name"),
    ("train.iterations 2", "has no '=': write train.iterations=2"),
])
def test_overrides_not_written_key_value_comma_say_the_expected_form(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("cpu-smoke", override)
    assert fragment in str(err.value)
    assert "twice" in fragment or "also" in fragment or "key=value,key=value" in str(err.value)


def test_spaces_around_equals_and_after_commas_are_fine():
    cfg = load_config("cpu-smoke", "train.iterations = 4, rollout.group_size=2")
    assert (cfg.train.iterations, cfg.rollout.group_size) == (4, 2)


def test_an_overrides_file_takes_dotted_keys_and_names_itself_when_it_does_not_parse(tmp_path):
    f = tmp_path / "o.yaml"
    f.write_text("train.iterations: 5\ntrain:\n  seed: 7\nrollout.group_size: 3\n")
    cfg = load_config("cpu-smoke", str(f))
    assert (cfg.train.iterations, cfg.train.seed, cfg.rollout.group_size) == (5, 7, 3)
    f.write_text("train.iterations: 5\ntrain:\n  iterations: 6\n")
    with pytest.raises(ConfigError, match=f"config overrides file '{f}' set train.iterations twice"):
        load_config("cpu-smoke", str(f))
    f.write_text("train:\n  iterations: [3\nrollout: 1\n")
    with pytest.raises(ConfigError, match=rf"config overrides file '{f}' is not valid YAML/JSON: .*\(line 3, column 8\)"):
        load_config("cpu-smoke", str(f))
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=f"config overrides file '{f}' must be a mapping"):
        load_config("cpu-smoke", str(f))
    assert load_config("cpu-smoke", '{"train.iterations": 6}').train.iterations == 6


def test_a_local_path_with_a_tilde_is_expanded_when_the_config_loads(monkeypatch, tmp_path):
    """The printed and recorded config names the folder the run uses, not `~` (which --check and the stores
    expand); a ~user this machine does not know is refused when the config loads (the stores' expansion raised)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("test", "store.root=~/envace/store,train.init_adapter=~/adapters/a")
    assert cfg.store.root == str(tmp_path / "envace" / "store")
    assert cfg.train.init_adapter == str(tmp_path / "adapters" / "a")
    assert not (tmp_path / "envace").exists()  # loading creates nothing
    with pytest.raises(ConfigError, match=r"store.registry='~nosuchuser-envace/reg': ~nosuchuser-envace names no "
                                          r"user with a home folder on this machine: write the full path"):
        load_config("test", "store.registry=~nosuchuser-envace/reg")
