"""Flyte task `validate` over `envace_core.stages.validate`: rehearsal-quality validation and the
registration gate (results shown in a Flyte Deck).

Runs REHEARSE with the trained policy on held-out transitions, so it gets a GPU and the CUDA
evaluation image (an 8B policy on CPU would take hours), unlike the CPU-only data stages.
"""

import json

from flytekit import Deck

import envace_core  # noqa: F401
import envace_core.stages.validate as validate_mod
from envace_core.config import config_from_json
from envace_core.stages.gates import GateError, render_gate_html
from envace_core.store.uri import open_store
from envace_core.stages.inputs import fetch_inputs
from tasks.cache_version import clear_cache_hint
from tasks.resources import stage_task


@stage_task("validate", enable_deck=True)
def validate(config: str, dataset: str, trained: str) -> str:
    """Rehearsal-quality metrics and gate results (JSON). A failed gate raises and is never cached."""
    cfg, ds = config_from_json(config), json.loads(dataset)
    here = fetch_inputs(cfg, ds, json.loads(trained), stale_hint=clear_cache_hint())
    try:
        out = validate_mod.validate(cfg, ds, here)
    except GateError as e:  # show the failed expectations, then stop the workflow
        if getattr(e, "result", None) is not None:
            Deck("rehearsal-quality gate", render_gate_html(e.result))
        raise
    Deck("rehearsal-quality gate", render_gate_html(open_store(cfg.store.root).read_json(out["gate_key"])))
    return json.dumps(out)
