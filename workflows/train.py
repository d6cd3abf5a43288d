"""The main job: curate → warm start → rollout+train → validate → evaluate → register.

    pyflyte run workflows/train.py train                         # CPU default profile, local
    pyflyte run workflows/train.py train --profile test --overrides 'train.iterations=1'
    pyflyte run --remote workflows/train.py train --profile gpu-8b --overrides "$ENVACE_CLUSTER_OVERRIDES"

`train` picks the resources from the profile: a GPU profile (`tasks.resources.GPU_PROFILES`) runs the
sub-workflow `train_on_gpu` (the GPU stages on the `gpu` tier, with the GPU type), any other profile
`train_on_cpu` (every task on the `cpu` tier, no GPU requested). Both are ordinary workflows too.

The weekly launch plan `envace_weekly_retrain` runs `train` with profile gpu-8b and the overrides
in $ENVACE_SCHEDULE_OVERRIDES at registration (its default input; Flyte's activation cannot change
inputs, so changing them means registering a new launch plan version). gpu-8b's store, registry,
model and DVC remote are `s3://CHANGE-ME/...` placeholders, which resolve_config refuses in a pod:
the overrides must set store.root, store.registry, model.ref and data.dvc_remote (README, Operators).
"""

import os

from flytekit import CronSchedule, LaunchPlan, conditional, workflow

import envace_core  # noqa: F401  (offline environment before tau2 is imported)
from tasks.curate import curate
from tasks.evaluate import evaluate
from tasks.preflight import resolve_config
from tasks.register import register
from tasks.resources import GPU_PROFILES, gpu_overrides
from tasks.train import rollout_and_train
from tasks.validate import validate
from tasks.warm_start import warm_start

SCHEDULE = "0 3 * * 0"  # Sundays 03:00 UTC
SCHEDULE_OVERRIDES_ENV = "ENVACE_SCHEDULE_OVERRIDES"


def _pipeline(profile, overrides, gpu: bool):
    """The stages; with `gpu`, the GPU stages get `gpu_overrides` (requests, limits, GPU type)."""
    def on(node, stage):
        return node.with_overrides(**gpu_overrides(stage)) if gpu else node

    config = resolve_config(profile=profile, overrides=overrides)
    dataset = curate(config=config)
    warm = on(warm_start(config=config, dataset=dataset), "warm_start")
    trained = on(rollout_and_train(config=config, dataset=dataset, warm=warm), "rollout_and_train")
    validation = on(validate(config=config, dataset=dataset, trained=trained), "validate")
    evaluation = on(evaluate(config=config, dataset=dataset, trained=trained, validation=validation), "evaluate")
    return register(config=config, dataset=dataset, trained=trained, validation=validation,
                    evaluation=evaluation)


@workflow
def train_on_cpu(profile: str = "cpu-smoke", overrides: str = "") -> str:
    """The main job with every task on the `cpu` tier (CPU profiles: cpu-smoke, test)."""
    return _pipeline(profile, overrides, gpu=False)


@workflow
def train_on_gpu(profile: str = "gpu-8b", overrides: str = "") -> str:
    """The main job with warm_start / train / validate / evaluate on the `gpu` tier (GPU profiles: gpu-8b)."""
    return _pipeline(profile, overrides, gpu=True)


@workflow
def train(profile: str = "cpu-smoke", overrides: str = "") -> str:
    """Train a World Rehearsal policy and register it; returns the registry entry as JSON.

    Resources follow `profile`: `train_on_gpu` for a GPU profile, else `train_on_cpu`."""
    branch = conditional("resources_of_profile")
    for name in GPU_PROFILES:
        branch = (branch.if_ if name == GPU_PROFILES[0] else branch.elif_)(profile == name).then(
            train_on_gpu(profile=profile, overrides=overrides))
    return branch.else_().then(train_on_cpu(profile=profile, overrides=overrides))


# Scheduled retraining on the cluster. The profile is fixed so a schedule cannot silently run the CPU
# smoke job; the overrides (the cluster's URIs) are the default input, taken from the environment at
# registration. A schedule always runs with the registered defaults.
def schedule_overrides(env: dict[str, str] | None = None) -> str:
    """$ENVACE_SCHEDULE_OVERRIDES, checked as the scheduled runs will use it: it must load with the
    gpu-8b profile and name shared (s3://) store, registry, model and DVC remote, no placeholder
    (`preflight.check_remote_settings` without requests). A launch plan's inputs cannot change on
    activation, so a mistake found at the first Sunday run would cost a re-registration; it is refused
    here, when the workflows are imported for registration. Unset/empty: "" (local runs need none).

    Raises ConfigError naming the variable and every bad setting."""
    from envace_core.config import ConfigError, load_config
    from envace_core.stages.preflight import check_remote_settings

    value = (os.environ if env is None else env).get(SCHEDULE_OVERRIDES_ENV, "").strip()
    if not value:
        return ""
    try:
        check_remote_settings(load_config(SCHEDULE_PROFILE, value), probe=False)
    except ConfigError as e:
        raise ConfigError(f"{SCHEDULE_OVERRIDES_ENV} (the weekly launch plan's overrides): {e}") from None
    return value


SCHEDULE_PROFILE = "gpu-8b"
weekly_retrain = LaunchPlan.get_or_create(
    workflow=train,
    name="envace_weekly_retrain",
    fixed_inputs={"profile": SCHEDULE_PROFILE},
    default_inputs={"overrides": schedule_overrides()},
    schedule=CronSchedule(schedule=SCHEDULE),
)
