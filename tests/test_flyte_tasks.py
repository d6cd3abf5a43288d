"""Flyte task settings: code-derived cache versions with flytekit's real local cache, images,
resources, Elastic for multi-GPU training, and the scheduled launch plan."""

import importlib
import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def local_cache(tmp_path):
    """flytekit's local task cache in a fresh directory; the previous location is restored after."""
    from flytekit.core import local_cache as lc

    from tasks.cache_version import configure_local_cache

    before = lc.CACHE_LOCATION
    yield configure_local_cache(tmp_path / "flyte-cache")
    configure_local_cache(before)


TASK_MODULE = """
from pathlib import Path

from flytekit import Cache, task

from envace_core.store import files  # noqa: F401  (part of the code the version covers)
from tasks.cache_version import CodeCachePolicy

RUNS = Path({runs!r})


@task(cache=Cache(policies=[CodeCachePolicy()]))
def scale(x: int) -> int:
    RUNS.open("a").write("code\\n")
    return {body}


@task(cache=Cache(version="1"))
def scale_fixed_version(x: int) -> int:
    RUNS.open("a").write("fixed\\n")
    return {body}
"""


def _load_task_module(tmp_path, monkeypatch, body: str):
    (tmp_path / "h6_cached_tasks.py").write_text(
        TASK_MODULE.format(runs=str(tmp_path / "runs.log"), body=body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("h6_cached_tasks", None)
    importlib.invalidate_caches()
    return importlib.import_module("h6_cached_tasks")


def test_changed_task_body_misses_flytekits_local_cache(local_cache, tmp_path, monkeypatch):
    """Same task name, same inputs, new body: the code-derived version runs it again; a fixed
    version (the control) returns the stale result of the old body."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no stale .pyc for the rewritten module
    runs = tmp_path / "runs.log"
    v1 = _load_task_module(tmp_path, monkeypatch, "x * 2")
    assert v1.scale(x=3) == 6 and v1.scale(x=3) == 6  # second call: a cache hit
    assert v1.scale_fixed_version(x=3) == 6
    assert runs.read_text().splitlines() == ["code", "fixed"]
    assert any(local_cache.iterdir())  # the cache lives where we pointed it

    v2 = _load_task_module(tmp_path, monkeypatch, "x * 2 + 1")
    assert v2.scale.name == v1.scale.name and v2.scale.metadata.cache_version != v1.scale.metadata.cache_version
    assert v2.scale(x=3) == 7  # ran the new body
    assert v2.scale_fixed_version(x=3) == 6  # stale: what a hand-kept version would have served
    assert runs.read_text().splitlines() == ["code", "fixed", "code"]


def test_code_version_covers_reachable_envace_core_modules_and_pins(tmp_path):
    from tasks.cache_version import code_version, reachable_sources

    source = (REPO / "tasks" / "curate.py").read_text()
    pkg = tmp_path / "envace_core"
    shutil.copytree(REPO / "envace_core", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    base = code_version(source, ["torch==2.13.0"])
    assert code_version(source, ["torch==2.13.0"], package_dir=pkg) == base  # paths are not hashed

    reached = reachable_sources(source, pkg)
    # stages imports its helpers inside functions; those count.
    assert {"envace_core.stages.curate", "envace_core.store.uri", "envace_core.stages.gates", "envace_core.envs.tau2.tasks"} <= set(reached)
    assert "envace_core.evaluation.vita" not in reached

    (pkg / "evaluation" / "vita.py").write_text("# unrelated edit\n" + (pkg / "evaluation" / "vita.py").read_text())
    assert code_version(source, ["torch==2.13.0"], package_dir=pkg) == base
    (pkg / "stages" / "gates.py").write_text((pkg / "stages" / "gates.py").read_text() + "\n# edited\n")
    assert code_version(source, ["torch==2.13.0"], package_dir=pkg) != base
    assert code_version(source, ["torch==2.14.0"]) != base  # the image's pins count too
    assert code_version(source + "\n# edited\n", ["torch==2.13.0"]) != base


def test_stage_tasks_declare_images_resources_retries_timeouts_and_cache():
    from tasks import images
    from workflows.train import (
        curate,
        evaluate,
        register,
        resolve_config,
        rollout_and_train,
        validate,
    )

    expect = {resolve_config: (images.CPU_IMAGE, None, False), curate: (images.CPU_IMAGE, None, True),
              rollout_and_train: (images.TRAIN_IMAGE, "1", True), validate: (images.EVAL_IMAGE, "1", True),
              evaluate: (images.EVAL_IMAGE, "1", True), register: (images.CPU_IMAGE, None, False)}
    for t, (image, gpu, cached) in expect.items():
        assert t.container_image is image, t.name
        assert t.resources.requests.gpu == gpu and t.resources.limits.gpu == gpu, t.name
        assert t.resources.requests.mem and t.resources.limits.cpu, t.name
        assert t.metadata.retries >= 1 and t.metadata.timeout.total_seconds() > 0, t.name
        assert t.metadata.cache is cached, t.name
        assert bool(re.fullmatch(r"[0-9a-f]{64}", t.metadata.cache_version)) is cached, t.name
    versions = {t.metadata.cache_version for t in expect if t.metadata.cache}
    assert len(versions) == 4  # each task's own source is part of its version


def test_images_are_derived_from_pyproject_and_configurable(monkeypatch):
    from tasks.image_requirements import (
        CUDA_TORCH,
        NO_DEPS,
        VLLM,
        project_dependencies,
        requirements,
    )
    from tasks.images import image_spec

    deps = project_dependencies()
    cpu = image_spec("cpu", {})
    assert cpu.registry == "localhost:30000" and cpu.base_image == "debian:bookworm-slim"
    assert "torch==2.13.0+cpu" in cpu.packages and set(deps) - {"torch==2.13.0"} <= set(cpu.packages)
    assert cpu.pip_extra_index_url == ["https://download.pytorch.org/whl/cpu"]
    train = image_spec("train-cuda", {"ENVACE_IMAGE_REGISTRY": "ghcr.io/acme",
                                      "ENVACE_CUDA_BASE_IMAGE": "nvidia/cuda:13.0.0-runtime-ubuntu24.04"})
    assert train.image_name().startswith("ghcr.io/acme/envace-train-cuda:")
    assert train.base_image == "nvidia/cuda:13.0.0-runtime-ubuntu24.04"
    assert {CUDA_TORCH, VLLM} <= set(train.packages) and not any(p.startswith("torch==2.13") for p in train.packages)
    assert requirements("eval-cuda") == requirements("train-cuda")
    assert set(NO_DEPS["eval-cuda"]) - set(NO_DEPS["train-cuda"]) == {"bfcl-eval==2026.3.23"}
    # The Makefile's --no-deps installs and the images' must not drift apart.
    make = (REPO / "Makefile").read_text()
    assert all(p in make for p in NO_DEPS["eval-cuda"])
    with pytest.raises(ValueError, match="unknown image kind"):
        requirements("tpu")


def test_imagespec_renders_a_dockerfile_that_installs_envace_without_building(tmp_path, monkeypatch):
    """flytekit's own builder writes the build context; nothing is built or pulled."""
    from flytekit.image_spec.default_builder import create_docker_context

    from tasks.images import image_spec

    monkeypatch.chdir(REPO)  # the ImageSpec copies pyproject.toml, README.md, envace_core from here
    create_docker_context(image_spec("cpu", {}), tmp_path)
    dockerfile = (tmp_path / "Dockerfile").read_text()
    assert "uv pip install --no-deps /root" in dockerfile
    assert "--index-strategy unsafe-best-match" in dockerfile and "whl/cpu" in dockerfile
    assert "torch==2.13.0+cpu" in (tmp_path / "requirements_uv.txt").read_text()
    assert (tmp_path / "envace_core" / "stages" / "curate.py").is_file()
    for kind in ("cpu", "train-cuda", "eval-cuda"):  # the Dockerfiles read the same requirement list
        assert f"image_requirements.py {kind}" in (REPO / "containers" / f"{kind}.Dockerfile").read_text()


def test_train_task_is_plain_for_one_worker_and_elastic_for_several():
    from flytekit import task
    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekitplugins.kfpytorch import Elastic
    from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

    from tasks.resources import (
        FlyteSettingsError,
        stages,
        train_scale,
        train_task_config,
    )
    from workflows.train import rollout_and_train

    assert train_scale({}) == ("1", 1) and train_task_config(*train_scale({})) is None
    assert not isinstance(rollout_and_train, PytorchElasticFunctionTask)  # local default: a plain task

    one_node = train_task_config(*train_scale({"ENVACE_TRAIN_GPUS": "4"}))
    multi = train_task_config(*train_scale({"ENVACE_TRAIN_NNODES": "2", "ENVACE_TRAIN_GPUS": "8"}))
    assert isinstance(one_node, Elastic) and (one_node.nnodes, one_node.nproc_per_node) == (1, 4)
    assert (multi.nnodes, multi.nproc_per_node) == (2, 8)
    assert stages({"ENVACE_TRAIN_GPUS": "8"})["rollout_and_train"].requests.gpu == "8"

    def fn(config: str, dataset: str) -> str:
        return config

    settings = SerializationSettings(image_config=ImageConfig.auto_default_image())
    pod = task(task_config=one_node)(fn)
    job = task(task_config=multi)(fn)
    assert pod.task_type == "python-task"  # torch elastic inside one pod
    assert job.task_type == "pytorch" and job.get_custom(settings)["elasticConfig"]["maxReplicas"] == 2

    for bad in ({"ENVACE_TRAIN_GPUS": "0"}, {"ENVACE_TRAIN_NNODES": "two"}, {"ENVACE_TRAIN_NNODES": "3:2"}):
        with pytest.raises(FlyteSettingsError, match="ENVACE_TRAIN_"):
            train_scale(bad)


def test_training_workers_need_the_torch_elastic_rendezvous_variables(monkeypatch):
    from envace_core.training.distributed import DistributedSetupError
    from tasks.train import rollout_and_train

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(DistributedSetupError, match="MASTER_ADDR"):
        rollout_and_train.task_function(config="{}", dataset="{}")


def test_weekly_retrain_launch_plan_fixes_the_profile_and_defaults_the_overrides():
    from workflows.train import train, weekly_retrain

    assert weekly_retrain.name == "envace_weekly_retrain" and weekly_retrain.workflow is train
    assert weekly_retrain.schedule.cron_schedule.schedule == "0 3 * * 0"
    assert set(weekly_retrain.fixed_inputs.literals) == {"profile"}
    params = weekly_retrain.parameters.parameters
    assert set(params) == {"overrides"}  # the profile is not an input of the schedule
    assert params["overrides"].default.scalar.primitive.string_value == ""


def test_second_run_reuses_cached_stages_but_registers_again(tiny_model_dir, tmp_path, monkeypatch,
                                                            local_cache, capfd):
    """Run 2 (same inputs) skips curate/train/validate/evaluate via the cache and still registers a
    new version; with the store deleted, the cached outputs are refused with the fix named."""
    monkeypatch.chdir(tmp_path)
    from envace_core.store.registry import Registry
    from envace_core.stages.inputs import StaleArtifactError
    from workflows.train import train

    overrides = json.dumps({
        "model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
        "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")},
    })
    t0 = time.perf_counter()
    first = json.loads(train(profile="test", overrides=overrides))
    t1 = time.perf_counter()
    time.sleep(1.1)  # registry versions have one-second resolution
    second = json.loads(train(profile="test", overrides=overrides))
    t2 = time.perf_counter()
    out = capfd.readouterr().out
    for line in ("[curate] dataset gate:", "[train] run ", "[validate] {"):  # cache hits: printed once
        assert out.count(line) == 1, line
    assert out.count("[register] model") == 2
    assert first["version"] != second["version"]
    reg = Registry(tmp_path / "registry")
    assert len(reg.list()) == 2 and all(reg.verify(n, v) == [] for n, v in reg.list())
    assert t2 - t1 < t1 - t0

    shutil.rmtree(tmp_path / "store")
    with pytest.raises(Exception, match="rm -rf .*flyte-cache") as err:
        train(profile="test", overrides=overrides)
    assert isinstance(err.value, StaleArtifactError) or "StaleArtifactError" in str(err.value)
    print(f"first run {t1 - t0:.1f}s, cached run {t2 - t1 - 1.1:.1f}s")
