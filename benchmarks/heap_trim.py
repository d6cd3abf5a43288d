"""Peak resident memory of World Rehearsal iterations with and without returning free heap pages to the OS.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/heap_trim.py \
        --dataset .envace/store/datasets/<version> [--warm-start .envace/store/warm_starts/<id>] \
        [--overrides ''] [--iterations 2] [--json benchmarks/results/heap_trim.json]

For each condition a fresh child process builds what the rollout_and_train stage builds for a fresh run
(`iteration_profile.build_run`: the policy, its trainer and engine, from the warm start, or from the fresh
LoRA without ``--warm-start``) and runs `loop.train_iteration` ``--iterations`` times:

- ``trim``: the code as it is: `training.heap.release_free_heap` (``gc.collect`` + glibc ``malloc_trim(0)``)
  after the rollouts and after the update of every iteration;
- ``no-trim``: the same with `release_free_heap` replaced by ``gc.collect`` alone (the behaviour before it).

A thread reads the child's resident set (``/proc/self/statm``) every 0.2 s and keeps the maximum per phase
(rollouts: `loop.roll_out`; update: `PolicyTrainer.update`); the report gives, per iteration, the resident
set when the rollouts start, each phase's peak, and the process's peak (``ru_maxrss``), all in GiB, plus the
iteration's seconds. The parent never imports torch, so a child's ``ru_maxrss`` is its own (Linux carries
an exec'd child's high-water mark over from its parent). Same seeds in both conditions, so the rollouts are
the same up to float rounding; the JSON holds the load average at start and end of each child, and the child's
``TRANSFORMERS_SDPA_FORCE_GQA`` (set, e.g. to 0, it overrides the trainer's grouped key/value heads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONDITIONS = ("no-trim", "trim")


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def child(args) -> None:
    """One condition in this process; prints its JSON record as the last line."""
    import gc
    import resource
    import threading

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import iteration_profile

    from envace_core.training import loop

    if args.child == "no-trim":
        loop.release_free_heap = lambda: gc.collect() and False  # the behaviour before the trim
    _, run, state = iteration_profile.build_run(args)
    phase = {"name": "setup"}
    peaks: dict[str, float] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            r = _rss_gib()
            peaks[phase["name"]] = max(peaks.get(phase["name"], 0.0), r)
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    roll_out, update = loop.roll_out, run.trainer.update
    records = []

    def timed_roll_out(*a, **kw):
        records[-1]["rss_at_rollouts_gib"] = round(_rss_gib(), 3)
        phase["name"] = f"rollouts-{len(records)}"
        try:
            return roll_out(*a, **kw)
        finally:
            phase["name"] = f"between-{len(records)}"

    def timed_update(*a, **kw):
        phase["name"] = f"update-{len(records)}"
        try:
            return update(*a, **kw)
        finally:
            phase["name"] = f"after-{len(records)}"

    loop.roll_out, run.trainer.update = timed_roll_out, timed_update
    load0 = os.getloadavg()[0]
    for i in range(args.iterations):
        records.append({"iteration": i + 1})
        t0 = time.perf_counter()
        rec = loop.train_iteration(run, state)
        records[-1].update(seconds=round(time.perf_counter() - t0, 1), rows_act=rec.get("rows/act"),
                           rows_rehearse=rec.get("rows/rehearse"), train_tokens=rec.get("train/tokens"))
    time.sleep(0.5)
    stop.set()
    for r in records:
        i = r["iteration"]
        r["rollouts_peak_gib"] = round(peaks.get(f"rollouts-{i}", 0.0), 3)
        r["update_peak_gib"] = round(peaks.get(f"update-{i}", 0.0), 3)
    print(json.dumps({"condition": args.child, "iterations": records, "setup_peak_gib": round(peaks.get("setup", 0), 3),
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                      "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
                      # a user's value of transformers' switch overrides the trainer's grouped heads (training.attention)
                      "sdpa_force_gqa": os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")}))


def markdown(report: dict) -> str:
    lines = ["| condition | iteration | s | RSS at rollouts' start | rollouts' peak | update's peak | process peak |",
             "|---|---|---|---|---|---|---|"]
    for cond in CONDITIONS:
        rec = report["conditions"].get(cond)
        if not rec:
            continue
        for r in rec["iterations"]:
            lines.append(f"| {cond} | {r['iteration']} | {r['seconds']:.0f} | {r['rss_at_rollouts_gib']:.2f} | "
                         f"{r['rollouts_peak_gib']:.2f} | {r['update_peak_gib']:.2f} | "
                         f"{rec['peak_rss_gib']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, help="a curated dataset folder, e.g. .envace/store/datasets/<v>")
    ap.add_argument("--warm-start", help="a warm start folder made with this config (default: the fresh LoRA)")
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--json", default=str(HERE / "results" / "heap_trim.json"))
    ap.add_argument("--child", choices=CONDITIONS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error("--iterations must be >= 1")
    if args.child:
        child(args)
        return 0
    conds = [c.strip() for c in args.conditions.split(",") if c.strip()]
    bad = [c for c in conds if c not in CONDITIONS]
    if bad:
        ap.error(f"unknown condition(s) {bad}: choose from {list(CONDITIONS)}")
    out = Path(args.json)
    report = json.loads(out.read_text()) if out.is_file() else {}
    same = {k: report.get(k) for k in ("dataset", "warm_start", "profile", "overrides", "iterations")}
    want = {"dataset": args.dataset, "warm_start": args.warm_start, "profile": args.profile,
            "overrides": args.overrides, "iterations": args.iterations}
    if same != want:  # another setting: start over (a finished condition of this setting is reused: resumable)
        report = {**want, "conditions": {}}
    for cond in conds:
        if cond in report["conditions"]:
            print(f"{cond}: done before, reused from {out}")
            continue
        cmd = [sys.executable, __file__, "--child", cond, "--dataset", args.dataset, "--profile", args.profile,
               "--overrides", args.overrides, "--iterations", str(args.iterations)]
        if args.warm_start:
            cmd += ["--warm-start", args.warm_start]
        print(f"{cond}: running {args.iterations} iteration(s) in a fresh process ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            print(f"{cond}: the child failed (exit {proc.returncode}); nothing recorded for it", file=sys.stderr)
            return 1
        report["conditions"][cond] = json.loads(proc.stdout.strip().splitlines()[-1])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
