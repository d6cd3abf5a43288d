"""Flyte task: Private Rehearsal on one tau2 task (thin wrapper over envace_core.rehearse_run).

The result (rehearsals, memory, committed run, reward, isolation check) is returned as JSON and shown
as HTML in the task's Flyte Deck.
"""

import json

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
from flytekit import Deck

from envace_core import rehearse_run
from envace_core.config import load_config
from tasks.settings import stage_task


@stage_task("rehearse_task", enable_deck=True)
def rehearse_task(task_id: str, mode: str, n: int, profile: str, overrides: str) -> str:
    """Rehearse `n` times, commit once; JSON result plus a Deck.

    Not cached: it is an interactive look at the agent, and the Deck (the point of running it) is
    only rendered when the body runs.
    """
    cfg = load_config(profile, overrides)
    out = rehearse_run.rehearse_task(cfg, task_id, mode, n)
    Deck(f"Private Rehearsal {task_id}", rehearse_run.render_html(out))
    return json.dumps(out, default=str)
