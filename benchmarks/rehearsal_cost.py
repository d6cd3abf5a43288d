"""Latency cost of Private Rehearsal at test time: one task's episode without rehearsal vs with it.

    .venv/bin/python benchmarks/rehearsal_cost.py [--tasks airline/2,airline/6,retail/5] [--profile cpu-smoke]

The policy (`stages.load_policy`: the bundled SmolLM2-135M on cpu-smoke) and its HFEngine are loaded
once; every condition then runs the same tasks with the same max turns (`eval.max_turns`), greedy
committed execution (`eval.temperature`), the profile's verifier and memory budget, via
`rehearsal.inspect.rehearse_task` (the function behind `envace rehearse`). The time per episode covers
rehearsal + committed execution (not scoring, not model loading). One untimed warm-up episode first.
Each cell is the minimum over --repeats interleaved episodes (shared machines drift).
Prints seconds per task and condition, the mean, and the ratio of the mean to no rehearsal (issue goal:
parallel N=4 <= 2.5x no rehearsal).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)

CONDITIONS = [("no rehearsal", "none", 0), ("parallel N=2", "parallel", 2),
              ("parallel N=4", "parallel", 4), ("sequential N=2", "sequential", 2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="airline/2,airline/6,retail/5")
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--repeats", type=int, default=2, help="episodes per task and condition; the minimum counts")
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from envace_core.config import load_config
    from envace_core.engines.hf import HFEngine
    from envace_core.rehearsal.inspect import rehearse_task
    from envace_core.training.policy import load_policy

    cfg = load_config(args.profile, args.overrides)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    model, tok, _ = load_policy(cfg)
    engine = HFEngine(model, tok, compute_dtype=cfg.model.compute_dtype)
    print(f"model {cfg.model.ref} ({cfg.model.compute_dtype}), torch threads {torch.get_num_threads()}, "
          f"max_turns {cfg.eval.max_turns}, commit temperature {cfg.eval.temperature}, "
          f"rehearsal temperature {cfg.rehearsal.temperature}, verifier {cfg.rehearsal.verifier}, "
          f"load average {os.getloadavg()[0]:.2f}")
    rehearse_task(cfg, tasks[0], "parallel", 2, engine=engine)  # warm-up, untimed

    secs: dict[str, dict[str, float]] = {}
    info: dict[str, dict[str, str]] = {}
    # Interleaved (repeat > task > condition) so that load drift on a shared machine hits every
    # condition alike; each cell is the minimum over the repeats (the least-disturbed episode).
    for rep in range(args.repeats):
        for tid in tasks:
            for name, mode, n in CONDITIONS:
                r = rehearse_task(cfg, tid, mode, n, engine=engine)
                t = r["seconds"]["rehearse_and_commit"]
                secs.setdefault(name, {})[tid] = min(t, secs.get(name, {}).get(tid, float("inf")))
                calls = sum("call" in s for s in r["committed"]["steps"])
                info.setdefault(name, {})[tid] = (f"{r['n_rehearsals']} reh, {calls} real calls, "
                                                  f"{r['committed']['termination']}, reward {r['reward']}")
                print(f"  rep {rep + 1} {name:15s} {tid:10s} {t:6.2f}s  ({info[name][tid]})", flush=True)

    base = statistics.fmean(secs["no rehearsal"].values())
    table = Table(title=f"Private Rehearsal latency per episode, seconds ({cfg.profile}, {cfg.model.ref})")
    table.add_column("condition")
    for tid in tasks:
        table.add_column(tid, justify="right")
    table.add_column("mean", justify="right")
    table.add_column("× no rehearsal", justify="right")
    for name, _, _ in CONDITIONS:
        mean = statistics.fmean(secs[name].values())
        table.add_row(name, *[f"{secs[name][t]:.2f}" for t in tasks], f"{mean:.2f}", f"{mean / base:.2f}")
    Console(width=120).print(table)
    ratio = statistics.fmean(secs["parallel N=4"].values()) / base
    print(f"parallel N=4 / no rehearsal = {ratio:.2f}x (goal <= 2.5x: {'MET' if ratio <= 2.5 else 'NOT MET'}); "
          f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
