"""Flyte task: benchmark evaluation with and without Private Rehearsal."""

import json

import envace_core  # noqa: F401
import envace_core.stages.evaluate as evaluate_mod
from envace_core.config import config_from_json
from tasks.settings import fetch_inputs, stage_task


@stage_task("evaluate")
def evaluate(config: str, dataset: str, trained: str, validation: str) -> str:
    # `validation` orders this task after the gate: a failed gate stops the workflow before it.
    del validation
    cfg, ds = config_from_json(config), json.loads(dataset)
    return json.dumps(evaluate_mod.evaluate(cfg, ds, fetch_inputs(cfg, ds, json.loads(trained))), default=str)
