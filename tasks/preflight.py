"""Flyte task `resolve_config` over `envace_core.stages.preflight`: resolve the run configuration once
(so every stage reads the same resolved config) and check it before any work starts."""

from flytekit import FlyteContextManager

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
from envace_core.config import load_config
from envace_core.stages.preflight import resolve_and_check
from tasks.resources import stage_task


def is_pod_execution() -> bool:
    """True when this task runs in a Flyte pod (flytekit's execution mode TASK_EXECUTION), False in a
    local `pyflyte run` / direct call (flytekit's local execution modes, or no execution at all)."""
    state = FlyteContextManager.current_context().execution_state
    return state is not None and state.mode is not None and not state.is_local_execution()


@stage_task("resolve_config")
def resolve_config(profile: str, overrides: str) -> str:
    """Profile + overrides → the full resolved config as JSON (recorded in the lineage).

    Also checks the model reference, the artifact store and the registry before any work starts; in
    a pod (`is_pod_execution`) also that none of them, nor the DVC remote, is a local path or a
    placeholder (every stage is its own pod and shares no disk with the others).
    A `train.init_adapter` written registry:NAME@VERSION becomes that version's adapter location in
    store.registry (`resolve_references`), so the later stages and the lineage read a verified path.
    Not cached: it takes seconds, and its preflight checks must see the world as it is now.
    """
    remote = is_pod_execution()
    cfg = resolve_and_check(load_config(profile, overrides), remote=remote)
    return cfg.model_dump_json(by_alias=True)
