"""Flyte task `curate` over `envace_core.stages.curate`: the versioned training/evaluation dataset."""

import json

import envace_core  # noqa: F401
import envace_core.stages.curate as curate_mod
from envace_core.config import config_from_json
from tasks.resources import stage_task


@stage_task("curate")
def curate(config: str) -> str:
    """The curated dataset's location and version (JSON). Cached: same config + same code → same data."""
    return json.dumps(curate_mod.curate(config_from_json(config)))
