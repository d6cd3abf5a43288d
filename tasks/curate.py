"""Flyte task: curate the versioned training/evaluation dataset (thin wrapper over envace_core)."""

import json

import envace_core  # noqa: F401
from flytekit import task

from envace_core import stages
from envace_core.config import config_from_json


@task
def curate(config: str) -> str:
    return json.dumps(stages.curate(config_from_json(config)))
