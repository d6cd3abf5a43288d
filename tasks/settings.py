"""How each Flyte task runs on a cluster: image, resources, retries, timeout, cache, Elastic.

Cache versions come from the code, not from a hand-bumped string: `CodeCachePolicy` hashes the
task's module source, the source of every envace_core module it can reach through imports
(function-local imports included) and the pinned requirements of its image (pyproject.toml). Change
any of them and the task's cache version changes, so Flyte (and flytekit's local cache) runs it again
instead of returning a result computed by older code.

Environment variables, read when the tasks are imported (i.e. at registration):
  ENVACE_TRAIN_NNODES  nodes for rollout_and_train (default 1; "min:max" for elastic ranges)
  ENVACE_TRAIN_GPUS    GPUs per node for rollout_and_train (default 1)
  ENVACE_EVAL_GPUS     GPUs for validate / evaluate / rehearse (default 1)
  ENVACE_FLYTE_CACHE   flytekit's local task cache (default ./.envace/flyte-cache; local runs only)
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from flytekit import Cache, Resources, task
from flytekit.core.cache import VersionParameters

import envace_core
from envace_core import EnvaceError
from tasks import images
from tasks.image_requirements import project_dependencies

PACKAGE = "envace_core"
_PACKAGE_DIR = Path(envace_core.__file__).resolve().parent


class FlyteSettingsError(EnvaceError):
    """An ENVACE_* deployment variable has a value the tasks cannot use; the message names it."""


class StaleArtifactError(EnvaceError):
    """An earlier stage's output points at artifacts that no longer exist."""


# ------------------------------------------------------------------------- local cache location
def configure_local_cache(path: str | Path | None = None) -> Path:
    """Point flytekit's local task cache at `path`, $ENVACE_FLYTE_CACHE or ./.envace/flyte-cache.

    flytekit 1.16 keeps local results in a diskcache at the module constant
    `flytekit.core.local_cache.CACHE_LOCATION` (~/.flyte/local-cache, with no config knob), opened
    on first use. Keeping it beside the default artifact store (.envace/store) makes `make clean`
    drop both together, so a cached result never points at a deleted dataset or checkpoint, and
    keeps test runs out of the user's home. Nothing is created until a cached task runs.
    """
    from flytekit.core import local_cache

    target = Path(path or os.environ.get("ENVACE_FLYTE_CACHE") or Path.cwd() / ".envace" / "flyte-cache")
    target = target.expanduser().absolute()
    if local_cache.CACHE_LOCATION != str(target):
        if local_cache.LocalTaskCache._initialized:
            local_cache.LocalTaskCache._cache.close()
        local_cache.CACHE_LOCATION = str(target)
        local_cache.LocalTaskCache._initialized = False  # reopened at the new place on next use
    return target


# ---------------------------------------------------------------------------- code cache version
def _module_path(name: str, package_dir: Path) -> Optional[Path]:
    base = package_dir.parent.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


# `import a.b as c, d` / `from .x import (y as z,\n w)`: statements at any indentation, so
# function-local imports count. A match inside a string only adds a candidate, never drops one.
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)"
                     r"|import[ \t]+([^\n#]*))", re.M)


