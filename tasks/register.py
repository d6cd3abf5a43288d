"""Flyte task `register` over `envace_core.stages.register`: the model and its lineage manifest into
the registry."""

import json

from flytekit import current_context

import envace_core  # noqa: F401
import envace_core.stages.register as register_mod
from envace_core.config import config_from_json
from envace_core.stages.inputs import fetch_inputs
from tasks.cache_version import clear_cache_hint
from tasks.resources import stage_task


@stage_task("register")
def register(config: str, dataset: str, trained: str, validation: str, evaluation: str) -> str:
    """Write the model and its lineage manifest to the registry; returns the entry as JSON.

    Never cached: registering is a side effect, not a function of the inputs. A cache hit would
    skip writing the entry (a deleted registry would not be rebuilt, a new execution id would not be
    recorded) and would hand back a version that may no longer exist; the registry, not a cache,
    decides what is already registered and refuses a duplicate version.
    """
    try:
        execution_id = str(current_context().execution_id)
    except Exception:  # outside a Flyte execution context
        execution_id = "local"
    cfg, ds = config_from_json(config), json.loads(dataset)
    # the base model is fingerprinted from its S3 listing (models.base_model_lineage), never downloaded here
    here = fetch_inputs(cfg, ds, json.loads(trained), stale_hint=clear_cache_hint(), base_model=False)
    out = register_mod.register(cfg, ds, here, json.loads(validation), json.loads(evaluation),
                                execution_id=execution_id)
    return json.dumps(out)
