"""Flyte task settings: code-derived cache versions with flytekit's real local cache, images,
resources, Elastic for multi-GPU training, and the scheduled launch plan."""

import importlib
import json
import os
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
        warm_start,
    )

    # Registered on the `cpu` tier: a GPU only through the GPU profile's overrides (test below).
    expect = {resolve_config: (images.CPU_IMAGE, None, False), curate: (images.CPU_IMAGE, None, True),
              warm_start: (images.TRAIN_IMAGE, None, True), rollout_and_train: (images.TRAIN_IMAGE, None, True), validate: (images.EVAL_IMAGE, None, True),
              evaluate: (images.EVAL_IMAGE, None, True), register: (images.CPU_IMAGE, None, False)}
    for t, (image, gpu, cached) in expect.items():
        assert t.container_image is image, t.name
        assert t.resources.requests.gpu == gpu and t.resources.limits.gpu == gpu, t.name
        assert t.resources.requests.mem and t.resources.limits.cpu, t.name
        assert t.metadata.retries >= 1 and t.metadata.timeout.total_seconds() > 0, t.name
        assert t.metadata.cache is cached and t.accelerator is None, t.name
        assert bool(re.fullmatch(r"[0-9a-f]{64}", t.metadata.cache_version)) is cached, t.name
    versions = {t.metadata.cache_version for t in expect if t.metadata.cache}
    assert len(versions) == 5  # each task's own source is part of its version


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
    assert cpu.registry is None and cpu.base_image == "debian:bookworm-slim"
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
    stamp = {"commit": "0" * 40, "dirty": False, "source_date": "2025-01-01T00:00:00+00:00"}
    create_docker_context(image_spec("cpu", {}, stamp=stamp), tmp_path)
    dockerfile = (tmp_path / "Dockerfile").read_text()
    assert "uv pip install --no-deps /root" in dockerfile
    # BUILD_INFO.json is written before envace is installed, in the format envace_core.buildinfo reads.
    assert dockerfile.index("/root/envace_core/BUILD_INFO.json") < dockerfile.index("uv pip install --no-deps /root")
    assert "-name __pycache__ -prune -exec rm -rf" in dockerfile
    for copied in ("envace_core", "tasks", "workflows"):  # the task modules too, for --copy none
        assert f"COPY --chown=flytekit {copied} /root/{copied}/" in dockerfile
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
        gpu_overrides,
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
    assert gpu_overrides("rollout_and_train", {"ENVACE_TRAIN_GPUS": "8"})["requests"].gpu == "8"
    assert stages({"ENVACE_TRAIN_GPUS": "8"})["rollout_and_train"].requests.gpu is None  # the cpu tier

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
        rollout_and_train.task_function(config="{}", dataset="{}", warm="null")


def test_weekly_retrain_launch_plan_fixes_the_profile_and_defaults_the_overrides():
    from workflows.train import train, weekly_retrain

    assert weekly_retrain.name == "envace_weekly_retrain" and weekly_retrain.workflow is train
    assert weekly_retrain.schedule.cron_schedule.schedule == "0 3 * * 0"
    assert set(weekly_retrain.fixed_inputs.literals) == {"profile"}
    params = weekly_retrain.parameters.parameters
    assert set(params) == {"overrides"}  # the profile is not an input of the schedule
    # The cluster's URIs come from the environment at registration (README, Operators).
    assert params["overrides"].default.scalar.primitive.string_value == os.environ.get("ENVACE_SCHEDULE_OVERRIDES", "")


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


# ------------------------------------------------------------------------ as a cluster sees the tasks
REG = "registry.example.com/ml"


@pytest.fixture
def serializable(monkeypatch):
    """flytekit's serializer, as `pyflyte register --copy none` runs it (no fast registration, the
    repository as source root), with the images in REG and taken as present (nothing built or pulled)."""
    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    from tasks import images

    monkeypatch.chdir(REPO)
    stamp = images.source_stamp()  # the commit now (HEAD may have moved since the import)
    for spec, kind in ((images.CPU_IMAGE, "cpu"), (images.TRAIN_IMAGE, "train-cuda"), (images.EVAL_IMAGE, "eval-cuda")):
        monkeypatch.setattr(spec, "registry", REG)
        monkeypatch.setattr(spec, "commands", images.build_commands(kind, stamp))
        monkeypatch.delitem(spec.__dict__, "tag", raising=False)  # the cached tag of the old commit
    monkeypatch.setattr(images.EnvaceImageSpec, "exist", lambda self: True)
    settings = SerializationSettings(image_config=ImageConfig.auto_default_image(), source_root=str(REPO),
                                     project="p", domain="d", version="v1")
    return lambda entity: get_serializable(__import__("collections").OrderedDict(), settings, entity)


