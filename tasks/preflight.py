"""Flyte task `resolve_config` over `envace_core.stages.preflight`: resolve the run configuration once
(so every stage reads the same resolved config) and check it before any work starts."""

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
from envace_core.config import load_config
from envace_core.stages.preflight import preflight
from tasks.resources import stage_task


@stage_task("resolve_config")
def resolve_config(profile: str, overrides: str) -> str:
    """Profile + overrides → the full resolved config as JSON (recorded in the lineage).

    Also checks the model reference, the artifact store and the registry before any work starts.
    Not cached: it takes seconds, and its preflight checks must see the world as it is now.
    """
    cfg = load_config(profile, overrides)
    preflight(cfg)
    return cfg.model_dump_json(by_alias=True)
