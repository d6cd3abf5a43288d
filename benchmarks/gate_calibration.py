"""Where the rehearsal-quality gate's thresholds come from: the validate stage's metrics for the base
model, the warm start and a trained policy, on exactly the transitions `validate` gates.

Usage:
    .venv/bin/python benchmarks/gate_calibration.py --warm-start DIR --trained DIR \
        [--profile cpu-smoke] [--overrides K=V,...] [--out benchmarks/results/gate_calibration.json]

DIR: a LoRA adapter folder, e.g. ``.envace/store/warm_starts/<id>/adapter`` and
``.envace/store/runs/<run id>/checkpoint/adapter`` (or the registered version's ``artifacts/adapter``)
after ``make train``. The profile's dataset is curated into a
scratch store (``.envace/bench/gate_calibration``), so the user's store is not touched; the held-out
transitions are `stages.validate.validation_transitions` (validate.max_transitions of the test split's
gold calls and their wrong-call errors, with validate.fit_budget only those whose real result fits
REHEARSE's budget), prompts and budgets those of `stages.validate.rehearse_rows`, greedy.

Per model: every metric of `evaluation.fidelity.aggregate` over all transitions, {mean, ci_low,
ci_high, n} (95 % bootstrap over transitions), and per tool. Proposed thresholds: the warm start's
95 % lower bound per gated metric, rounded down to 0.05 (`proposed_thresholds`): a policy whose
rehearser fell clearly below the warm start it was trained from fails the gate; one within the warm
start's sampling noise passes. The JSON says whether each model passes the validate stage's own gate
(`stages.gates.rehearsal_gate` on its per-transition rows) with them, and which expectations failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# gated metric of `evaluation.fidelity.aggregate` -> the ValidateConfig field it sets
GATED = {"json_valid": "min_json_validity", "error_match": "min_error_accuracy",
         "key_f1": "min_key_f1", "value_f1": "min_value_f1"}


def proposed_thresholds(warm: dict[str, dict[str, float]]) -> dict[str, float]:
    """validate.<field> -> the warm start's 95 % lower bound of its metric, rounded down to 0.05
    (0 where the metric was not measured)."""
    out = {}
    for metric, field in GATED.items():
        lo = (warm.get(metric) or {}).get("ci_low")
        out[field] = 0.0 if lo is None else math.floor(round(lo / 0.05, 6)) * 0.05
    return out


def measure(cfg, dataset: dict[str, Any], adapter: str | None, params) -> tuple[dict[str, Any], list[dict]]:
    """(aggregate metrics + per tool / kind + seconds + transition ids, the validate stage's
    per-transition rows) of the policy `adapter` (None: the base model) on `validate`'s transitions;
    `params`: `stages.validate.validation_params(cfg, dataset)`."""
    from envace_core.evaluation.fidelity import PairScore, aggregate
    from envace_core.stages.validate import rehearse_rows, validation_transitions
    from envace_core.training.policy import load_policy, policy_engine

    t0 = time.perf_counter()
    model, tok, _ = load_policy(cfg, adapter)
    engine = policy_engine(cfg, model, tok)
    trans = validation_transitions(cfg, dataset, tok, params)
    rows = rehearse_rows(cfg, engine, trans, params)
    agg = aggregate([PairScore(**{f: r[f] for f in PairScore.__dataclass_fields__}) for r in rows])
    return ({"all": agg["all"], "per_tool": agg["per_tool"], "per_kind": agg["per_kind"],
             "seconds": time.perf_counter() - t0, "ids": [r["id"] for r in rows]}, rows)


def table(res: dict[str, Any]) -> str:
    lines = ["| model | n | JSON validity | error-vs-success | key F1 | value F1 |", "|---|---|---|---|---|---|"]
    for name, m in res["models"].items():
        a = m["all"]
        cell = [f"{a[k]['mean']:.3f} [{a[k]['ci_low']:.2f}, {a[k]['ci_high']:.2f}]" for k in GATED]
        lines.append(f"| {name} | {a['json_valid']['n']} | " + " | ".join(cell) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-start", required=True)
    ap.add_argument("--trained", required=True)
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gate_calibration.json"))
    a = ap.parse_args()
    from envace_core.config import ConfigError, load_config
    from envace_core.stages.curate import curate
    from envace_core.stages.gates import rehearsal_gate
    from envace_core.stages.validate import validation_params

    for d in (a.warm_start, a.trained):
        if not (Path(d) / "adapter_config.json").is_file():
            sys.exit(f"gate_calibration: {d} is not a LoRA adapter folder (no adapter_config.json)")
    store = ROOT / ".envace/bench/gate_calibration"
    over = ",".join(x for x in (a.overrides, f"store.root={store}", 'data.dvc="off"') if x)
    try:
        cfg = load_config(a.profile, over)
    except ConfigError as e:
        sys.exit(f"gate_calibration: --profile {a.profile!r} / --overrides: {e}")
    t0 = time.perf_counter()
    dataset = curate(cfg)
    params = validation_params(cfg, dataset)
    models, rows = {}, {}
    for name, adapter in (("base", None), ("warm_start", a.warm_start), ("trained", a.trained)):
        models[name], rows[name] = measure(cfg, dataset, adapter, params)
        print(f"[gate_calibration] {name}: " + json.dumps({k: round(v["mean"], 3) for k, v in models[name]["all"].items()
                                                          if v["mean"] is not None}), flush=True)
    th = proposed_thresholds(models["warm_start"]["all"])
    # each model's rows through the validate stage's own gate, with the proposed floors in place of
    # the profile's (the profile's max_parse_error_rate and min_fidelity stay)
    gated = cfg.validate_.model_copy(update=th)
    gates = {n: rehearsal_gate(r, gated) for n, r in rows.items()}
    res = {"profile": a.profile, "overrides": a.overrides,
           "validate": cfg.validate_.model_dump(), "warm_start": a.warm_start, "trained": a.trained,
           "models": models, "proposed_thresholds": th,
           "passes": {n: {"success": g.success, "failed": g.failed} for n, g in gates.items()},
           "seconds": time.perf_counter() - t0, "load_avg": os.getloadavg()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(table(res))
    print("proposed thresholds:", json.dumps(th), "; passes:", json.dumps({n: g.success for n, g in gates.items()}))


if __name__ == "__main__":
    main()
