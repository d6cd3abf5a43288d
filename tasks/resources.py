"""How each Flyte task runs on a cluster: image, resources, retries, timeout, cache, secrets and, for
multi-GPU training, a kfpytorch `Elastic` config. `stage_task(name)` is the `@task` every module of
tasks/ uses.

Resources follow the run's profile (`RESOURCES`, the one table of CPU / memory / GPU sizes): a task
is registered with its `cpu` tier (no GPU, no GPU type), and the workflows give the GPU stages of a
GPU profile (`GPU_PROFILES`) the `gpu` tier through `with_overrides(**gpu_overrides(stage))`, the GPU
type included (flytekit.extras.accelerators). So `cpu-smoke` on a cluster never asks for a GPU pod.

Every task body runs inside `stage_task`'s wrapper:
* an `envace_core.TransientError` or a torch.distributed backend/network/store error (NCCL, gloo,
  the rendezvous store) is re-raised as flytekit's `FlyteRecoverableException`, so the task's
  `retries` apply (flytekit treats any other user exception as non-recoverable);
* tasks that sign or verify registry manifests declare the Flyte secret `ENVACE_HMAC_SECRET` and
  hand its value to envace_core as $ENVACE_REGISTRY_HMAC_KEY (the variable `envace_core.store.
  registry` reads) when the pod does not already have it.

Environment variables, read when the tasks are imported (i.e. at registration; the ones that decide
the task type are baked into the task's container environment, so the pod imports the same task):
  ENVACE_TRAIN_NNODES  nodes for rollout_and_train (default 1; "min:max" for elastic ranges)
  ENVACE_TRAIN_GPUS    GPUs per node for rollout_and_train (default 1)
  ENVACE_EVAL_GPUS     GPUs for validate / evaluate / eval_bench / rehearse / measure_tools (default 1)
  ENVACE_GPU_TYPE      flytekit accelerator of the GPU tier: A100_80GB (default), H100, A100, L4, ...
                       (any constant of flytekit.extras.accelerators)
  ENVACE_HMAC_SECRET   the Flyte secret holding the registry HMAC key as GROUP/KEY (default
                       envace/registry-hmac-key); "none" declares no secret (unsigned manifests)
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from flytekit import Cache, Resources, Secret, current_context, task
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.extras import accelerators

from envace_core import EnvaceError, TransientError
from envace_core.store.registry import HMAC_KEY_ENV
from envace_core.training.heap import release_free_heap
from tasks import images
from tasks.cache_version import CodeCachePolicy


class FlyteSettingsError(EnvaceError):
    """An ENVACE_* deployment variable has a value the tasks cannot use; the message names it."""


# Profiles whose GPU stages get the `gpu` tier (and the GPU type); every other profile runs its
# GPU stages on the `cpu` tier, as the local runs do.
GPU_PROFILES = ("gpu-8b",)
DEFAULT_GPU_TYPE = "A100_80GB"  # an 8B policy in bf16 + LoRA + vLLM's KV cache needs the 80 GB card
DEFAULT_HMAC_SECRET = "envace/registry-hmac-key"
# Kubernetes: a Secret's name is a DNS-1123 subdomain; its data keys match [-._a-zA-Z0-9]+.
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
# The stages that resolve or write `registry:` entries, i.e. sign or verify manifests.
SIGNING_STAGES = ("resolve_config", "register", "eval_bench", "rehearse_task", "adapt_tools", "measure_tools")


@dataclass(frozen=True)
class Stage:
    """The cluster settings of one task: its ImageSpec (tasks/images.py), `cpu`-tier resource
    requests and limits, retries, timeout, and whether Flyte caches it (with `CodeCachePolicy`'s
    version)."""

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


def train_environment(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The container environment of rollout_and_train: the scale it was registered with.

    tasks/train.py picks a plain or an Elastic task from these variables at import; the pod imports
    the module again, so they must be in its environment or it would build a plain one-process task.
    """
    nnodes, gpus = train_scale(env)
    return {"ENVACE_TRAIN_NNODES": nnodes, "ENVACE_TRAIN_GPUS": str(gpus)}


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


def gpu_type(env: Optional[dict[str, str]] = None) -> accelerators.BaseAccelerator:
    """The flytekit accelerator named by ENVACE_GPU_TYPE (default A100_80GB)."""
    env = os.environ if env is None else env
    name = env.get("ENVACE_GPU_TYPE", "").strip() or DEFAULT_GPU_TYPE
    known = {k: v for k, v in vars(accelerators).items()
             if k.isupper() and isinstance(v, accelerators.BaseAccelerator)}
    if name.upper() not in known:
        raise FlyteSettingsError(f"ENVACE_GPU_TYPE={name!r}: expected one of {', '.join(sorted(known))} "
                                 "(flytekit.extras.accelerators)")
    return known[name.upper()]


def _res(cpu: str, mem: str, disk: Optional[str] = None, gpu: Optional[int] = None) -> Resources:
    return Resources(cpu=cpu, mem=mem, ephemeral_storage=disk, gpu=None if gpu is None else str(gpu))


