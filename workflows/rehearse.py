"""Private Rehearsal on one tau2 task: rehearse N times in the model's head, then commit one real run.

    pyflyte run workflows/rehearse.py rehearse --task_id airline/2 --mode parallel --n 4
    pyflyte run workflows/rehearse.py rehearse --task_id retail/5 --mode sequential --n 2 \
        --overrides 'model.ref=/path/to/model'

Returns the result as JSON (same as `envace rehearse`); the task's Flyte Deck shows it as HTML.
"""

from flytekit import workflow

import envace_core  # noqa: F401  (offline environment before tau2 is imported)
from tasks.rehearse import rehearse_task


@workflow
def rehearse(task_id: str, mode: str = "parallel", n: int = 4, profile: str = "cpu-smoke",
             overrides: str = "") -> str:
    """Private Rehearsal on `task_id` (DOMAIN/ID); returns the JSON result."""
    return rehearse_task(task_id=task_id, mode=mode, n=n, profile=profile, overrides=overrides)