def _imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """envace_core modules (and candidates `pkg.name`) imported anywhere in `source`."""
    out: set[str] = set()
    for dots, base, names, plain in _IMPORT.findall(source):
        listed = [n.split(" as ")[0].strip(" ()\\\n\t") for n in (names or plain).split(",")]
        if plain:
            out |= set(listed)
            continue
        if dots:  # relative: resolve against this module's package
            pkg = module if is_package else module.rpartition(".")[0]
            for _ in range(len(dots) - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        out |= {base} | {f"{base}.{n}" for n in listed if n}
    return {n for n in out if n == PACKAGE or n.startswith(PACKAGE + ".")}


def reachable_sources(source: str, package_dir: Path = _PACKAGE_DIR,
                      read: Callable[[Path], str] = Path.read_text) -> dict[str, str]:
    """{module name: source} of every envace_core module reachable from `source` by imports.

    Conservative on purpose: function-local imports count, and importing `a.b.c` also runs
    `a/__init__` and `a.b/__init__`, so those count too. Over-counting costs a re-run; missing a
    module would serve results of old code.
    """
    todo = sorted(_imported_names(source, "__task__", False))
    found: dict[str, str] = {}
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            path = _module_path(mod, package_dir)
            if mod in found or path is None:
                continue
            found[mod] = read(path)
            todo += sorted(_imported_names(found[mod], mod, path.name == "__init__.py"))
    return found


def _dependency_pins() -> list[str]:
    try:
        return project_dependencies()
    except OSError:  # installed without the repository: the installed metadata holds the same pins
        from importlib.metadata import requires

        return list(requires("envace") or [])


def code_version(task_source: str, image_packages: Optional[list[str]] = None,
                 package_dir: Path = _PACKAGE_DIR, read: Callable[[Path], str] = Path.read_text) -> str:
    """sha256 (hex) of a task's source, the envace_core modules it reaches, and the pins it runs on.

    Stable across machines and checkouts: module names (not paths) and normalised line endings go
    into the hash, in sorted order.
    """
    h = hashlib.sha256(b"envace-cache-v1\0")
    h.update(task_source.replace("\r\n", "\n").encode())
    for name, src in sorted(reachable_sources(task_source, package_dir, read).items()):
        h.update(f"\0{name}\0".encode() + src.replace("\r\n", "\n").encode())
    h.update(json.dumps([_dependency_pins(), image_packages or []]).encode())
    return h.hexdigest()


class CodeCachePolicy:
    """flytekit cache policy: the version is `code_version` of the task's module and image."""

    def get_version(self, salt: str, params: VersionParameters) -> str:
        source = inspect.getsource(inspect.getmodule(params.func))
        image = params.container_image
        packages = list(image.packages or []) if hasattr(image, "packages") else []
        return code_version(salt + source, packages)


# --------------------------------------------------------------------------------- task settings
@dataclass(frozen=True)
class Stage:
    image: Any
    requests: Resources
    limits: Resources
    retries: int
    timeout: timedelta
    cache: bool


def _positive_int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip() or str(default)
    if not raw.isdigit() or int(raw) < 1:
        raise FlyteSettingsError(f"{name}={raw!r}: expected a whole number >= 1")
    return int(raw)


def train_scale(env: Optional[dict[str, str]] = None) -> tuple[str, int]:
    """(nnodes, GPUs per node) for rollout_and_train from ENVACE_TRAIN_NNODES / ENVACE_TRAIN_GPUS."""
    env = os.environ if env is None else env
    nnodes = env.get("ENVACE_TRAIN_NNODES", "").strip() or "1"
    lo, _, hi = nnodes.partition(":")
    if not (lo.isdigit() and int(lo) >= 1 and (not hi or (hi.isdigit() and int(hi) >= int(lo)))):
        raise FlyteSettingsError(f"ENVACE_TRAIN_NNODES={nnodes!r}: expected N or MIN:MAX nodes, N >= 1")
    return nnodes, _positive_int(env, "ENVACE_TRAIN_GPUS", 1)


def train_task_config(nnodes: str = "1", gpus_per_node: int = 1):
    """None (a plain task) for one worker; a kfpytorch `Elastic` config for more.

    One worker per GPU: Elastic(nnodes, nproc_per_node=gpus_per_node). One node runs torch elastic
    inside a single pod; more nodes become a Kubeflow PyTorchJob. A plain task is kept for one
    worker because Elastic's `execute` always goes through `elastic_launch` (spawned worker
    processes and a rendezvous), even in a local run.
    """
    from flytekitplugins.kfpytorch import Elastic

    if nnodes in ("1", "1:1") and gpus_per_node == 1:
        return None
    return Elastic(nnodes=int(nnodes) if nnodes.isdigit() else nnodes, nproc_per_node=gpus_per_node,
                   start_method="spawn", rdzv_configs={"timeout": 900, "join_timeout": 900},
                   increase_shared_mem=False)  # the task sets shared_memory=True instead (non-deprecated)


def _gpu(n: int, cpu: str, mem: str, disk: str) -> Resources:
    return Resources(cpu=cpu, mem=mem, gpu=str(n), ephemeral_storage=disk)


def stages(env: Optional[dict[str, str]] = None) -> dict[str, Stage]:
    """The cluster settings of every task (sized for the gpu-8b profile: an 8B model, bf16, LoRA)."""
    env = os.environ if env is None else env
    _, train_gpus = train_scale(env)
    eval_gpus = _positive_int(env, "ENVACE_EVAL_GPUS", 1)
    cpu, train, evl = images.CPU_IMAGE, images.TRAIN_IMAGE, images.EVAL_IMAGE
    h = lambda n: timedelta(hours=n)  # noqa: E731
    return {
        # Cheap, and its preflight (model, store, registry reachable) must run every time.
        "resolve_config": Stage(cpu, Resources(cpu="1", mem="2Gi"), Resources(cpu="2", mem="4Gi"),
                                2, h(0.25), cache=False),
        "curate": Stage(cpu, Resources(cpu="2", mem="8Gi"), Resources(cpu="4", mem="16Gi"), 2, h(1), True),
        # Retries are safe: a re-run resumes from the last checkpoint in the artifact store.
        "rollout_and_train": Stage(train, _gpu(train_gpus, "8", "96Gi", "200Gi"),
                                   _gpu(train_gpus, "16", "160Gi", "400Gi"), 3, h(48), True),
        "validate": Stage(evl, _gpu(eval_gpus, "4", "48Gi", "100Gi"), _gpu(eval_gpus, "8", "96Gi", "200Gi"),
                          1, h(4), True),
        "evaluate": Stage(evl, _gpu(eval_gpus, "4", "48Gi", "100Gi"), _gpu(eval_gpus, "8", "96Gi", "200Gi"),
                          2, h(24), True),
        # Side effects: see tasks/register.py for why it is never cached.
        "register": Stage(cpu, Resources(cpu="2", mem="8Gi", ephemeral_storage="100Gi"),
                          Resources(cpu="4", mem="16Gi", ephemeral_storage="200Gi"), 2, h(1), False),
        # Not cached by Flyte: it resumes from its own per-task cache in `out`, and its Deck (the
        # report) only renders when the body runs.
        "eval_bench": Stage(evl, _gpu(eval_gpus, "4", "48Gi", "100Gi"), _gpu(eval_gpus, "8", "96Gi", "200Gi"),
                            2, h(24), False),
        "rehearse_task": Stage(evl, _gpu(eval_gpus, "4", "48Gi", "100Gi"), _gpu(eval_gpus, "8", "96Gi", "200Gi"),
                               1, h(2), False),
        # Tool learning (tasks/adapt_tools.py explains why none of the three is cached).
        "check_tool_inputs": Stage(cpu, Resources(cpu="1", mem="2Gi"), Resources(cpu="2", mem="4Gi"),
                                   1, h(0.25), False),
        "adapt_tools": Stage(train, _gpu(1, "8", "96Gi", "200Gi"), _gpu(1, "16", "160Gi", "400Gi"),
                             2, h(12), False),
        "measure_tools": Stage(evl, _gpu(eval_gpus, "4", "48Gi", "100Gi"), _gpu(eval_gpus, "8", "96Gi", "200Gi"),
                               1, h(12), False),
    }


def stage_task(name: str, **extra: Any):
    """`@task` with the settings of stage `name` (image, requests/limits, retries, timeout, cache)."""
    s = stages()[name]
    cache = Cache(policies=[CodeCachePolicy()], serialize=True) if s.cache else False
    return task(container_image=s.image, requests=s.requests, limits=s.limits, retries=s.retries,
                timeout=s.timeout, cache=cache, **extra)


# ------------------------------------------------------------------------------- inputs on disk
def fetch_inputs(cfg, dataset: Optional[dict] = None, trained: Optional[dict] = None) -> Optional[dict]:
    """Make the artifacts that earlier stages' outputs name present on this machine.

    On a cluster each task runs in its own pod, and a cached output may be reused long after it
    was written, so a local path in `trained` can be absent here: the dataset and the adapter are
    fetched again from the artifact store (S3 downloads land at the same content-addressed path)
    and the base model is resolved again. Returns `trained` with paths valid on this machine.

    Raises StaleArtifactError when the store no longer holds them (e.g. deleted after a cached run).
    """
    from flytekit.core import local_cache

    from envace_core.models import resolve_model
    from envace_core.store.base import StoreError
    from envace_core.store.uri import open_store

    store = open_store(cfg.store.root)
    try:
        if dataset is not None:
            store.get_dir(dataset["key"])
        if trained is not None and not (Path(trained["adapter_dir"]) / "adapter_config.json").is_file():
            # rollout_and_train's checkpoint key (envace_core.stages.train.rollout_and_train)
            ckpt = store.get_dir(f"runs/{trained['run_id']}/checkpoint")
            trained = {**trained, "adapter_dir": str(ckpt / "adapter")}
    except StoreError as e:
        raise StaleArtifactError(
            f"{e}. An earlier stage's output points at artifacts that are gone from {cfg.store.root}; "
            "if that stage was a cache hit, clear the cache and run again: locally "
            f"`rm -rf {local_cache.CACHE_LOCATION}` "
            "or `pyflyte run --overwrite-cache ...`; on a cluster, relaunch with cache overwrite") from e
    if trained is not None and not Path(trained["base_model_dir"]).is_dir():
        trained = {**trained, "base_model_dir": str(resolve_model(cfg.model.ref))}
    return trained


configure_local_cache()
