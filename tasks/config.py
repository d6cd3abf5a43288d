"""Flyte task: resolve the run configuration once, so every stage reads the same resolved config."""

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
from flytekit import task

from envace_core.config import load_config
from envace_core.stages import preflight


@task
def resolve_config(profile: str, overrides: str) -> str:
    """Profile + overrides → the full resolved config as JSON (recorded in the lineage).

    Also checks the model reference, the artifact store and the registry before any work starts.
    """
    cfg = load_config(profile, overrides)
    preflight(cfg)
    return cfg.model_dump_json(by_alias=True)
