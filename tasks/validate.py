"""Flyte task: rehearsal-quality validation and the registration gate."""

import json

import envace_core  # noqa: F401
from flytekit import task

from envace_core import stages
from envace_core.config import config_from_json


@task
def validate(config: str, dataset: str, trained: str) -> str:
    return json.dumps(stages.validate(config_from_json(config), json.loads(dataset), json.loads(trained)))
