"""Inputs of the stages after training: make the artifacts an earlier stage's output names present here.

On a cluster each stage runs in its own pod, and a cached output may be reused long after it was
written, so a local path in a `trained` result can be absent on this machine. `fetch_inputs`
downloads the dataset and the adapter again from the artifact store (S3 downloads land at the same
content-addressed path) and resolves the base model again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from envace_core import EnvaceError, TransientError
from envace_core.config import RunConfig
from envace_core.models import resolve_model
from envace_core.store.base import StoreError
from envace_core.store.uri import open_store


class StaleArtifactError(EnvaceError):
    """An earlier stage's output points at artifacts that no longer exist in the artifact store."""


def fetch_inputs(cfg: RunConfig, dataset: Optional[dict[str, Any]] = None, trained: Optional[dict[str, Any]] = None,
                 *, stale_hint: str = "run that stage again without its cache",
                 base_model: bool = True) -> Optional[dict[str, Any]]:
    """Make `dataset` (curate's output) and `trained` (rollout_and_train's output) present on this machine.

    Returns `trained` with `adapter_dir` valid here and, when `base_model`, `base_model_dir` too
    (None when `trained` is None). `base_model=False` is for stages that only fingerprint the base
    model (`register`: `models.base_model_lineage` lists an s3:// model instead of downloading it).
    `stale_hint` ends the error message: how the orchestrator that served a cached output drops it
    (tasks/ passes flytekit's).

    Raises StaleArtifactError when the store (`cfg.store.root`) no longer holds them, e.g. deleted
    after a cached run; a transient S3 failure stays a `store.s3.TransientStoreError` (an
    `envace_core.TransientError`: a retry may pass, the artifacts are not known to be gone).
    """
    store = open_store(cfg.store.root)
    try:
        if dataset is not None:
            store.get_dir(dataset["key"])
        if trained is not None and not (Path(trained["adapter_dir"]) / "adapter_config.json").is_file():
            # rollout_and_train's checkpoint key (envace_core.stages.train.rollout_and_train)
            ckpt = store.get_dir(f"runs/{trained['run_id']}/checkpoint")
            trained = {**trained, "adapter_dir": str(ckpt / "adapter")}
    except StoreError as e:
        if isinstance(e, TransientError):
            raise
        raise StaleArtifactError(
            f"{e}. An earlier stage's output points at artifacts that are gone from {cfg.store.root}; "
            f"if that stage was a cache hit, {stale_hint}") from e
    if base_model and trained is not None and not Path(trained["base_model_dir"]).is_dir():
        trained = {**trained, "base_model_dir": str(resolve_model(cfg.model.ref))}
    return trained