def _task_nodes(wf_spec) -> dict:
    return {n.task_node.reference_id.name.rsplit(".", 1)[-1]: n for n in wf_spec.template.nodes if n.task_node}


def test_resources_follow_the_profile_and_the_gpu_profile_names_its_gpu_type(serializable, monkeypatch):
    """train dispatches on the profile; on the CPU branch no task or node asks for a GPU, on the GPU
    branch train/validate/evaluate ask for one of ENVACE_GPU_TYPE's kind (A100 80GB by default)."""
    from flytekit.models.task import Resources as ResourceModel

    from tasks.resources import FlyteSettingsError, gpu_overrides
    from workflows.train import train, train_on_cpu, train_on_gpu

    ResourceName = ResourceModel.ResourceName

    spec = serializable(train)
    [branch] = [n for n in spec.template.nodes if n.branch_node]
    cond = branch.branch_node.if_else.case.condition.comparison
    assert cond.right_value.primitive.string_value == "gpu-8b"
    gpu = {"warm_start", "rollout_and_train", "validate", "evaluate"}
    for wf, gpu_stages in ((train_on_cpu, set()), (train_on_gpu, gpu)):
        nodes = _task_nodes(serializable(wf))
        assert set(nodes) == {"resolve_config", "curate", "warm_start", "rollout_and_train", "validate", "evaluate",
                              "register"}
        for name, node in nodes.items():
            over = node.task_node.overrides
            gpus = [r.value for r in (over.resources.requests if over and over.resources else [])
                    if r.name == ResourceName.GPU]
            assert (gpus == ["1"]) is (name in gpu_stages), (wf.name, name)
            device = over.extended_resources.gpu_accelerator.device if over and over.extended_resources else None
            assert device == ("nvidia-a100-80gb" if name in gpu_stages else None), (wf.name, name)
    assert gpu_overrides("rollout_and_train", {"ENVACE_GPU_TYPE": "H100", "ENVACE_TRAIN_GPUS": "8"})[
        "requests"].gpu == "8"
    assert gpu_overrides("validate", {"ENVACE_GPU_TYPE": "h100"})["accelerator"].to_flyte_idl().device == "nvidia-h100"
    with pytest.raises(FlyteSettingsError, match="ENVACE_GPU_TYPE='tpu9'"):
        gpu_overrides("validate", {"ENVACE_GPU_TYPE": "tpu9"})


