"""Flyte task: rehearsal-quality validation and the registration gate (results shown in a Flyte Deck)."""

import json

import envace_core  # noqa: F401
from flytekit import Deck, task

from envace_core import stages
from envace_core.config import config_from_json
from envace_core.gates import render_gate_html
from envace_core.storage import open_store


@task(enable_deck=True)
def validate(config: str, dataset: str, trained: str) -> str:
    try:
        out = stages.validate(config_from_json(config), json.loads(dataset), json.loads(trained))
    except stages.GateError as e:  # show the failed expectations, then stop the workflow
        if getattr(e, "result", None) is not None:
            Deck("rehearsal-quality gate", render_gate_html(e.result))
        raise
    cfg = config_from_json(config)
    Deck("rehearsal-quality gate", render_gate_html(open_store(cfg.store.root).read_json(out["gate_key"])))
    return json.dumps(out)
