"""REHEARSE on the validate stage's held-out real transitions, for several models (warm starts, trained policies).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/validate_models.py \
        --dataset .envace/store/datasets/<version> \
        --models mixed30=.envace/store/warm_starts/<id>/adapter,trained=registry:NAME@VERSION \
        [--profile cpu-smoke] [--overrides ...] [--json benchmarks/results/validate_models.json]

The main job's validate stage scores one model, the one it trained. This runs the same measurement
(`stages.validate`: `validation_transitions` of the dataset's test split, with the profile's
validate.max_transitions and validate.fit_budget; `rehearse_rows` greedy at the per-tool REHEARSE budgets;
`rehearsal_metrics`: JSON validity, parse-error rate, fidelity F(ô, o), error-vs-success accuracy, key and
value F1, each with a 95 % percentile bootstrap CI over transitions) on every model of --models, so warm
starts can be compared on the transitions the gate sees. The gate itself is not applied.

Models are ``LABEL=REF`` (a LoRA adapter folder, ``registry:NAME@VERSION``, ``bundled:…``), as
`models.resolve_model_ref` reads them. Results are cached in --json per label with a fingerprint (the
model's file checksums, the dataset version, the validation settings), so a rerun skips models already
measured and re-measures one whose files or settings changed. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from iteration_profile import dataset_record
from rehearsal_effect import BenchmarkError, parse_models

import envace_core  # noqa: F401  (rehearsal_effect has set the offline environment)

HERE = Path(__file__).resolve().parent
# reported metric -> its per-transition field in `rehearse_rows`
COLUMNS = {"json_validity": "json_valid", "parse_error_rate": "parse_error", "fidelity": "fidelity",
           "error_prediction_accuracy": "error_match", "key_f1": "key_f1", "value_f1": "value_f1"}


def fingerprint(model: Any, dataset: dict[str, Any], cfg: Any) -> str:
    """Cache key of one model's result: its base and adapter (every adapter file's sha256), the dataset
    version and the settings that choose and budget the transitions."""
    from envace_core.store.files import dir_checksums

    adapter = dir_checksums(Path(model.adapter_dir)) if model.adapter_dir else None
    blob = json.dumps([model.base_ref, adapter, dataset["version"], cfg.validate_.model_dump(),
                       cfg.rollout.model_dump(), cfg.model.compute_dtype], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def measure(cfg: Any, dataset: dict[str, Any], model: Any) -> dict[str, Any]:
    """`rehearsal_metrics` of `model` on the validate stage's transitions, plus "ci" {metric: `stats.mean_ci`
    over transitions} for each of `COLUMNS` and "seconds"."""
    from envace_core.evaluation.stats import mean_ci
    from envace_core.stages.validate import (
        rehearsal_metrics,
        rehearse_rows,
        validation_params,
        validation_transitions,
    )
    from envace_core.training.policy import load_engine

    t0 = time.monotonic()
    engine, _ = load_engine(cfg, model)  # the model's own base (a registry manifest's), its adapter over it
    params = validation_params(cfg, dataset)
    rows = rehearse_rows(cfg, engine, validation_transitions(cfg, dataset, engine.tokenizer, params), params)
    ci = {name: mean_ci([float(r[f]) for r in rows if r.get(f) is not None]) for name, f in COLUMNS.items()}
    return {**rehearsal_metrics(rows), "ci": ci, "seconds": round(time.monotonic() - t0, 1)}


def markdown(results: dict[str, Any]) -> str:
    """One row per model: n and each `COLUMNS` metric as mean [95 % CI]."""
    def cell(m: dict[str, Any]) -> str:
        if m.get("mean") is None:
            return "—"
        lo, hi = m["ci95"]
        return f"{m['mean']:.3f} [{lo:.2f}, {hi:.2f}]"

    lines = ["| model | n | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for label, r in results.items():
        m = r["metrics"]
        lines.append(f"| {label} | {m.get('transitions')} | " + " | ".join(cell(m["ci"][c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def read_report(out: Path) -> dict[str, Any]:
    """The report at `out` to resume ({"models": {label: result}}; a new one when there is no file), after
    checking that `out` can be written. Raises `BenchmarkError` for a folder, a folder that cannot be
    written, or a file that is not such a report (nothing is measured before this)."""
    if out.is_dir():
        raise BenchmarkError(f"--json {out} is a folder; give a file path")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise BenchmarkError(f"--json {out}: its folder {out.parent} does not exist or is not writable")
    if not out.is_file():
        return {"models": {}}
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError) as e:
        raise BenchmarkError(f"--json {out}: not JSON ({e}); move it away to start afresh") from None
    models = report.get("models") if isinstance(report, dict) else None
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise BenchmarkError(f"--json {out}: not a validate_models report ({{\"models\": {{label: result}}}}); "
                             "move it away to start afresh")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, help="<store>/datasets/<version> (the curate stage's folder)")
    ap.add_argument("--models", required=True, help="LABEL=REF,... (an adapter folder, registry:..., bundled:...)")
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--json", default=str(HERE / "results" / "validate_models.json"))
    args = ap.parse_args(argv)

    from envace_core.config import load_config
    from envace_core.models import check_model_ref
    from envace_core.store.files import atomic_write_text

    out = Path(args.json)
    report = read_report(out)
    cfg = load_config(args.profile, args.overrides)
    dataset = dataset_record(args.dataset, cfg.data.train_split)
    models = parse_models(args.models, None)
    resolved = {label: check_model_ref(ref, cfg) for label, ref in models}  # every model found before any loads
    for label, ref in models:
        key = fingerprint(resolved[label], dataset, cfg)
        if report["models"].get(label, {}).get("fingerprint") == key:
            print(f"[validate_models] {label}: cached", flush=True)
            continue
        print(f"[validate_models] {label}: {resolved[label].label}", flush=True)
        report["models"][label] = {"ref": ref, "fingerprint": key, "dataset": dataset["version"],
                                   "profile": args.profile, "overrides": args.overrides,
                                   "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_avg": list(os.getloadavg()),
                                   "metrics": measure(cfg, dataset, resolved[label])}
        atomic_write_text(out, json.dumps(report, indent=1, sort_keys=True, default=str))  # after each model
    print(markdown({label: report["models"][label] for label, _ in models}))
    return 0


if __name__ == "__main__":
    from envace_core import EnvaceError

    try:
        sys.exit(main())
    except (BenchmarkError, EnvaceError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
