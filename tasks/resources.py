"""How each Flyte task runs on a cluster: image, resource requests/limits, retries, timeout, cache
and, for multi-GPU training, a kfpytorch `Elastic` config. `stage_task(name)` is the `@task` every
module of tasks/ uses.

Environment variables, read when the tasks are imported (i.e. at registration):
  ENVACE_TRAIN_NNODES  nodes for rollout_and_train (default 1; "min:max" for elastic ranges)
  ENVACE_TRAIN_GPUS    GPUs per node for rollout_and_train (default 1)
  ENVACE_EVAL_GPUS     GPUs for validate / evaluate / rehearse (default 1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from flytekit import Cache, Resources, task

from envace_core import EnvaceError
from tasks import images
from tasks.cache_version import CodeCachePolicy


class FlyteSettingsError(EnvaceError):
    """An ENVACE_* deployment variable has a value the tasks cannot use; the message names it."""


@dataclass(frozen=True)
class Stage:
    """The cluster settings of one task: its ImageSpec (tasks/images.py), resource requests and
    limits, retries, timeout, and whether Flyte caches it (with `CodeCachePolicy`'s version)."""

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
