"""Private Rehearsal on one tau2 task: rehearse N times in the model's head, then commit one real run.

    pyflyte run workflows/rehearse.py rehearse --task_id airline/2 --mode parallel --n 4
    pyflyte run workflows/rehearse.py rehearse --task_id retail/5 --mode sequential --n 2 \
        --overrides 'model.ref=/path/to/model'

Returns the result as JSON (same as `envace rehearse`); the task's Flyte Deck shows it as HTML.
`rehearse` runs on the `cpu` tier (CPU profiles); `rehearse_on_gpu` on the `gpu` tier with the GPU
type (tasks/resources.py), for a GPU profile's model on a cluster.
"""

from flytekit import workflow

import envace_core  # noqa: F401  (offline environment before tau2 is imported)
from tasks.rehearse import rehearse_task
from tasks.resources import gpu_overrides


@workflow
def rehearse(task_id: str, mode: str = "parallel", n: int = 4, profile: str = "cpu-smoke",
             overrides: str = "") -> str:
    """Private Rehearsal on `task_id` (DOMAIN/ID); returns the JSON result."""
    return rehearse_task(task_id=task_id, mode=mode, n=n, profile=profile, overrides=overrides)


@workflow
def rehearse_on_gpu(task_id: str, mode: str = "parallel", n: int = 4, profile: str = "gpu-8b",
                    overrides: str = "") -> str:
    """`rehearse` with the task on the `gpu` tier."""
    return rehearse_task(task_id=task_id, mode=mode, n=n, profile=profile,
                         overrides=overrides).with_overrides(**gpu_overrides("rehearse_task"))
