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

Every report is checked before anything is pooled (`check_report`: an integer seed, a reference per model, per-task
outcomes of 0 or 1, counts and seconds of the right kind); a real call during rehearsal is printed as a warning.
Writes the pooled block under ``--key`` into ``--json`` (other keys kept; a key is replaced only when it holds an
earlier pooled block, `check_target`; a held-out report that takes one stays poolable) and appends a table to
RESULTS.md unless ``--no-append``. Bad arguments or reports: a one-line error, exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import math
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
POOLED_KIND = "rehearsal_effect_pool"  # run.kind of a pooled block: the only kind --key may replace
SAME_RUN = ("heldout_file", "task_ids", "dataset", "synth_seed", "levels", "protocol", "profile", "overrides")


def load_report(path: str) -> dict[str, Any]:
    """One held-out report, checked (`check_report`); raises `BenchmarkError` for a missing, unreadable or non-JSON
    file, or one that is not a `rehearsal_effect_heldout` report."""
    p = Path(path)
    if p.is_dir():
        raise BenchmarkError(f"{path}: a folder; give a report file")
    if not p.is_file():
        raise BenchmarkError(f"{path}: no such file")
    try:
        rep = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchmarkError(f"{path}: not a readable JSON report ({type(e).__name__}: {e})") from None
    check_report(path, rep)
    return rep


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_heldout_report(rep: Any) -> bool:
    """Whether `rep` looks like one run's held-out report (a run block with a seed and task ids), whatever else."""
    run = rep.get("run") if isinstance(rep, dict) else None
    return isinstance(run, dict) and "seed" in run and "task_ids" in run


def is_pooled_block(block: Any) -> bool:
    """Whether `block` is one this script wrote (run.kind `POOLED_KIND`)."""
    return isinstance(block, dict) and isinstance(block.get("run"), dict) and block["run"].get("kind") == POOLED_KIND


def report_models(rep: dict[str, Any]) -> dict[str, Any]:
    """The model blocks of a held-out report: every top-level key but ``run`` and pooled blocks written into it."""
    return {k: v for k, v in rep.items() if k != "run" and not is_pooled_block(v)}


def check_report(path: str, rep: Any) -> None:
    """Raises `BenchmarkError` naming the file and field unless `rep` is a held-out report this script can pool: a
    run block with an integer seed, the task ids and a reference per model label (``run.models``); per model and
    condition a cell with ``complete`` (bool), ``outcomes`` ({task id: 0 or 1}, tau2's is_successful), counts
    (rehearsals made / rejected, real calls in rehearsal: integers ≥ 0) and seconds (a finite number ≥ 0 or null)."""
    if not is_heldout_report(rep):
        raise BenchmarkError(f"{path}: not a held-out report of rehearsal_effect.py --heldout (its 'run' block with "
                             "'seed' and 'task_ids' is missing)")
    run = rep["run"]
    if not _is_int(run["seed"]):
        raise BenchmarkError(f"{path}: run.seed must be an integer (the run's sampling seed), got {run['seed']!r}")
    if not isinstance(run["task_ids"], list) or not all(isinstance(t, str) for t in run["task_ids"]):
        raise BenchmarkError(f"{path}: run.task_ids must be a list of task ids")
    models = report_models(rep)
    if not models:
        raise BenchmarkError(f"{path}: no model × condition cells with per-task outcomes")
    refs = run.get("models")
    for model, conds in models.items():
        where = f"{path}: model {model!r}"
        entry = refs.get(model) if isinstance(refs, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("ref"), str) or not entry["ref"]:
            raise BenchmarkError(f"{where} has no reference in run.models (needed to pool only the same model)")
        if not isinstance(conds, dict) or not conds:
            raise BenchmarkError(f"{where}: no condition cells")
        for cond, c in conds.items():
            here = f"{where} condition {cond!r}"
            if not isinstance(c, dict) or not isinstance(c.get("outcomes"), dict):
                raise BenchmarkError(f"{here}: no per-task outcomes")
            if not isinstance(c.get("complete"), bool):
                raise BenchmarkError(f"{here}: 'complete' must be true or false, got {c.get('complete')!r}")
            bad = [(t, v) for t, v in c["outcomes"].items() if not _is_number(v) or v not in (0, 1)]
            if bad:
                raise BenchmarkError(f"{here}: outcome {bad[0][1]!r} of task {bad[0][0]!r} is not 0 or 1 "
                                     f"(tau2's is_successful){f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")
            for key in ("rehearsals_made", "rehearsals_rejected", "real_calls_in_rehearsal", "seconds_timed_episodes"):
                if key in c and not (_is_int(c[key]) and c[key] >= 0):
                    raise BenchmarkError(f"{here}: {key} must be an integer >= 0, got {c[key]!r}")
            sec = c.get("seconds_per_episode")
            if sec is not None and not (_is_number(sec) and sec >= 0):
                raise BenchmarkError(f"{here}: seconds_per_episode must be a finite number >= 0 or null, got {sec!r}")


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
        for model, conds in report_models(rep).items():
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