def test_the_pod_imports_the_same_elastic_task_it_was_registered_as(monkeypatch):
    """ENVACE_TRAIN_* at registration are the task's container environment; a process that has only
    that environment (the pod) builds the same Elastic task from tasks/train.py."""
    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

    import tasks.train

    settings = SerializationSettings(image_config=ImageConfig.auto_default_image())

    def loaded(env: dict):
        for k in ("ENVACE_TRAIN_NNODES", "ENVACE_TRAIN_GPUS"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        t = importlib.reload(tasks.train).rollout_and_train
        return t, type(t), t.get_custom(settings), dict(t.environment)

    try:
        registered = loaded({"ENVACE_TRAIN_GPUS": "4"})
        assert registered[1] is PytorchElasticFunctionTask and registered[3] == {
            "ENVACE_TRAIN_NNODES": "1", "ENVACE_TRAIN_GPUS": "4"}
        in_pod = loaded(registered[3])
        assert in_pod[1:] == registered[1:]
        assert loaded({})[1] is not PytorchElasticFunctionTask  # without them: the plain task of the bug
    finally:
        monkeypatch.undo()
        importlib.reload(tasks.train)


def test_transient_and_distributed_errors_are_flyte_recoverable():
    import torch.distributed as dist
    from flytekit.exceptions.user import FlyteRecoverableException

    from envace_core import EnvaceError, TransientError
    from tasks.resources import recoverable
    from workflows.train import curate, rollout_and_train

    def raises(e):
        def fn():
            raise e
        return recoverable(fn)

    with pytest.raises(FlyteRecoverableException, match="TransientError: S3 throttled") as err:
        raises(TransientError("S3 throttled"))()
    assert isinstance(err.value.__cause__, TransientError)
    with pytest.raises(FlyteRecoverableException, match="DistBackendError: NCCL"):
        raises(dist.DistBackendError("NCCL error: unhandled system error"))()
    with pytest.raises(EnvaceError, match="bad setting"):  # everything else is not retried
        raises(EnvaceError("bad setting"))()
    for t in (curate, rollout_and_train):  # every stage task body is wrapped
        assert t.task_function.__wrapped__ is not None and t.task_function.__name__ == t.name.rsplit(".", 1)[-1]


def test_stage_bodies_print_their_wall_time_when_done_or_failed(capsys, monkeypatch):
    import tasks.resources
    from tasks.resources import timed

    released = []  # a local run's next stage must not start on this one's freed-but-resident heap
    monkeypatch.setattr(tasks.resources, "release_free_heap", lambda: released.append(1))
    assert timed("curate", lambda x: x + 1)(1) == 2
    assert re.fullmatch(r"\[curate\] done in \d+\.\d s\n", capsys.readouterr().out)
    assert released == [1]

    def boom():
        raise ValueError("bad")
    with pytest.raises(ValueError, match="bad"):
        timed("validate", boom)()
    assert re.fullmatch(r"\[validate\] failed in \d+\.\d s\n", capsys.readouterr().out)
    assert released == [1, 1]


def test_registry_hmac_key_is_a_declared_flyte_secret_passed_to_envace_core(monkeypatch):
    from flytekit import current_context

    from envace_core.store.registry import HMAC_KEY_ENV
    from tasks.resources import FlyteSettingsError, hmac_secret, with_hmac_key
    from workflows.train import curate, register

    [secret] = register.security_context.secrets
    assert (secret.group, secret.key, secret.env_var) == ("envace", "registry-hmac-key", HMAC_KEY_ENV)
    assert not (curate.security_context and curate.security_context.secrets)
    assert hmac_secret({"ENVACE_HMAC_SECRET": "none"}) is None
    with pytest.raises(FlyteSettingsError, match="ENVACE_HMAC_SECRET"):
        hmac_secret({"ENVACE_HMAC_SECRET": "no-key"})
    # Kubernetes names: the secret (group) is a DNS-1123 subdomain, the key [-._a-zA-Z0-9]+.
    for bad, part in (("Bad_Group/key", "group"), ("-envace/key", "group"), ("envace/key with space", "key")):
        with pytest.raises(FlyteSettingsError, match=f"ENVACE_HMAC_SECRET=.*the {part} "):
            hmac_secret({"ENVACE_HMAC_SECRET": bad})
    assert hmac_secret({"ENVACE_HMAC_SECRET": "ml.envace/Registry_HMAC.key"}).key == "Registry_HMAC.key"

    # A pod that got the secret through flytekit's secrets manager (not as the variable itself).
    monkeypatch.delenv(HMAC_KEY_ENV, raising=False)
    monkeypatch.setenv(current_context().secrets.get_secrets_env_var("envace", "registry-hmac-key"), "k3y\n")
    seen = []
    with_hmac_key(lambda: seen.append(os.environ.get(HMAC_KEY_ENV)), secret)()
    assert seen == ["k3y"]


def test_image_tag_ignores_bytecode_and_needs_a_registry(tmp_path, monkeypatch):
    from tasks.image_requirements import project_dependencies
    from tasks.images import SOURCES, ImageSettingsError, image_spec, source_digest

    tree = tmp_path / "repo"
    tree.mkdir()
    for s in SOURCES:
        if (REPO / s).is_dir():
            shutil.copytree(REPO / s, tree / s, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tree / s).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / s, tree / s)
    base = source_digest(tree)
    (tree / "envace_core" / "__pycache__").mkdir(exist_ok=True)
    (tree / "envace_core" / "__pycache__" / "config.cpython-311.pyc").write_bytes(b"\x00junk")
    (tree / "tasks" / "stray.pyc").write_bytes(b"\x00")
    assert source_digest(tree) == base
    (tree / "tasks" / "curate.py").write_text((tree / "tasks" / "curate.py").read_text() + "\n# edited\n")
    assert source_digest(tree) != base

    assert os.environ["FLYTE_IMG_FAST_FAIL"].upper() == "TRUE"  # an image that cannot be checked fails
    with pytest.raises(ImageSettingsError, match="ENVACE_IMAGE_REGISTRY is not set"):
        image_spec("cpu", {}).image_name()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ImageSettingsError, match="repository root"):
        image_spec("cpu", {"ENVACE_IMAGE_REGISTRY": REG}).image_name()
    # Installed without the repository: the pins come from the installed metadata.
    deps = project_dependencies(tmp_path / "no" / "pyproject.toml")
    assert any(d.startswith("torch") for d in deps) and not any("extra ==" in d for d in deps)


