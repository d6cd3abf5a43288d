"""Flyte task: Private Rehearsal on one tau2 task (thin wrapper over envace_core.rehearsal.inspect).

The result (rehearsals, memory, committed run, reward, isolation check) is returned as JSON and shown
as HTML in the task's Flyte Deck.
"""

import json
from typing import Optional

from flytekit import Deck

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
import envace_core.rehearsal.inspect as inspect_mod
from envace_core.config import load_config
from envace_core.rehearsal.inspect import check_rehearse_args, render_html
from tasks.resources import stage_task


@stage_task("rehearse_task", enable_deck=True)
def rehearse_task(task_id: str, mode: Optional[str], n: Optional[int], profile: str, overrides: str) -> str:
    """Rehearse `n` times, commit once; JSON result plus a Deck. `mode` / `n` None: the profile's
    ``rehearsal.mode`` / ``rehearsal.n``, as `envace rehearse`.

    The arguments get `envace rehearse`'s checks (`check_rehearse_args`: n within rehearsal.n's bounds, no
    --n under mode none, a known task id, ...) before the model loads; raises their `EnvaceError`.
    Not cached: it is an interactive look at the agent, and the Deck (the point of running it) is
    only rendered when the body runs.
    """
    cfg = load_config(profile, overrides)
    check_rehearse_args(cfg, task_id, mode=mode, n=n, task_flag="--task_id")
    out = inspect_mod.rehearse_task(cfg, task_id, mode, n)
    Deck(f"Private Rehearsal {task_id}", render_html(out))
    return json.dumps(out, default=str)
