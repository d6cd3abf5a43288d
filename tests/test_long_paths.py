"""A path or name longer than the filesystem allows (a component over 255 bytes) gets the same clear error as a
missing one where a user names a model, an adapter, a registered version, a benchmark's data or a tools file:
pathlib's probes raise OSError (ENAMETOOLONG) there, os.path's answer False."""

from __future__ import annotations

import pytest

from envace_core import models
from envace_core.evaluation.options import BenchSpecError, parse_benches
from envace_core.store.registry import Registry, RegistryError
from envace_core.tool_learning.inputs import ToolSchemaError, load_tools

LONG = "a" * 300


def test_model_ref():
    with pytest.raises(models.ModelNotFoundError, match="is not a directory with config.json"):
        models.resolve_model(f"/tmp/{LONG}")


def test_adapter_folder(tmp_path):
    with pytest.raises(models.AdapterError, match="does not exist"):
        models.check_adapter_dir(tmp_path / LONG)
    assert models.is_adapter_dir(tmp_path / LONG) is False


def test_registered_version(tmp_path):
    with pytest.raises(RegistryError, match="is not registered"):
        Registry(tmp_path).show(LONG, "1")


@pytest.mark.parametrize("bench", ["vita", "finmcp"])
def test_bench_data_path(bench):
    with pytest.raises(BenchSpecError, match="does not exist"):
        parse_benches(f"{bench}:/tmp/{LONG}")


def test_tools_file(tmp_path):
    with pytest.raises(ToolSchemaError, match="no such file"):
        load_tools(tmp_path / f"{LONG}.json")