def pooled_cell(model: str, condition: str, by_seed: dict[int, dict], none_by_seed: dict[int, dict],
                n_boot: int) -> dict[str, Any] | None:
    """The pooled entry of one model × condition (module docstring) over the seeds both it and ``none`` have;
    None when there is no such seed. Raises `BenchmarkError` when a seed's condition or ``none`` scored other
    tasks than the first seed's condition, or no task at all."""
    from envace_core.evaluation.stats import mean_ci
    from learning import t_interval
    from rehearsal_effect_heldout import ci_fields

    label = f"{model} {condition}"

    seeds = sorted(set(by_seed) & set(none_by_seed))
    if not seeds:
        return None
    tasks = sorted(by_seed[seeds[0]]["outcomes"])
    if not tasks:
        raise BenchmarkError(f"{label} at seed {seeds[0]}: no scored task")
    for s in seeds:
        for name, c in ((label, by_seed[s]), (f"{model} none", none_by_seed[s])):
            other = set(c["outcomes"]) ^ set(tasks)
            if other:
                raise BenchmarkError(f"{name} at seed {s} scored other tasks than {label} at seed {seeds[0]} "
                                     f"({len(other)} differ, e.g. {min(other)!r}): pool runs of one task set")
    own = [statistics.fmean(by_seed[s]["outcomes"][t] for s in seeds) for t in tasks]
    base = [statistics.fmean(none_by_seed[s]["outcomes"][t] for s in seeds) for t in tasks]
    diff = [a - b for a, b in zip(own, base)]

    per_seed = {}
    for s in seeds:
        o, b = by_seed[s]["outcomes"], none_by_seed[s]["outcomes"]
        per_seed[str(s)] = {"success": statistics.fmean(o[t] for t in tasks),
                            "paired_vs_none": statistics.fmean(o[t] - b[t] for t in tasks),
                            "gained": sum(1 for t in tasks if o[t] > b[t]), "lost": sum(1 for t in tasks if o[t] < b[t]),
                            "seconds_per_episode": by_seed[s].get("seconds_per_episode")}
    paired_means = [v["paired_vs_none"] for v in per_seed.values()]
    seed_ci = None
    if len(seeds) >= 2:  # a paired mean of 0/1 outcomes lies in [-1, 1]: the t-interval is cut there
        lo, hi = t_interval(paired_means)
        seed_ci = [max(-1.0, float(lo)), min(1.0, float(hi))]
    timed = [(by_seed[s].get("seconds_per_episode"), by_seed[s].get("seconds_timed_episodes") or 0) for s in seeds]
    n_timed = sum(k for sec, k in timed if sec is not None)
    total = lambda key: sum(by_seed[s].get(key) or 0 for s in seeds)
    return {"success": ci_fields(mean_ci(own, n_boot, 0)), "none_success_same_seeds": statistics.fmean(base),
            "paired_vs_none": {**ci_fields(mean_ci(diff, n_boot, 0)), "n": len(tasks)}, "seed_ci": seed_ci,
            "seeds": seeds, "n": len(tasks), "n_episodes": len(tasks) * len(seeds),
            "seconds_per_episode": (sum(sec * k for sec, k in timed if sec is not None) / n_timed) if n_timed else None,
            "rehearsals_made": total("rehearsals_made"), "rehearsals_rejected": total("rehearsals_rejected"),
            "real_calls_in_rehearsal": total("real_calls_in_rehearsal"), "per_seed": per_seed}


