"""Strict override input: a key twice in an overrides file, an option twice on the command line, quotes
inside pairs values, YAML 1.1's number and boolean readings, and empty storage locations each stop the
run with an error that names the setting; valid spellings keep loading."""

import json

import pytest

from envace_core.cli import main
from envace_core.config import ConfigError, load_config, parse_overrides


def _error(override) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("cpu-smoke", override)
    return str(err.value)


# ------------------------------------------------------------------ a key twice in an overrides file
@pytest.mark.parametrize("name, text, fragment", [
    ("top.yaml", "train:\n  seed: 1\nrollout:\n  group_size: 2\ntrain:\n  seed: 2\n", "set train twice (lines 1 and 5)"),
    ("nested.yaml", "train:\n  iterations: 2\n  seed: 1\n  iterations: 5\n", "set train.iterations twice (lines 2 and 4)"),
    ("deep.yaml", "rollout:\n  vllm_kwargs:\n    a: 1\n    a: 2\n", "set rollout.vllm_kwargs.a twice (lines 3 and 4)"),
    ("flow.yaml", "train: {seed: 1, seed: 2}\n", "set train.seed twice (line 1)"),
    ("dotted.yaml", "train.seed: 1\ntrain.seed: 2\n", "set train.seed twice (lines 1 and 2)"),
    ("nested.json", '{"train": {"seed": 1,\n "seed": 2}}', "set train.seed twice"),
    ("top.json", '{"train": {"seed": 1}, "train": {"iterations": 2}}', "set train twice"),
    ("deep.json", '{"rollout": {"vllm_kwargs": {"a": 1, "a": 2}}}', "set rollout.vllm_kwargs.a twice"),
])
def test_a_key_twice_in_an_overrides_file_is_named_with_the_file(name, text, fragment, tmp_path):
    f = tmp_path / name
    f.write_text(text)
    msg = _error(str(f))
    assert f"config overrides file '{f}' {fragment}: give each setting once" == msg


def test_a_key_twice_in_inline_yaml_json_or_a_pairs_value_is_refused():
    assert "config overrides set train.seed twice: give each setting once" == _error('{"train": {"seed": 1, "seed": 2}}')
    assert "set train.seed twice" in _error("train={seed: 1, seed: 2}")
    assert "set rollout.vllm_kwargs.a twice" in _error("rollout.vllm_kwargs={a: 1, a: 2}")


def test_overrides_files_without_repeated_keys_still_load(tmp_path):
    y = tmp_path / "ok.yaml"
    y.write_text("train:\n  seed: 4\n  iterations: 2\nrollout:\n  group_size: 3\n")
    cfg = load_config("cpu-smoke", str(y))
    assert (cfg.train.seed, cfg.train.iterations, cfg.rollout.group_size) == (4, 2, 3)
    j = tmp_path / "ok.json"
    j.write_text(json.dumps({"train": {"seed": 5}, "rollout": {"group_size": 2}}))
    cfg = load_config("cpu-smoke", str(j))
    assert (cfg.train.seed, cfg.rollout.group_size) == (5, 2)


def test_a_yaml_merge_key_is_not_a_repeated_key():
    over = parse_overrides("{rollout: {vllm_kwargs: {<<: {a: 1, b: 2}, a: 3}}}")
    assert over["rollout"]["vllm_kwargs"] == {"a": 3, "b": 2}


