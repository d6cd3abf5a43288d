"""Flyte task: alternate rollouts and role-wise GRPO steps for K iterations (one machine owns the loop)."""

import json

import envace_core  # noqa: F401
from flytekit import task

from envace_core import stages
from envace_core.config import config_from_json


@task
def rollout_and_train(config: str, dataset: str) -> str:
    return json.dumps(stages.rollout_and_train(config_from_json(config), json.loads(dataset)), default=str)
