"""Private Rehearsal's effect pooled over sampling seeds: several held-out reports of one set-up, one estimate.

    .venv/bin/python benchmarks/rehearsal_effect_pool.py REPORT.json [REPORT.json ...] --key LABEL
        [--json benchmarks/results/rehearsal_effect.json] [--results-md benchmarks/RESULTS.md] [--no-append]

Each REPORT is the JSON that ``rehearsal_effect.py --heldout N`` writes (`rehearsal_effect_heldout`): one
sampling seed (``--seed``), a model × condition grid, per task the committed trajectory's tau2 success. A
single report's paired CI is a CI over tasks for *one draw* of the policy's sampling (temperature 1): a
rerun at another seed moves individual tasks either way, so one draw can put the CI above 0 where the next
does not. This script pools the draws.

Reports are pooled only when they measure the same thing: the same held-out task file and task ids, dataset,
synthesis seed, levels, protocol, profile, ``--overrides`` and model references (`SAME_RUN`); any difference
raises `BenchmarkError` naming the field and both files. Two reports may hold the same model × condition ×
seed (``none`` runs beside every condition): their per-task outcomes must then be equal, else the reports
contradict each other (error). A cell that did not finish (``complete`` false) is left out and listed.

Per model × condition, over the seeds S at which both the condition and ``none`` finished (Gelman & Hill
2007 §8.3: seeds are replicates within a task, tasks the sampled units):
- success: each task's success averaged over S, then the mean over tasks with a 95 % percentile bootstrap CI
  over tasks (`stats.mean_ci`, Efron & Tibshirani 1993 ch. 13);
- paired_vs_none: each task's (condition − none) averaged over S, mean with the same bootstrap over tasks
  (Dror et al. 2018 §3.2, as `stages.compare`); seed_ci: a Student-t 95 % interval over the S per-seed paired
  means (`learning.t_interval`; only with ≥ 2 seeds, wide for few);
- per_seed: each seed's success, paired mean, gained / lost tasks and seconds per episode;
- seconds_per_episode: the mean over the seeds' timed episodes; rehearsals made / rejected and real calls in
  rehearsal summed over seeds (the last must be 0: METHOD.md §4, rehearsal never touches the real environment).

Writes the pooled block under ``--key`` into ``--json`` (other keys kept; the key is replaced when it exists) and
appends a table to RESULTS.md unless ``--no-append``. Bad arguments: a one-line error, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)
from envace_core import EnvaceError
from rehearsal_effect import BenchmarkError, append_section

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "rehearsal_effect.json"
SAME_RUN = ("heldout_file", "task_ids", "dataset", "synth_seed", "levels", "protocol", "profile", "overrides")


def load_report(path: str) -> dict[str, Any]:
    """One held-out report; raises `BenchmarkError` for a missing, unreadable or non-JSON file, or one that is
    not a `rehearsal_effect_heldout` report (no run block with a seed and task ids, no model cells)."""
    p = Path(path)
    if not p.is_file():
        raise BenchmarkError(f"{path}: no such file")
    try:
        rep = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchmarkError(f"{path}: not a readable JSON report ({type(e).__name__}: {e})") from None
    run = rep.get("run") if isinstance(rep, dict) else None
    if not isinstance(run, dict) or not isinstance(run.get("seed"), int) or not isinstance(run.get("task_ids"), list):
        raise BenchmarkError(f"{path}: not a held-out report of rehearsal_effect.py --heldout (its 'run' block with "
                             "'seed' and 'task_ids' is missing)")
    models = {k: v for k, v in rep.items() if k != "run"}
    if not models or not all(isinstance(v, dict) and all(isinstance(c, dict) and "outcomes" in c for c in v.values())
                             for v in models.values()):
        raise BenchmarkError(f"{path}: no model × condition cells with per-task outcomes")
    return rep


def check_same_run(reports: dict[str, dict[str, Any]]) -> None:
    """Raises `BenchmarkError` unless every report shares `SAME_RUN` and gives each common model label the same
    reference (`reports`: {path: report})."""
    (first, ref), *rest = reports.items()
    for path, rep in rest:
        for key in SAME_RUN:
            if rep["run"].get(key) != ref["run"].get(key):
                raise BenchmarkError(f"{path} and {first} differ in run.{key} ({rep['run'].get(key)!r:.120} vs "
                                     f"{ref['run'].get(key)!r:.120}): they measure different things")
        mine, theirs = rep["run"].get("models") or {}, ref["run"].get("models") or {}
        for label in set(mine) & set(theirs):
            if (mine[label] or {}).get("ref") != (theirs[label] or {}).get("ref"):
                raise BenchmarkError(f"{path} and {first} give model {label!r} different references "
                                     f"({mine[label].get('ref')!r} vs {theirs[label].get('ref')!r})")


def collect(reports: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, dict[int, dict]]], list[str]]:
    """{model: {condition: {seed: cell}}} of the finished cells, and the left-out ones ("file: model condition").
    Raises `BenchmarkError` when two reports hold one model × condition × seed with other outcomes."""
    cells: dict[str, dict[str, dict[int, dict]]] = {}
    src: dict[tuple[str, str, int], str] = {}
    left: list[str] = []
    for path, rep in reports.items():
        seed = rep["run"]["seed"]
        for model, conds in rep.items():
            if model == "run":
                continue
            for cond, c in conds.items():
                if not c.get("complete"):
                    left.append(f"{path}: {model} {cond} (seed {seed}, {c.get('n_run', 0)} tasks run, not complete)")
                    continue
                key = (model, cond, seed)
                have = cells.setdefault(model, {}).setdefault(cond, {})
                if seed in have:
                    if have[seed]["outcomes"] != c["outcomes"]:
                        raise BenchmarkError(f"{path} and {src[key]} both hold {model} {cond} at seed {seed} with "
                                             "other per-task outcomes: they cannot both be that run")
                    continue
                have[seed], src[key] = c, path
    return cells, left


def pooled_cell(by_seed: dict[int, dict], none_by_seed: dict[int, dict], n_boot: int) -> dict[str, Any] | None:
    """The pooled entry of one model × condition (module docstring), over the seeds both it and ``none`` have;
    None when there is no such seed. Raises `BenchmarkError` when a seed's condition and ``none`` scored
    different tasks."""
    from envace_core.evaluation.stats import mean_ci
    from learning import t_interval

    seeds = sorted(set(by_seed) & set(none_by_seed))
    if not seeds:
        return None
    tasks = sorted(by_seed[seeds[0]]["outcomes"])
    for s in seeds:
        for name, c in (("condition", by_seed[s]), ("none", none_by_seed[s])):
            if sorted(c["outcomes"]) != tasks:
                raise BenchmarkError(f"seed {s}: the {name} cell scored other tasks than seed {seeds[0]}'s "
                                     "condition: pool only complete runs of one task set")
    own = [statistics.fmean(by_seed[s]["outcomes"][t] for s in seeds) for t in tasks]
    diff = [statistics.fmean(by_seed[s]["outcomes"][t] - none_by_seed[s]["outcomes"][t] for s in seeds) for t in tasks]

    def ci(xs: list[float]) -> dict[str, Any]:
        m = mean_ci(xs, n_boot, 0)
        return {"mean": m["mean"], "ci_low": m["ci95"][0], "ci_high": m["ci95"][1]}

    per_seed = {}
    for s in seeds:
        o, b = by_seed[s]["outcomes"], none_by_seed[s]["outcomes"]
        per_seed[str(s)] = {"success": statistics.fmean(o.values()),
                            "paired_vs_none": statistics.fmean(o[t] - b[t] for t in tasks),
                            "gained": sum(1 for t in tasks if o[t] > b[t]), "lost": sum(1 for t in tasks if o[t] < b[t]),
                            "seconds_per_episode": by_seed[s].get("seconds_per_episode")}
    paired_means = [v["paired_vs_none"] for v in per_seed.values()]
    timed = [(by_seed[s].get("seconds_per_episode"), by_seed[s].get("seconds_timed_episodes") or 0) for s in seeds]
    n_timed = sum(k for sec, k in timed if sec is not None)
    total = lambda key: sum(int(by_seed[s].get(key) or 0) for s in seeds)
    return {"success": ci(own), "paired_vs_none": {**ci(diff), "n": len(tasks)},
            "seed_ci": [float(x) for x in t_interval(paired_means)] if len(seeds) >= 2 else None,
            "seeds": seeds, "n": len(tasks), "n_episodes": len(tasks) * len(seeds),
            "seconds_per_episode": (sum(sec * k for sec, k in timed if sec is not None) / n_timed) if n_timed else None,
            "rehearsals_made": total("rehearsals_made"), "rehearsals_rejected": total("rehearsals_rejected"),
            "real_calls_in_rehearsal": total("real_calls_in_rehearsal"), "per_seed": per_seed}


def pool(reports: dict[str, dict[str, Any]], n_boot: int = 2000) -> dict[str, Any]:
    """The pooled block {"run": {...}, <model>: {<condition>: `pooled_cell`}} of `reports` ({path: report});
    raises `BenchmarkError` (`check_same_run`, `collect`, `pooled_cell`), also when no condition has a seed
    shared with ``none``."""
    check_same_run(reports)
    cells, left = collect(reports)
    out: dict[str, Any] = {}
    for model, conds in cells.items():
        none = conds.get("none", {})
        block = {c: p for c, by_seed in conds.items() if (p := pooled_cell(by_seed, none, n_boot)) is not None}
        if block:
            out[model] = block
    if not any(c != "none" for b in out.values() for c in b):
        raise BenchmarkError("no condition besides none finished at a seed where none finished too: nothing to pool")
    first = next(iter(reports.values()))["run"]
    out["run"] = {**{k: first.get(k) for k in SAME_RUN if k != "task_ids"}, "n_tasks": len(first["task_ids"]),
                  "models": first.get("models"), "reports": list(reports), "left_out": left,
                  "code": {p: r["run"].get("code") for p, r in reports.items()},
                  "date": time.strftime("%Y-%m-%d %H:%M %Z"), "n_boot": n_boot,
                  "ci": f"95% percentile bootstrap over tasks ({n_boot} resamples), each task averaged over the seeds; "
                        "seed_ci: Student-t over the seeds' paired means"}
    return out


def markdown(block: dict[str, Any]) -> str:
    """One row per model × condition: seeds, episodes, success [CI], Δ vs none [CI], t-CI over seeds, each
    seed's Δ (gained/lost), rehearsals (rejected), real calls in rehearsal, seconds per episode."""
    f = lambda s, fmt: f"{fmt.format(s['mean'])} [{fmt.format(s['ci_low'])}, {fmt.format(s['ci_high'])}]"
    rows = ["| model | condition | seeds | tasks × seeds | success [95% CI] | Δ vs none [95% CI] | Δ t-CI over seeds "
            "| Δ per seed (gained/lost) | rehearsals (rejected) | real calls in rehearsal | s / episode |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, conds in block.items():
        if model == "run":
            continue
        for name, c in conds.items():
            none = name == "none"
            tci = "—" if none or not c["seed_ci"] else f"[{c['seed_ci'][0]:+.3f}, {c['seed_ci'][1]:+.3f}]"
            per = "—" if none else ", ".join(f"{s}: {v['paired_vs_none']:+.3f} ({v['gained']}/{v['lost']})"
                                             for s, v in c["per_seed"].items())
            sec = "n/a" if c["seconds_per_episode"] is None else f"{c['seconds_per_episode']:.1f}"
            rows.append(f"| {model} | {name} | {','.join(map(str, c['seeds']))} | {c['n']} × {len(c['seeds'])} | "
                        f"{f(c['success'], '{:.3f}')} | {'—' if none else f(c['paired_vs_none'], '{:+.3f}')} | {tci} | "
                        f"{per} | {c['rehearsals_made']} ({c['rehearsals_rejected']}) | {c['real_calls_in_rehearsal']} "
                        f"| {sec} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(prog="rehearsal_effect_pool.py", description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="held-out reports of rehearsal_effect.py --heldout (one per seed)")
    ap.add_argument("--key", required=True, help="the pooled block's key in --json (e.g. actpit_seeds012)")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="report to add the block to (default: %(default)s)")
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--no-append", action="store_true")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """--key (non-empty, not ``run``), --n-boot (>= 100), --json and --results-md (`check_results_md`), and no
    report named twice or as --json. Raises `BenchmarkError`."""
    from rehearsal_effect import check_results_md

    if not args.key.strip() or args.key.strip() != args.key or args.key in ("run", "runs_added"):
        raise BenchmarkError(f"--key {args.key!r}: give a non-empty label without surrounding spaces, not "
                             "'run' or 'runs_added' (the report's own blocks)")
    if args.n_boot < 100:
        raise BenchmarkError(f"--n-boot must be >= 100, got {args.n_boot}")
    check_results_md(args)
    paths = [Path(p).expanduser().resolve() for p in args.reports]
    if len(set(paths)) != len(paths):
        raise BenchmarkError("a report is named twice: each seed's report once")
    if Path(args.json).expanduser().resolve() in paths:
        raise BenchmarkError(f"--json {args.json} is one of the reports: write the pooled block elsewhere")


def write_block(path: Path, key: str, block: dict[str, Any]) -> bool:
    """Puts `block` under `key` in the JSON at `path` (made when missing; other keys kept); True when `key` was
    replaced. Raises `BenchmarkError` for an existing file that is not a JSON object."""
    from envace_core.store.files import atomic_write_text

    old: dict[str, Any] = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BenchmarkError(f"--json {path}: exists but is not readable JSON ({type(e).__name__}); "
                                 "it is left as it is") from None
        if not isinstance(old, dict):
            raise BenchmarkError(f"--json {path}: exists but is not a JSON object; it is left as it is")
    replaced = key in old
    old[key] = block
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(old, indent=2, sort_keys=True, default=str))
    return replaced


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
        block = pool({p: load_report(p) for p in args.reports}, args.n_boot)
        replaced = write_block(Path(args.json), args.key, block)
    except EnvaceError as e:
        print(f"{ap.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    table = markdown(block)
    print(table)
    for why in block["run"]["left_out"]:
        print(f"left out: {why}")
    print(f"{'replaced' if replaced else 'wrote'} {args.key!r} in {args.json}")
    if not args.no_append:
        r = block["run"]
        append_section(Path(args.results_md), "\n".join([
            f"## Private Rehearsal effect pooled over seeds ({args.key}), {r['date']}", "",
            f"`{' '.join(['benchmarks/rehearsal_effect_pool.py', *args.reports, '--key', args.key])}`: "
            f"{r['n_tasks']} held-out tasks ({r['heldout_file']}), protocol {r['protocol']}, overrides "
            f"{r['overrides']!r}. CIs: {r['ci']}.", "", table]))
        print(f"appended to {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
