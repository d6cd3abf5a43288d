"""Private Rehearsal on one tau2 task: rehearse N times in the model's head, then commit one real run.

    pyflyte run workflows/rehearse.py rehearse --task_id airline/2 --mode parallel --n 4
    pyflyte run workflows/rehearse.py rehearse --task_id retail/5 --mode sequential --n 2 \
        --overrides 'model.ref=/path/to/model'

`--mode` and `--n` default to the profile's rehearsal.mode and rehearsal.n, and the arguments get `envace
rehearse`'s checks before the model loads (N within rehearsal.n's bounds, no `--n` under `--mode none`, a
known task id). Returns the result as JSON (same as `envace rehearse`); the task's Flyte Deck shows it as HTML.
`rehearse` runs on the `cpu` tier (CPU profiles); `rehearse_on_gpu` on the `gpu` tier with the GPU
type (tasks/resources.py), for a GPU profile's model on a cluster.
"""

from typing import Optional

from flytekit import workflow

import envace_core  # noqa: F401  (offline environment before tau2 is imported)
from tasks.rehearse import rehearse_task
from tasks.resources import gpu_overrides


@workflow
def rehearse(task_id: str, mode: Optional[str] = None, n: Optional[int] = None, profile: str = "cpu-smoke",
             overrides: str = "") -> str:
    """Private Rehearsal on `task_id` (DOMAIN/ID); returns the JSON result. `mode` / `n` None: the profile's."""
    return rehearse_task(task_id=task_id, mode=mode, n=n, profile=profile, overrides=overrides)


@workflow
def rehearse_on_gpu(task_id: str, mode: Optional[str] = None, n: Optional[int] = None, profile: str = "gpu-8b",
                    overrides: str = "") -> str:
    """`rehearse` with the task on the `gpu` tier."""
    return rehearse_task(task_id=task_id, mode=mode, n=n, profile=profile,
                         overrides=overrides).with_overrides(**gpu_overrides("rehearse_task"))
