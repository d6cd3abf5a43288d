"""Flyte task `evaluate` over `envace_core.stages.evaluate`: the trained policy on the test split, with
and without Private Rehearsal."""

import json

import envace_core  # noqa: F401
import envace_core.stages.evaluate as evaluate_mod
from envace_core.config import config_from_json
from envace_core.stages.inputs import fetch_inputs
from tasks.cache_version import clear_cache_hint
from tasks.resources import stage_task


@stage_task("evaluate")
def evaluate(config: str, dataset: str, trained: str, validation: str) -> str:
    # `validation` orders this task after the gate: a failed gate stops the workflow before it.
    del validation
    cfg, ds = config_from_json(config), json.loads(dataset)
    here = fetch_inputs(cfg, ds, json.loads(trained), stale_hint=clear_cache_hint())
    return json.dumps(evaluate_mod.evaluate(cfg, ds, here), default=str)
