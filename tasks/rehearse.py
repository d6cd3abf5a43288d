"""Flyte task: Private Rehearsal on one tau2 task (thin wrapper over envace_core.rehearsal.inspect).

The result (rehearsals, memory, committed run, reward, isolation check) is returned as JSON and shown
as HTML in the task's Flyte Deck.
"""

import json

from flytekit import Deck

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
import envace_core.rehearsal.inspect as inspect_mod
from envace_core.config import load_config
from envace_core.rehearsal.inspect import render_html
from tasks.resources import stage_task


@stage_task("rehearse_task", enable_deck=True)
def rehearse_task(task_id: str, mode: str, n: int, profile: str, overrides: str) -> str:
    """Rehearse `n` times, commit once; JSON result plus a Deck.

    Not cached: it is an interactive look at the agent, and the Deck (the point of running it) is
    only rendered when the body runs.
    """
    cfg = load_config(profile, overrides)
    out = inspect_mod.rehearse_task(cfg, task_id, mode, n)
    Deck(f"Private Rehearsal {task_id}", render_html(out))
    return json.dumps(out, default=str)
