"""Flyte task: benchmark evaluation with and without Private Rehearsal."""

import json

import envace_core  # noqa: F401
from flytekit import task

from envace_core import stages
from envace_core.config import config_from_json


@task
def evaluate(config: str, dataset: str, trained: str, validation: str) -> str:
    # `validation` orders this task after the gate: a failed gate stops the workflow before it.
    del validation
    return json.dumps(stages.evaluate(config_from_json(config), json.loads(dataset), json.loads(trained)),
                      default=str)
