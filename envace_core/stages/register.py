"""The `register` stage: the trained model and its lineage manifest into the registry."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from envace_core.config import RunConfig
from envace_core.stages.compare import regressions
from envace_core.store.files import dir_checksums, sha256_bytes
from envace_core.store.uri import open_store


# -------------------------------------------------------------------------------------- register
def register(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any],
             validation: dict[str, Any], evaluation: dict[str, Any],
             execution_id: str = "local", extra_manifest: Optional[dict[str, Any]] = None,
             extra_artifacts: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Write the adapter, config and reports with a lineage manifest to the model registry.

    Artifacts: adapter/, config.json, training_history.json, evaluation.json and gates/ (the saved
    dataset and rehearsal gate reports). The manifest (lineage.Registry adds name, version and the
    sha256 of every artifact, and an HMAC when a key is set) records the base model and its
    fingerprint (`models.base_model_lineage`: for an s3:// model the sha256 of its weight objects'
    listing, names, sizes and ETags, so nothing is downloaded here; for a local or bundled one the
    sha256 of its weight files, from `trained["base_model_dir"]` when that folder exists here; the
    `fingerprint` key says which), the dataset version, counts and DVC md5 (`dataset.dvc`,
    {"tracked": False, "reason"} if curate ran outside a DVC repo), the code version
    (`buildinfo.build_info`: git commit or the image's BUILD_INFO.json, dirty flag, image, package
    versions), the full resolved config, the Flyte
    execution id, metrics, both gates' per-expectation results and the warm start the run started
    from (``warm_start``: `stages.train.warm_start_lineage` of ``trained["warm_start"]`` = id, adapter
    URI, init adapter, examples per role, SFT losses, steps, seconds; None when it started from none). ``metrics.evaluation`` holds
    pass^1 per "<condition>|<domain>" and ``metrics.evaluation_protocol`` the tau2 protocol that
    measured them (`evaluation.protocols.describe`: name, user, turns, scoring, skips, trials, seed;
    None when `evaluation` names none, e.g. tool learning's registration, which measures separately);
    ``metrics.comparison`` the base / warm start / trained comparison (`compare.summarize`; None when
    not made) and ``metrics.regressions`` its lines where the trained policy scores below base or warm
    start (`compare.regressions`; also printed as a warning: the model is registered all the same, so
    the record shows what the run made).
    Works with a local or an s3:// registry (`store.registry`); returns {"name", "version", "path", "manifest"}.
    `extra_manifest` adds top-level manifest keys (tool learning: `parent`, `tools`, ...) and
    `extra_artifacts` ({relative path: text}) adds hashed artifact files.
    """
    from envace_core.buildinfo import build_info
    from envace_core.models import base_model_lineage
    from envace_core.store.registry import Registry

    adapter = Path(trained["adapter_dir"])
    adapter_hash = sha256_bytes(json.dumps(dir_checksums(adapter), sort_keys=True).encode())
    version = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + adapter_hash[:8]
    with tempfile.TemporaryDirectory() as tmp:
        import shutil

        shutil.copytree(adapter, Path(tmp) / "adapter")
        (Path(tmp) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        (Path(tmp) / "training_history.json").write_text(json.dumps(trained["history"], indent=2, default=str))
        (Path(tmp) / "evaluation.json").write_text(json.dumps(evaluation, indent=2, default=str))
        for rel, text in (extra_artifacts or {}).items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_text(text)
        store = open_store(cfg.store.root)
        for name, result in (("dataset", dataset), ("rehearsal", validation)):  # full gate reports, hashed
            if result.get("gate_key"):
                (Path(tmp) / "gates").mkdir(exist_ok=True)
                (Path(tmp) / "gates" / f"{name}.json").write_bytes(store.read_bytes(result["gate_key"]))
        manifest = {
            "base_model": base_model_lineage(cfg.model.ref, trained.get("base_model_dir")),
            "dataset": {"version": dataset["version"], "dir": dataset["dir"],
                        "n_train": dataset["n_train"], "n_test": dataset["n_test"],
                        "dvc": dataset.get("dvc") or {"tracked": False, "reason": "curated without DVC"}},
            "code": build_info(), "config": cfg.to_dict(), "execution_id": execution_id,
            "metrics": {"training": trained["history"][-1] if trained["history"] else {},
                        "learning_signal": trained.get("learning_signal"),
                        "validation": validation["metrics"],
                        "evaluation": {k: v["pass^1"] for k, v in evaluation["summary"].items()},
                        "evaluation_protocol": evaluation.get("protocol"),
                        "comparison": (evaluation.get("comparison") or {}).get("summary"),
                        "regressions": regressions((evaluation.get("comparison") or {}).get("summary"))},
            "gates": {"dataset": dataset.get("gate"), "rehearsal": validation["gate"]},
            "run_id": trained["run_id"],
            "warm_start": trained.get("warm_start"),
            **(extra_manifest or {}),
        }
        reg = Registry(cfg.store.registry)
        reg.register(cfg.store.model_name, version, tmp, manifest)
    where, dvc = reg.uri(cfg.store.model_name, version), manifest["dataset"]["dvc"]
    print(f"[register] model {cfg.store.model_name}@{version}\n"
          f"  artifacts: {where}/artifacts\n  lineage manifest: {where}/manifest.json\n"
          f"  dataset DVC md5: {dvc.get('md5') or 'untracked (' + str(dvc.get('reason')) + ')'}")
    for line in manifest["metrics"]["regressions"]:
        print(f"[register] WARNING: the registered model scores below the model it started from or its base: {line}")
    return {"name": cfg.store.model_name, "version": version, "path": where,
            "manifest": f"{where}/manifest.json"}
