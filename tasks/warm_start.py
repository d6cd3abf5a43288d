"""Flyte task `warm_start` over `envace_core.stages.warm_start`: the SFT warm start of the policy
(train.init_adapter, then train.sft_warmup_steps steps on both roles), between curate and
rollout_and_train."""

import json

import envace_core  # noqa: F401
import envace_core.stages.warm_start as warm_start_mod
from envace_core.config import config_from_json
from tasks.resources import stage_task


@stage_task("warm_start")
def warm_start(config: str, dataset: str) -> str:
    """The warm start's id, adapter URI in the artifact store, examples and losses (JSON).

    Cached on (config, dataset, code). Without the Flyte cache (a new code version, another
    execution) the stage still reuses the adapter the store holds for the same warm-start id, so it
    trains only when what decides the weights changed.
    """
    return json.dumps(warm_start_mod.warm_start(config_from_json(config), json.loads(dataset)), default=str)