def test_containers_readme_recipe_names_the_images_copy_none_registration_uses(serializable):
    """The shell recipe of containers/README.md, run as written, prints the image names that the
    serializer (`--copy none`: no fast registration, source root set) puts in the task templates."""
    import subprocess

    from workflows.train import curate, rollout_and_train, validate

    recipe = re.search(r"```bash\n(ENVACE_IMAGE_REGISTRY=\$REG [^`]*?)```",
                       (REPO / "containers" / "README.md").read_text()).group(1)
    printed = subprocess.run(["bash", "-c", f"REG={REG}\n{recipe}"], cwd=REPO, capture_output=True, text=True,
                             check=True, env={**os.environ, "ENVACE_IMAGE_REGISTRY": ""}).stdout.split()
    serialized = [serializable(t).template.container.image for t in (curate, rollout_and_train, validate)]
    assert printed == serialized and all(n.startswith(REG + "/envace-") for n in serialized)


def test_malformed_image_registry_is_refused_naming_the_variable():
    """flytekit's ImageSpec raises a bare ValueError for these at import; ours names the setting."""
    from tasks.images import ImageSettingsError, image_spec

    for bad in ("ghcr.io/acme/", "https://ghcr.io/acme", "ghcr.io/ac me"):
        with pytest.raises(ImageSettingsError, match=r"ENVACE_IMAGE_REGISTRY=.*HOST\[:PORT\]\[/PATH\]"):
            image_spec("cpu", {"ENVACE_IMAGE_REGISTRY": bad})
    for good in ("ghcr.io/acme", "localhost:30000", "123456789012.dkr.ecr.us-east-1.amazonaws.com/ml"):
        assert image_spec("cpu", {"ENVACE_IMAGE_REGISTRY": good}).registry == good


def test_image_flags_name_each_imagespec_as_the_prebuilt_image_packaging_uses(monkeypatch, capsys):
    """`python -m tasks.images --image-flags` prints `--image <ImageSpec.id>=<image_name()>` pairs
    that pyflyte's `--image` parser accepts and that make flytekit's serializer name each image
    without building it or asking a registry (`ImageSpec.exist()`); without a registry it says so."""
    from flytekit.configuration import ImageConfig
    from flytekit.core.python_auto_container import get_registerable_container_image
    from flytekit.image_spec.image_spec import ImageBuildEngine

    from tasks import images

    monkeypatch.chdir(REPO)
    stamp = images.source_stamp()
    specs = tuple(images.image_spec(k, {"ENVACE_IMAGE_REGISTRY": REG}, stamp) for k in ("cpu", "train-cuda", "eval-cuda"))
    monkeypatch.setattr(images, "IMAGES", specs)
    assert images.main(["--image-flags"]) == 0
    args = capsys.readouterr().out.split()
    assert args[::2] == ["--image"] * 3
    cfg = ImageConfig.validate_image(None, "image", tuple(args[1::2]))

    def no_check(*_):
        raise AssertionError("packaging with --image flags must not build or check an image")

    monkeypatch.setattr(ImageBuildEngine, "build", no_check)
    monkeypatch.setattr(images.EnvaceImageSpec, "exist", no_check)
    names = [get_registerable_container_image(s, cfg) for s in specs]
    assert names == [s.image_name() for s in specs] and all(n.startswith(REG + "/envace-") for n in names)

    monkeypatch.setattr(images, "IMAGES", (images.image_spec("cpu", {}, stamp),))
    assert images.main(["--names"]) == 2
    assert "ENVACE_IMAGE_REGISTRY is not set" in capsys.readouterr().err
