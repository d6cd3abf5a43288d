"""Config loading: profiles, override syntax, and clear errors for bad input."""

import pytest

from envace_core.config import ConfigError, load_config


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
        reg.verify("m", "1")