def resources(env: Optional[dict[str, str]] = None) -> dict[str, dict[str, tuple[Resources, Resources]]]:
    """{tier: {stage: (requests, limits)}}, tiers `cpu` (every stage) and `gpu` (the GPU stages).

    The `gpu` tier is sized for the gpu-8b profile (an 8B model in bf16, LoRA, vLLM rollouts); the
    `cpu` tier for the CPU profiles (cpu-smoke, test), whose models are a few hundred MB.
    """
    env = os.environ if env is None else env
    _, train_gpus = train_scale(env)
    eval_gpus = _positive_int(env, "ENVACE_EVAL_GPUS", 1)
    small = (_res("1", "2Gi"), _res("2", "4Gi"))
    cpu_model = (_res("2", "8Gi", "20Gi"), _res("4", "16Gi", "40Gi"))
    cpu_train = (_res("4", "16Gi", "20Gi"), _res("8", "32Gi", "40Gi"))
    gpu_eval = (_res("4", "48Gi", "100Gi", eval_gpus), _res("8", "96Gi", "200Gi", eval_gpus))
    return {
        "cpu": {
            "resolve_config": small, "check_tool_inputs": small,
            "curate": (_res("2", "8Gi"), _res("4", "16Gi")),
            # register hashes the base model and copies the adapter: disk for both.
            "register": (_res("2", "8Gi", "100Gi"), _res("4", "16Gi", "200Gi")),
            "warm_start": cpu_train, "rollout_and_train": cpu_train, "adapt_tools": cpu_train,
            "validate": cpu_model, "evaluate": cpu_model, "eval_bench": cpu_model,
            "rehearse_task": cpu_model, "measure_tools": cpu_model,
        },
        "gpu": {
            "rollout_and_train": (_res("8", "96Gi", "200Gi", train_gpus), _res("16", "160Gi", "400Gi", train_gpus)),
            "adapt_tools": (_res("8", "96Gi", "200Gi", 1), _res("16", "160Gi", "400Gi", 1)),
            "warm_start": (_res("8", "96Gi", "200Gi", 1), _res("16", "160Gi", "400Gi", 1)),  # SFT, one process
            "validate": gpu_eval, "evaluate": gpu_eval, "eval_bench": gpu_eval,
            "rehearse_task": gpu_eval, "measure_tools": gpu_eval,
        },
    }


