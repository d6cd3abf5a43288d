"""Learning signal of a finished run's rollouts under other REHEARSE fidelity weights λ, without generating anything.

    .venv/bin/python benchmarks/reward_signal.py --run .envace/store/runs/<run_id> [--lambdas 0,0.25,0.5,1]
        [--estimator role_wise] [--json benchmarks/results/reward_signal.json]

The train stage stores every iteration's scored trajectories (`<store>/runs/<run_id>/rollouts/iteration-NNNN.jsonl`,
`training.loop`: each trajectory's reward R, its steps with the rehearsed and the replayed real observation and
their fidelity F). λ only changes the REHEARSE rows' rewards (R + λ·F_k, METHOD.md §2; `rewards.row_rewards`),
so for fixed rollouts the rows, their rewards and the GRPO buckets under any λ are computed exactly as the loop
computes them (`rows.rows_from_group`, `grpo.estimate_advantages` with --estimator, any registered advantage
estimator: role-wise baseline by default, METHOD.md §3). Later iterations of a run trained with another λ would roll out differently (another update):
this measures the reward's signal on the same trajectories, not a training run.

Groups: consecutive trajectories of one task whose `group_index` counts up from 0 (the loop writes groups in
order, G trajectories each). Reported per iteration and λ: frac_zero_std (share of the estimator's baseline buckets — (group,
role) for role_wise and std_scaled, the group for shared_baseline — whose valid rewards are all equal: no
advantage), buckets (the estimator's own count, ``baseline_buckets``), valid rows per role, and the REHEARSE rows' reward spread.
Writes --json (summary per λ, every iteration's figures, the run and the command) and prints a table.

Raises SystemExit (argparse), before any computation, for a --run without rollouts or with a rollouts file that is
not one iteration's whole groups (`load_groups`), a bad --lambdas or --estimator, or a --json that cannot be written
or lies inside --run.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DEFAULT_JSON = os.path.join(HERE, "results", "reward_signal.json")


def estimator_names() -> list[str]:
    """The registered advantage estimators (`training.grpo.ADVANTAGE_ESTIMATORS`)."""
    from envace_core.training.grpo import ADVANTAGE_ESTIMATORS

    return sorted(ADVANTAGE_ESTIMATORS)


def parse_lambdas(text: str) -> list[float]:
    """``0,0.25,0.5`` -> [0.0, 0.25, 0.5]; ValueError unless every item is a finite number ≥ 0, none twice."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("is empty; give e.g. 0,0.5")
    out = []
    for t in items:
        try:
            v = float(t)
        except ValueError:
            raise ValueError(f"{t!r} is not a number") from None
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{t!r}: λ must be a finite number ≥ 0 (reward.fidelity_lambda's range)")
        out.append(v + 0.0)  # -0.0 -> 0.0
    if len(set(out)) != len(out):
        raise ValueError(f"lists a value more than once: {text!r}")
    return out


def load_groups(path: str):
    """The GRPO groups of one stored iteration, in order: lists of `Trajectory` (see module docstring).

    Raises ValueError naming the file (and line) for a file that cannot be read as UTF-8 text, a line that is
    not a stored trajectory, no trajectory at all, or groups that are not G ≥ 2 trajectories each with
    group_index 0..G-1 (a cut or edited file: its buckets would not be the run's)."""
    from envace_core.types import Trajectory

    groups: list[list] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as text ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            t = Trajectory.model_validate_json(line)
        except ValueError as e:
            raise ValueError(f"{path}, line {n}: not a stored trajectory ({str(e).splitlines()[0]})") from None
        if groups and t.group_index > 0 and groups[-1][-1].task_id == t.task_id \
                and groups[-1][-1].group_index == t.group_index - 1:
            groups[-1].append(t)
        elif t.group_index != 0:
            raise ValueError(f"{path}, line {n}: group_index {t.group_index} of task {t.task_id} does not follow "
                             "its group's previous trajectory (groups are written in order, index 0..G-1)")
        else:
            groups.append([t])
    if not groups:
        raise ValueError(f"{path}: holds no trajectory")
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1 or sizes[0] < 2:
        raise ValueError(f"{path}: groups of {sizes} trajectories; a run's groups all hold G ≥ 2 "
                         "(rollout.group_size): the file is cut or not one iteration's rollouts")
    return groups


def iteration_signal(groups, lam: float, estimator: str) -> dict:
    """frac_zero_std and row counts of one iteration's `groups` with REHEARSE rows rewarded R + lam·F; "buckets" is
    None for an estimator that does not report its ``baseline_buckets`` (every `grpo.baseline_advantages` one does)."""
    from envace_core.training.grpo import estimate_advantages
    from envace_core.training.rows import rows_from_group

    rows = [r for k, g in enumerate(groups) for r in rows_from_group(f"{k}/{g[0].task_id}", g, lam)]
    stats = estimate_advantages(rows, estimator)
    valid = [r for r in rows if r.valid]
    rehearse = [float(r.reward) for r in valid if r.role == "rehearse"]
    return {"frac_zero_std": stats["frac_zero_std"], "buckets": stats.get("baseline_buckets"), "groups": len(groups),
            "valid_rows": {role: sum(r.role == role for r in valid) for role in sorted({r.role for r in rows})},
            "masked_rows": len(rows) - len(valid),
            "rehearse_reward_range": [min(rehearse), max(rehearse)] if rehearse else None}


def _count(n: int | None) -> str:
    return "n/a" if n is None else str(n)


def main(argv=None) -> int:
    from decode_ab import json_argument, write_report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a run folder holding rollouts/iteration-*.jsonl")
    ap.add_argument("--lambdas", default="0,0.25,0.5,1", help="REHEARSE fidelity weights to compare")
    ap.add_argument("--estimator", default="role_wise", help="a registered advantage estimator (default role_wise)")
    ap.add_argument("--json", default=None, help=f"report path (default {os.path.relpath(DEFAULT_JSON)})")
    args = ap.parse_args(argv)
    try:
        lambdas = parse_lambdas(args.lambdas)
    except ValueError as e:
        ap.error(f"--lambdas {e}")
    run_dir = os.path.abspath(os.path.expanduser(args.run))
    try:
        out_json = json_argument(args.json, DEFAULT_JSON)
    except ValueError as e:
        ap.error(f"--json: {e}")
    if os.path.commonpath([out_json, run_dir]) == run_dir:
        ap.error(f"--json {args.json} is inside --run {args.run}: the report would overwrite or add to the run's "
                 "stored data; write it elsewhere")
    files = sorted(glob.glob(os.path.join(glob.escape(run_dir), "rollouts", "iteration-*.jsonl")))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        ap.error(f"--run {args.run}: no rollouts/iteration-*.jsonl files there (a run folder of the store, "
                 "e.g. .envace/store/runs/<run_id>)")
    if args.estimator not in estimator_names():
        ap.error(f"--estimator {args.estimator!r}: registered: {', '.join(estimator_names())}")
    try:
        iterations = {os.path.basename(f): load_groups(f) for f in files}
    except ValueError as e:
        ap.error(f"--run: {e}")
    runs = {name: {str(lam): iteration_signal(groups, lam, args.estimator) for lam in lambdas}
            for name, groups in iterations.items()}
    summary = {str(lam): {"frac_zero_std": [runs[n][str(lam)]["frac_zero_std"] for n in runs],
                          "max_frac_zero_std": max(runs[n][str(lam)]["frac_zero_std"] for n in runs)}
               for lam in lambdas}
    head = "| iteration | " + " | ".join(f"λ = {lam:g}" for lam in lambdas) + " |"
    lines = [head, "|" + "---|" * (len(lambdas) + 1)]
    for n in runs:
        cells = [f"{runs[n][str(lam)]['frac_zero_std']:.2f} ({_count(runs[n][str(lam)]['buckets'])} buckets)"
                 for lam in lambdas]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    write_report(out_json, summary, runs, {"run": run_dir,
                                           "estimator": args.estimator, "lambdas": lambdas},
                 "frac_zero_std per iteration\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
