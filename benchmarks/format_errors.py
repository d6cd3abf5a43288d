"""Format errors of imagined rollouts with and without constrained decoding, on the same tasks and seeds.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/format_errors.py \
        --dataset .envace/store/datasets/<version> --warm-start .envace/store/warm_starts/<id> \
        [--tasks 24] [--profile cpu-smoke] [--json benchmarks/results/format_errors.json]

For each setting of ``rollout.constrained_decoding`` (off, then on) it builds what the first iteration of
a fresh run builds (`iteration_profile.build_run`: the warm start's weights, the profile's rollout
settings) and rolls out one GRPO group of each of the first ``--tasks`` train tasks (`loop.roll_out`,
``--tasks`` split into the profile's iterations; the seeds are an iteration's, so both settings see the
same tasks with the same seeds). Nothing is trained. Per setting it reports what the training table
reports for an iteration (`loop.rollout_metrics`: parse-error rate per role and overall, terminations)
plus the parse errors by class (`roles.errors`), the engine's refused draws and samples ended for want
of an allowed token (`HFEngine.stats`), ``frac_zero_std`` (the share of (group, role) buckets
whose rewards are all equal, `grpo.estimate_advantages` with the profile's estimator), the success rate,
generated tokens and rollout seconds. Writes ``--json`` after each setting and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)

HERE = Path(__file__).resolve().parent


def error_class(parse_error: str) -> str:
    """The class name a formatted parse error starts with (`roles.errors.format_error`: "Class: message")."""
    return parse_error.split(":", 1)[0].strip() or "unknown"


def measure(args, constrained: bool) -> dict[str, Any]:
    """One setting's rollouts and metrics (module docstring)."""
    from iteration_profile import build_run

    from envace_core.training.grpo import advantage_estimator, estimate_advantages
    from envace_core.training.loop import group_id, roll_out, rollout_metrics
    from envace_core.training.rows import rows_from_group

    over = ",".join(x for x in (args.overrides, f"rollout.constrained_decoding={str(constrained).lower()}") if x)
    cfg, run, _ = build_run(argparse.Namespace(**{**vars(args), "overrides": over}))
    tasks = run.tasks[:args.tasks]
    per = cfg.rollout.tasks_per_iteration
    groups, batches = [], [tasks[k:k + per] for k in range(0, len(tasks), per)]
    stats0, t0 = dict(run.engine.stats), time.perf_counter()
    for it, batch in enumerate(batches):
        got = roll_out(run, batch, it)
        groups += [(group_id(it, k, batch[k]), g) for k, g in enumerate(got)]
        print(f"[format] constrained={constrained}: {len(groups)}/{len(tasks)} groups, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    trajs = [t for _, g in groups for t in g]
    rows = [r for gid, g in groups for r in rows_from_group(gid, g, cfg.reward.fidelity_lambda)]
    name, options = advantage_estimator(cfg.train)
    gens = [g for t in trajs for g in t.generations]
    classes = Counter(f"{g.role.value}: {error_class(g.parse_error)}" for g in gens if g.parse_error)
    finish = Counter(f"{g.role.value}: {g.finish_reason}" for g in gens)
    out = {"constrained_decoding": constrained, "groups": len(groups), "tasks": [t.id for t in tasks],
           **rollout_metrics(trajs), **estimate_advantages(rows, name, **options),
           "parse_errors_by_class": dict(sorted(classes.items())), "finish_reasons": dict(sorted(finish.items())),
           "generations": len(gens),
           **{k: run.engine.stats.get(k, 0) - stats0.get(k, 0)
              for k in ("generated_tokens", "constraint_refusals", "constraint_dead_rows")},
           "rollout_seconds": seconds,
           "examples": [{"role": g.role.value, "error": g.parse_error[:160], "text": g.text[:240]}
                        for g in gens if g.parse_error][:12]}
    del run
    gc.collect()
    return out


def markdown(report: dict[str, Any]) -> str:
    keys = [("parse_error_rate", "parse errors / generation"), ("parse_error_rate/act", "ACT"),
            ("parse_error_rate/rehearse", "REHEARSE"), ("frac_zero_std", "frac_zero_std"),
            ("success_rate", "success (trajectories)"), ("generated_tokens", "generated tokens"),
            ("constraint_refusals", "drawn tokens refused"), ("constraint_dead_rows", "samples ended, no allowed token"),
            ("rollout_seconds", "rollout s")]
    settings = report["settings"]
    lines = ["| | " + " | ".join("constrained" if s["constrained_decoding"] else "unconstrained" for s in settings) + " |",
             "|---|" + "---|" * len(settings)]
    for k, label in keys:
        vals = [s.get(k) for s in settings]
        lines.append(f"| {label} | " + " | ".join("—" if v is None else (f"{v:.3f}" if isinstance(v, float) and k != "rollout_seconds"
                                                  else f"{v:.0f}" if isinstance(v, float) else str(v)) for v in vals) + " |")
    for s in settings:
        lines.append("")
        lines.append(f"{'constrained' if s['constrained_decoding'] else 'unconstrained'}: parse errors by class "
                     f"{s['parse_errors_by_class'] or 'none'}; finish reasons {s['finish_reasons']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from iteration_profile import add_run_arguments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(ap)
    ap.add_argument("--tasks", type=int, default=24, help="the first N train tasks, one GRPO group each")
    ap.add_argument("--settings", default="off,on", help="constrained_decoding settings to run, in order")
    ap.add_argument("--json", default=str(HERE / "results" / "format_errors.json"))
    args = ap.parse_args(argv)
    if args.tasks < 1:
        ap.error("--tasks must be at least 1")
    wanted = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not wanted or any(s not in ("off", "on") for s in wanted):
        ap.error("--settings is a comma list of 'off' and 'on'")

    import torch

    from envace_core.store.files import atomic_write_text

    report: dict[str, Any] = {"run": {"command": " ".join([sys.executable, *sys.argv]),
                                      "date": time.strftime("%Y-%m-%d %H:%M %Z"), "profile": args.profile,
                                      "overrides": args.overrides, "dataset": args.dataset,
                                      "warm_start": args.warm_start, "tasks": args.tasks,
                                      "torch_threads": torch.get_num_threads(), "load_avg_start": list(os.getloadavg())},
                              "settings": []}
    for s in wanted:
        report["settings"].append(measure(args, s == "on"))
        report["run"]["load_avg_end"] = list(os.getloadavg())
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json), json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    from envace_core import EnvaceError

    try:
        sys.exit(main())
    except EnvaceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