def test_a_json_file_that_does_not_parse_names_line_and_column(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{"train": {"seed": 010}}')
    msg = _error(str(f))
    assert msg.startswith(f"config overrides file '{f}' is not valid JSON:") and "(line 1, column" in msg


# ------------------------------------------------------------------ an option twice on one side
@pytest.mark.parametrize("argv, flag", [
    (["--profile", "test", "--profile", "cpu-smoke", "config"], "--profile"),
    (["config", "--profile", "test", "--profile", "test"], "--profile"),
    (["--overrides", "train.seed=1", "--overrides", "train.seed=2", "config"], "--overrides"),
    (["config", "--overrides", "train.seed=1", "--overrides=rollout.group_size=2"], "--overrides"),
    (["adapt-tools", "--model", "m", "--tools", "t.json", "--config", "test", "--config", "cpu-smoke"], "--config"),
])
def test_an_option_given_twice_on_one_side_of_the_subcommand_is_an_error(argv, flag, capsys):
    with pytest.raises(SystemExit) as ex:
        main(argv)
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {flag}: given twice" in err and "give it once" in err


def test_an_empty_overrides_value_before_the_subcommand_is_named_as_such(capsys):
    assert main(["--overrides", "store.root=", "config"]) == 2
    assert "envace: error: override 'store.root=' has no value: write store.root=VALUE" in capsys.readouterr().err


# ------------------------------------------------------------------ quotes inside pairs values
def test_an_apostrophe_inside_a_word_is_a_character_and_keeps_the_next_overrides():
    over = parse_overrides("data.dvc_path=it's,train.seed=3,rollout.group_size=2")
    assert over == {"data": {"dvc_path": "it's"}, "train": {"seed": 3}, "rollout": {"group_size": 2}}
    assert load_config("cpu-smoke", "data.dvc_path=it's,train.seed=3").train.seed == 3


@pytest.mark.parametrize("text, expected", [
    ("data.dvc_path='a,b',train.seed=3", {"data": {"dvc_path": "a,b"}, "train": {"seed": 3}}),
    ('data.dvc_path= "a,b" ,train.seed=3', {"data": {"dvc_path": "a,b"}, "train": {"seed": 3}}),
    ("data.dvc_path='it''s',train.seed=3", {"data": {"dvc_path": "it's"}, "train": {"seed": 3}}),
    ('data.dvc_path="say \\"hi, there\\"",train.seed=3', {"data": {"dvc_path": 'say "hi, there"'}, "train": {"seed": 3}}),
    ("train.lora_target_modules=['q,proj', it's],train.seed=3",
     {"train": {"lora_target_modules": ["q,proj", "it's"], "seed": 3}}),
    ("store.root=/tmp/x],train.seed=3", {"store": {"root": "/tmp/x]"}, "train": {"seed": 3}}),
    ("store.root=/tmp/a(1,train.seed=3", {"store": {"root": "/tmp/a(1"}, "train": {"seed": 3}}),
])
def test_quotes_and_brackets_open_a_value_only_at_its_start(text, expected):
    assert parse_overrides(text) == expected


@pytest.mark.parametrize("text, at", [("store.model_name='abc,train.seed=3", 18),
                                      ('data.dvc_path="a,train.seed=3', 15),
                                      ("train.lora_target_modules=[q_proj, 'v_proj],train.seed=3", 36)])
def test_an_unclosed_quote_is_an_error_not_a_swallow(text, at):
    msg = _error(text)
    assert f"at character {at} opens a quoted value that is never closed" in msg and "\n" not in msg


# ------------------------------------------------------------------ YAML 1.1 readings of values
@pytest.mark.parametrize("value, fragment", [
    ("true", "expects a number, not the boolean True"),
    ("yes", "expects a number, not the boolean True"),
    ("010", "'010' is not a plain decimal integer"),
    ("0x10", "'0x10' is not a plain decimal integer"),
    ("0o10", "'0o10' is not a plain decimal integer"),
    ("1_000", "'1_000' is not a plain decimal integer"),
    ("1:30", "'1:30' is not a plain decimal integer"),
    ("2.0", "'2.0' is not a plain decimal integer"),
    ("'010'", "'010' is not a plain decimal integer"),
])
def test_an_int_setting_takes_only_a_plain_decimal(value, fragment):
    msg = _error(f"train.seed={value}")
    assert f"train.seed: {fragment}" in msg


@pytest.mark.parametrize("value, seed", [("3", 3), ("+5", 5), ("0", 0), ("'12'", 12)])
def test_plain_decimal_ints_still_load(value, seed):
    assert load_config("cpu-smoke", f"train.seed={value}").train.seed == seed


def test_a_signed_decimal_reaches_the_settings_bound():
    """'-7' is a plain decimal (parsed, not refused as text); train.seed's range (0 to 2^31 - 1) refuses it."""
    msg = _error("train.seed=-7")
    assert "not a plain decimal" not in msg and "train.seed" in msg and "greater than or equal to 0" in msg


@pytest.mark.parametrize("value, fragment", [
    ("true", "expects a number, not the boolean True"),
    ("off", "expects a number, not the boolean False"),
    ("0x10", "'0x10' is not a plain decimal number"),
    ("1_000.5", "'1_000.5' is not a plain decimal number"),
    (".inf", "Input should be a finite number"),
])
def test_a_float_setting_takes_only_a_plain_decimal_number(value, fragment):
    assert f"train.learning_rate: {fragment}" in _error(f"train.learning_rate={value}")


@pytest.mark.parametrize("value, rate", [("1e-5", 1e-5), ("1.5e-5", 1.5e-5), ("2", 2.0), ("0.001", 0.001), (".5", 0.5)])
def test_plain_decimal_floats_still_load(value, rate):
    assert load_config("cpu-smoke", f"train.learning_rate={value}").train.learning_rate == rate


@pytest.mark.parametrize("value, text", [("123", "123"), ("0x10", "0x10"), ("010", "010"), ("1.50", "1.50"),
                                         ("yes", "yes"), ("1_0", "1_0")])
def test_a_string_setting_keeps_the_text_as_typed(value, text):
    assert load_config("cpu-smoke", f"store.model_name={value}").store.model_name == text


def test_text_settings_keep_dates_and_words_yaml_would_convert():
    cfg = load_config("cpu-smoke", "store.model_name=2024-01-01,data.dvc=off,data.dvc_path=010")
    assert (cfg.store.model_name, cfg.data.dvc, cfg.data.dvc_path) == ("2024-01-01", "off", "010")
    # a split name that YAML would read as a date reaches the split check as the text typed
    assert "data.train_split='2024-01-01' is not a tau2 split" in _error("data.train_split=2024-01-01")
    assert "data.dvc: Input should be 'auto', 'require' or 'off'" in _error("data.dvc=no")


def test_numbers_inside_lists_and_mappings_follow_the_same_rules():
    assert load_config("cpu-smoke", "data.synthetic_levels=[1,3]").data.synthetic_levels == [1, 3]
    assert "data.synthetic_levels[0]: expects a number, not the boolean True" in _error("data.synthetic_levels=[true]")
    assert "data.synthetic_levels[1]: Input should be 1, 2 or 3" in _error("data.synthetic_levels=[1,4]")
    assert "rollout.max_new_tokens_rehearse_per_tool.calculate: '010' is not a plain decimal integer" in \
        _error("rollout.max_new_tokens_rehearse_per_tool={calculate: 010}")
    assert load_config("cpu-smoke", "rollout.max_new_tokens_rehearse_per_tool={calculate: 30}") \
        .rollout.max_new_tokens_rehearse_per_tool == {"calculate": 30}
    # a setting of any type keeps YAML's reading
    assert parse_overrides("rollout.vllm_kwargs={enforce_eager: yes, n: 010}") == \
        {"rollout": {"vllm_kwargs": {"enforce_eager": True, "n": 8}}}


def test_files_json_and_dicts_refuse_booleans_and_odd_numbers_too(tmp_path):
    y = tmp_path / "o.yaml"
    y.write_text("train:\n  seed: 010\n")
    assert "train.seed: '010' is not a plain decimal integer" in _error(str(y))
    y.write_text("store:\n  model_name: 123\n")
    assert load_config("cpu-smoke", str(y)).store.model_name == "123"
    j = tmp_path / "o.json"
    j.write_text('{"train": {"iterations": true}}')
    assert "train.iterations: expects a number, not the boolean True" in _error(str(j))
    assert "train.sft_rehearse_error_share: expects a number" in _error({"train": {"sft_rehearse_error_share": True}})
    assert "train.seed: '1_000' is not a plain decimal integer" in _error({"train": {"seed": "1_000"}})


# ------------------------------------------------------------------ empty storage locations
@pytest.mark.parametrize("key", ["store.root", "store.registry", "data.dvc_remote", "data.dvc_repo", "model.ref",
                                 "train.init_adapter", "reward.judge_model"])
@pytest.mark.parametrize("value", ["''", '" "'])
def test_an_empty_location_is_refused_by_name(key, value):
    assert f"{key}: {key} is empty: give a local path or s3://BUCKET/PREFIX" in _error(f"{key}={value}")


def test_an_empty_pairs_value_and_an_empty_json_location_are_refused(tmp_path):
    msg = _error("store.root=,train.seed=3")
    assert msg == "override 'store.root=' has no value: write store.root=VALUE (null for none)"
    j = tmp_path / "o.json"
    j.write_text('{"store": {"registry": ""}}')
    assert "store.registry: store.registry is empty" in _error(str(j))
    assert "dvc_path ' ' must be a folder inside the DVC repo" in _error("data.dvc_path=' '")
    assert load_config("cpu-smoke", "data.dvc_remote=null").data.dvc_remote is None