def gpu_overrides(stage: str, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """`with_overrides` keyword arguments that put GPU stage `stage` on the `gpu` tier: requests,
    limits and the GPU type. KeyError for a stage without a GPU tier."""
    requests, limits = resources(env)["gpu"][stage]
    return {"requests": requests, "limits": limits, "accelerator": gpu_type(env)}


def hmac_secret(env: Optional[dict[str, str]] = None) -> Optional[Secret]:
    """The Flyte secret of the registry HMAC key (ENVACE_HMAC_SECRET=GROUP/KEY), or None for "none".

    GROUP is the Kubernetes Secret's name (a DNS-1123 subdomain), KEY a key of its data
    (`[-._a-zA-Z0-9]+`); both at most 253 characters (Kubernetes API conventions, "Object names
    and IDs", and the Secret `data` key rule). FlyteSettingsError names the variable otherwise.

    Requested as an environment variable named $ENVACE_REGISTRY_HMAC_KEY where the cluster supports
    it; `stage_task` also reads it through flytekit's secrets manager (mounted file or variable).
    """
    env = os.environ if env is None else env
    raw = env.get("ENVACE_HMAC_SECRET", "").strip() or DEFAULT_HMAC_SECRET
    if raw.lower() == "none":
        return None
    group, _, key = raw.partition("/")
    if not group or not key or "/" in key:
        raise FlyteSettingsError(f"ENVACE_HMAC_SECRET={raw!r}: expected GROUP/KEY (a Kubernetes secret and "
                                 "its key) or none")
    if len(group) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(group):
        raise FlyteSettingsError(
            f"ENVACE_HMAC_SECRET={raw!r}: the group {group!r} is the Kubernetes secret's name, a DNS-1123 "
            "subdomain: at most 253 characters of lowercase a-z, 0-9, '-' and '.', starting and ending "
            "with a letter or digit (e.g. envace/registry-hmac-key)")
    if len(key) > 253 or not _SECRET_KEY.fullmatch(key):
        raise FlyteSettingsError(
            f"ENVACE_HMAC_SECRET={raw!r}: the key {key!r} is a key of the Kubernetes secret's data: at most "
            "253 characters of a-z, A-Z, 0-9, '-', '_' and '.' (e.g. envace/registry-hmac-key)")
    return Secret(group=group, key=key, mount_requirement=Secret.MountType.ENV_VAR, env_var=HMAC_KEY_ENV)


def stages(env: Optional[dict[str, str]] = None) -> dict[str, Stage]:
    """The cluster settings of every task (resources: the `cpu` tier of `resources`)."""
    cpu_tier = resources(env)["cpu"]
    cpu, train, evl = images.CPU_IMAGE, images.TRAIN_IMAGE, images.EVAL_IMAGE
    h = lambda n: timedelta(hours=n)  # noqa: E731

    def s(name, image, retries, hours, cache):
        return Stage(image, *cpu_tier[name], retries, h(hours), cache)

    return {
        # Cheap, and its preflight (model, store, registry reachable) must run every time.
        "resolve_config": s("resolve_config", cpu, 2, 0.25, False),
        "curate": s("curate", cpu, 2, 1, True),
        # Reuses the adapter the store holds for its warm-start id, so a retry trains at most once more.
        "warm_start": s("warm_start", train, 2, 12, True),
        # Retries are safe: a re-run resumes from the last checkpoint in the artifact store.
        "rollout_and_train": s("rollout_and_train", train, 3, 48, True),
        "validate": s("validate", evl, 1, 4, True),
        "evaluate": s("evaluate", evl, 2, 24, True),
        # Side effects: see tasks/register.py for why it is never cached.
        "register": s("register", cpu, 2, 1, False),
        # Not cached by Flyte: it resumes from its own cache in the artifact store, and its Deck
        # (the report) only renders when the body runs.
        "eval_bench": s("eval_bench", evl, 2, 24, False),
        "rehearse_task": s("rehearse_task", evl, 1, 2, False),
        # Tool learning (tasks/adapt_tools.py explains why none of the three is cached).
        "check_tool_inputs": s("check_tool_inputs", cpu, 1, 0.25, False),
        "adapt_tools": s("adapt_tools", train, 2, 12, False),
        "measure_tools": s("measure_tools", evl, 1, 12, False),
    }


def _distributed_errors() -> tuple[type[BaseException], ...]:
    """torch.distributed's backend (NCCL/gloo), network and store errors, if torch is loaded."""
    dist = sys.modules.get("torch.distributed")
    names = ("DistBackendError", "DistNetworkError", "DistStoreError")
    return tuple(getattr(dist, n) for n in names if dist is not None and hasattr(dist, n))


def recoverable(fn):
    """`fn` with transient failures re-raised as flytekit's `FlyteRecoverableException`.

    flytekit retries a task (its `retries`) only on system errors and recoverable user errors; an
    `envace_core.TransientError` or a torch.distributed backend/network/store error is recoverable
    (the cause stays chained). Every other exception passes unchanged.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TransientError as e:
            raise FlyteRecoverableException(f"{type(e).__name__}: {e}") from e
        except Exception as e:
            if isinstance(e, _distributed_errors()):
                raise FlyteRecoverableException(f"{type(e).__name__}: {e}") from e
            raise
    return wrapper


def timed(name: str, fn):
    """`fn` that prints, when it returns or raises, ``[<name>] <outcome> in <s> s`` (wall-clock
    seconds of the task body, flushed to stdout), so a run's log shows where its time went: the
    local main job's output and each pod's log. A task served from Flyte's cache runs no body and
    prints nothing. Then the freed heap goes back to the OS (`heap.release_free_heap`): a local run
    executes every stage in one process, and glibc kept a finished stage's freed pages resident
    under the next one (2.1 GiB after validate)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0, outcome = time.perf_counter(), "failed"
        try:
            out = fn(*args, **kwargs)
            outcome = "done"
            return out
        finally:
            print(f"[{name}] {outcome} in {time.perf_counter() - t0:.1f} s", flush=True)
            release_free_heap()
    return wrapper


def with_hmac_key(fn, secret: Secret):
    """`fn` run with $ENVACE_REGISTRY_HMAC_KEY set from Flyte secret `secret` when the pod has it."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not os.environ.get(HMAC_KEY_ENV):
            try:
                value = current_context().secrets.get(secret.group, secret.key)
            except ValueError:  # no such secret here (a local run without it): manifests stay unsigned
                value = None
            if value:
                os.environ[HMAC_KEY_ENV] = value.strip()
        return fn(*args, **kwargs)
    return wrapper


def stage_task(name: str, **extra: Any):
    """`@task` with the settings of stage `name` (image, `cpu`-tier requests/limits, retries,
    timeout, cache, the HMAC secret for `SIGNING_STAGES`), its body wrapped by `recoverable`."""
    s = stages()[name]
    cache = Cache(policies=[CodeCachePolicy()], serialize=True) if s.cache else False
    secret = hmac_secret() if name in SIGNING_STAGES else None
    if secret is not None:
        extra["secret_requests"] = [*extra.get("secret_requests", []), secret]

    # the image the pod runs, for its lineage (`envace_core.buildinfo`: Flyte's builder bakes in only
    # the spec id); known only where a registry is set, i.e. when serialising for a cluster
    try:
        image = s.image.image_name() if hasattr(s.image, "image_name") else None
    except images.ImageSettingsError:
        image = None
    if image:
        extra["environment"] = {"ENVACE_IMAGE": image, **(extra.get("environment") or {})}

    def decorate(fn):
        body = timed(name, recoverable(with_hmac_key(fn, secret) if secret is not None else fn))
        return task(container_image=s.image, requests=s.requests, limits=s.limits, retries=s.retries,
                    timeout=s.timeout, cache=cache, **extra)(body)
    return decorate
