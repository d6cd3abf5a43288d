"""The main job: curate → rollout+train → validate → evaluate → register.

    pyflyte run workflows/train.py train                         # CPU default profile, local
    pyflyte run workflows/train.py train --profile test --overrides 'train.iterations=1'
"""

from flytekit import CronSchedule, LaunchPlan, workflow

import envace_core  # noqa: F401  (offline environment before tau2 is imported)
from tasks.preflight import resolve_config
from tasks.curate import curate
from tasks.evaluate import evaluate
from tasks.register import register
from tasks.train import rollout_and_train
from tasks.validate import validate


@workflow
def train(profile: str = "cpu-smoke", overrides: str = "") -> str:
    """Train a World Rehearsal policy and register it; returns the registry entry as JSON."""
    config = resolve_config(profile=profile, overrides=overrides)
    dataset = curate(config=config)
    trained = rollout_and_train(config=config, dataset=dataset)
    validation = validate(config=config, dataset=dataset, trained=trained)
    evaluation = evaluate(config=config, dataset=dataset, trained=trained, validation=validation)
    return register(config=config, dataset=dataset, trained=trained, validation=validation,
                    evaluation=evaluation)


# Scheduled retraining: every Sunday 03:00 UTC on the cluster, with the GPU profile. The launch plan
# fixes the profile so a schedule can't silently run the CPU smoke job; overrides stay a default
# input that an operator can change when activating it (see README "Scheduled retraining").
weekly_retrain = LaunchPlan.get_or_create(
    workflow=train,
    name="envace_weekly_retrain",
    fixed_inputs={"profile": "gpu-8b"},
    default_inputs={"overrides": ""},
    schedule=CronSchedule(schedule="0 3 * * 0"),
)
