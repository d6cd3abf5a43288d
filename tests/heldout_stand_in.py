"""Stand-ins for the held-out rehearsal benchmarks' tiny-model runs: a dataset folder and two tau2 test tasks in
place of synthesized held-out ones (synthesis is covered by the main job's tests and takes minutes)."""

from __future__ import annotations

import json
from pathlib import Path


def stand_in_heldout(tmp_path: Path) -> tuple[Path, list, str]:
    """(a dataset folder holding tasks.parquet with 2 airline train tasks, [airline test 0, retail test 0], the
    ``--overrides`` JSON of a quick float32 run storing under `tmp_path`)."""
    import pandas as pd

    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.stages.dataset import task_record

    ds = tmp_path / "ds"
    ds.mkdir()
    pd.DataFrame([task_record(t) for t in load_tasks("airline", "train")[:2]]).to_parquet(ds / "tasks.parquet")
    stand_in = [load_tasks("airline", "test")[0], load_tasks("retail", "test")[0]]
    over = json.dumps({"model": {"compute_dtype": "float32"}, "rollout": {"max_new_tokens_act": 4},
                       "eval": {"max_turns": 2},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})
    return ds, stand_in, over