def pool(reports: dict[str, dict[str, Any]], n_boot: int = 2000) -> dict[str, Any]:
    """The pooled block {"run": {...}, <model>: {<condition>: `pooled_cell`}} of `reports` ({path: report});
    raises `BenchmarkError` (`check_same_run`, `collect`, `pooled_cell`), also when no condition has a seed
    shared with ``none``. Cells left out (unfinished, or at a seed where ``none`` did not finish) are listed in
    run.left_out."""
    check_same_run(reports)
    cells, left = collect(reports)
    out: dict[str, Any] = {}
    for model, conds in cells.items():
        none = conds.get("none", {})
        for cond, by_seed in conds.items():
            left += [f"{model} {cond} at seed {s}: no finished none at that seed to pair with"
                     for s in sorted(set(by_seed) - set(none))]
        block = {c: p for c, by_seed in conds.items()
                 if (p := pooled_cell(model, c, by_seed, none, n_boot)) is not None}
        if block:
            out[model] = block
    if not any(c != "none" for b in out.values() for c in b):
        raise BenchmarkError("no condition besides none finished at a seed where none finished too: nothing to pool")
    first = next(iter(reports.values()))["run"]
    out["run"] = {"kind": POOLED_KIND, **{k: first.get(k) for k in SAME_RUN if k != "task_ids"},
                  "n_tasks": len(first["task_ids"]), "models": first.get("models"), "reports": list(reports),
                  "left_out": left, "code": {p: r["run"].get("code") for p, r in reports.items()},
                  "date": time.strftime("%Y-%m-%d %H:%M %Z"), "n_boot": n_boot,
                  "ci": f"95% percentile bootstrap over tasks ({n_boot} resamples), each task averaged over the seeds; "
                        "seed_ci: Student-t over the seeds' paired means, cut to [-1, 1]"}
    return out


def markdown(block: dict[str, Any]) -> str:
    """One row per model × condition: seeds, episodes, success [CI], none's success at the same seeds, Δ vs none
    [CI], t-CI over seeds, each seed's Δ (gained/lost), rehearsals (rejected), real calls in rehearsal, seconds
    per episode."""
    f = lambda s, fmt: f"{fmt.format(s['mean'])} [{fmt.format(s['ci_low'])}, {fmt.format(s['ci_high'])}]"
    rows = [("| model | condition | seeds | tasks × seeds | success [95% CI] | none, same seeds | Δ vs none [95% CI] "
             "| Δ t-CI over seeds | Δ per seed (gained/lost) | rehearsals (rejected) | real calls in rehearsal "
             "| s / episode |"), "|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
                        f"{f(c['success'], '{:.3f}')} | {'—' if none else format(c['none_success_same_seeds'], '.3f')} | "
                        f"{'—' if none else f(c['paired_vs_none'], '{:+.3f}')} | {tci} | "
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
    """--key (non-empty, not ``run``), --n-boot (>= 100), --json and --results-md (`check_results_md`,
    `check_target`), and no report named twice or as --json. Raises `BenchmarkError`."""
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
    check_target(args.json, args.key)


def check_target(path: str, key: str) -> None:
    """Raises `BenchmarkError` unless the pooled block can go under `key` in the JSON at `path`: a file that can be
    written (`store.files.writable_file_problem`) whose `key`, when taken, holds an earlier pooled block (run.kind)
    rather than a measurement. A run's held-out report may take the block: pooled blocks in a report are skipped
    when it is read (`report_models`), so it stays poolable."""
    from envace_core.store.files import writable_file_problem

    if not path.strip():
        raise BenchmarkError("--json is empty; give a file path")
    why = writable_file_problem(path)
    if why:
        raise BenchmarkError(f"--json {path}: {why}")
    p = Path(path).expanduser()
    if not p.is_file():
        return
    try:
        old = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # check_results_md's report_overwrite_problem refused it already
    taken = old.get(key) if isinstance(old, dict) else None
    if taken is not None and not is_pooled_block(taken):
        raise BenchmarkError(f"--json {path} already holds {key!r}, which is not a pooled block: choose another --key")


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
    atomic_write_text(path, json.dumps(old, indent=2, default=str))  # keys in their order: a diff shows the block
    return replaced


def _shown(path: str) -> str:
    """`path` relative to the checkout when inside it (a section's command reads the same wherever it ran)."""
    full = Path(path).expanduser().resolve()
    root = HERE.parent
    return str(full.relative_to(root)) if full.is_relative_to(root) else str(full)


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
    for model, conds in block.items():
        for cond, c in conds.items() if model != "run" else ():
            if c["real_calls_in_rehearsal"]:
                print(f"WARNING: {model} {cond}: {c['real_calls_in_rehearsal']} real calls during rehearsal (must be 0: "
                      "rehearsal never touches the real environment, METHOD.md §4)")
    print(f"{'replaced' if replaced else 'wrote'} {args.key!r} in {args.json}")
    if not args.no_append:
        r = block["run"]
        append_section(Path(args.results_md), "\n".join([
            f"## Private Rehearsal effect pooled over seeds ({args.key}), {r['date']}", "",
            (f"`{' '.join(['benchmarks/rehearsal_effect_pool.py', *map(_shown, args.reports), '--key', args.key])}`: "
             f"{r['n_tasks']} held-out tasks ({r['heldout_file']}), protocol {r['protocol']}, overrides "
             f"{r['overrides']!r}. CIs: {r['ci']}."), "", table]))
        print(f"appended to {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
