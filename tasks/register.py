"""Flyte task: register the model with its lineage manifest."""

import json

import envace_core  # noqa: F401
from flytekit import current_context, task

from envace_core import stages
from envace_core.config import config_from_json


@task
def register(config: str, dataset: str, trained: str, validation: str, evaluation: str) -> str:
    try:
        execution_id = str(current_context().execution_id)
    except Exception:  # outside a Flyte execution context
        execution_id = "local"
    out = stages.register(config_from_json(config), json.loads(dataset), json.loads(trained),
                          json.loads(validation), json.loads(evaluation), execution_id=execution_id)
    return json.dumps(out)
