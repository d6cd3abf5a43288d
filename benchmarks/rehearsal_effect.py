"""Effect of Private Rehearsal on success: no rehearsal vs parallel N vs sequential N.

    .venv/bin/python benchmarks/rehearsal_effect.py [--trained REF] [--limit 3]
        [--conditions none,parallel:2,parallel:4,parallel:8,sequential:2,sequential:4]
        [--benches tau2:airline,tau2:retail,bfcl:multi_turn_base] [--user policy|REF|URL]
        [--protocol tau2_orchestrator|opening_request] [--no-append]

For every model (``--models``, default ``base=bundled:smollm2-135m-instruct``, plus ``trained=REF`` from
``--trained``: any ``envace eval --model`` reference, e.g. ``registry:NAME@VERSION`` or a local LoRA adapter
folder over the profile's base) and every rehearsal condition, `evaluation.harness.run_eval` runs the benches on
the first ``--limit`` items of each (tau2: the test split through the tau2 harness under ``--protocol``,
`evaluation.protocols`, default tau2_orchestrator = tau2's Orchestrator with a simulated user; BFCL multi-turn:
bfcl's loop and checker, a rehearsal round per user turn). The model is loaded once per model; run_eval's
cache (``<out>/eval/cache/<fingerprint>``: per tau2 task, per BFCL entry) makes a rerun resume.

Per model × bench × condition: success rate (tau2: ``is_successful``, reward 1; unscored tasks, judged only
by NL assertions, are left out; BFCL: bfcl's multi-turn checker) with a 95% percentile bootstrap CI over
items (`stats.mean_ci`), and the paired difference to ``none`` on the same items (per-item success
difference, bootstrap CI over items). Every condition must score exactly the items ``none`` scored
(asserted). Writes ``<out>/rehearsal_effect.json``, prints a markdown table and the estimated wall time of
the full-scale run (all test tasks, from the measured seconds per freshly run episode; a cell that all came
from the cache keeps the seconds the previous ``rehearsal_effect.json`` in the same ``--out`` measured for
it, marked "timed in an earlier run"), and appends a section to benchmarks/RESULTS.md (unless
``--no-append``). Every argument and model reference is checked before any model loads (`check_args`);
a bad one is a one-line error, exit status 2.

With ``--heldout N --dataset PATH`` the script measures on N held-out synthesized tasks per domain instead
(disjoint from PATH's train split, verifier on/off conditions, resumable in chunks with ``--limit`` and
``--max-minutes``, report at ``--json``): `rehearsal_effect_heldout` (its docstring) takes every argument.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)
from envace_core import EnvaceError
from envace_core.evaluation.protocols import MAX_STEPS, PROTOCOLS, TAU2_ORCHESTRATOR
from envace_core.evaluation.stats import mean_ci
from envace_core.store.files import atomic_write_text

HERE = Path(__file__).resolve().parent
DEFAULT_CONDITIONS = "none,parallel:2,parallel:4,parallel:8,sequential:2,sequential:4"
DEFAULT_BENCHES = "tau2:airline,tau2:retail,bfcl:multi_turn_base"
DEFAULT_MODELS = "base=bundled:smollm2-135m-instruct"


class BenchmarkError(EnvaceError):
    """Bad arguments, or results that cannot be compared (different items per condition)."""


# ---------------------------------------------------------------------------------------- arguments
def comma_items(text: str | None, flag: str) -> list[str]:
    """The stripped items of a comma-separated `flag` value; raises `BenchmarkError` for an empty item (a stray
    comma: ``none,,parallel:2`` or ``a=x,``), as ``envace eval --bench`` does, so a half-typed list is not
    run as a shorter one. An empty or missing value gives []."""
    if not (text or "").strip():
        return []
    items = [s.strip() for s in text.split(",")]
    if "" in items:
        raise BenchmarkError(f"{flag} {text!r} has an empty item (a stray comma): separate items with single "
                             "commas, nothing before the first or after the last")
    return items


def parse_conditions(text: str) -> list[str]:
    """``none,parallel:2,...`` -> canonical condition names (`evaluation.options.parse_rehearsal` syntax), ``none``
    first. Raises `BenchmarkError` for a bad item, a duplicate, or no ``none`` (the paired baseline)."""
    from envace_core.evaluation.options import parse_rehearsal

    out: list[str] = []
    for item in comma_items(text, "--conditions"):
        try:
            mode, n = parse_rehearsal(item)
        except EnvaceError as e:
            raise BenchmarkError(f"--conditions item {item!r}: {e}") from None
        name = "none" if mode == "none" else f"{mode}:{n}"
        if name in out:
            raise BenchmarkError(f"--conditions lists {name} twice")
        out.append(name)
    if "none" not in out:
        raise BenchmarkError(f"--conditions {text!r} must include none: every effect is a paired difference to it")
    return ["none"] + [c for c in out if c != "none"]


def parse_models(models: str, trained: str | None) -> list[tuple[str, str]]:
    """``LABEL=REF,...`` (a bare REF is its own label) plus ``("trained", trained)`` -> [(label, ref)].
    Raises `BenchmarkError` for an empty list, an empty label/ref or a duplicate label."""
    pairs = []
    for item in comma_items(models, "--models"):
        label, sep, ref = item.partition("=")
        label, ref = (label.strip(), ref.strip()) if sep else (item, item)
        if not label or not ref:
            raise BenchmarkError(f"--models item {item!r}: write LABEL=REF, e.g. base=bundled:smollm2-135m-instruct")
        pairs.append((label, ref))
    if trained:
        pairs.append(("trained", trained.strip()))
    if not pairs:
        raise BenchmarkError("no model: give --models LABEL=REF and/or --trained REF")
    labels = [p[0] for p in pairs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise BenchmarkError(f"model labels must be unique, repeated: {', '.join(dup)}")
    return pairs


def resolve_models(models: list[tuple[str, str]], cfg) -> dict[str, Any]:
    """label -> `models.ResolvedModel` for `parse_models`' pairs, each checked as `models.check_model_ref` checks
    ``--model`` (an adapter folder over the profile's ``model.ref``; a local base folder's files; no weights
    loaded). Raises `BenchmarkError` naming the ``--models`` item (``--models LABEL 'REF'``) for a bad
    reference."""
    from envace_core.models import check_model_ref

    resolved = {}
    for label, ref in models:
        try:
            resolved[label] = check_model_ref(ref, cfg, flag=f"--models {label}")
        except EnvaceError as e:
            raise BenchmarkError(str(e)) from None
    return resolved


def parse_benches(text: str) -> list[str]:
    """Bench labels via `evaluation.options.parse_benches`; only tau2 domains and BFCL multi-turn categories (the
    ones Private Rehearsal acts on). Raises `BenchmarkError`."""
    from envace_core.evaluation.bfcl import MULTI_TURN_CATEGORIES
    from envace_core.evaluation.options import parse_benches as parse

    try:
        specs = parse(text)
    except EnvaceError as e:
        raise BenchmarkError(str(e)) from None
    why = {"bfcl": "single-turn BFCL never rehearses, so it has no effect to measure",
           "finmcp": "FinMCP never rehearses, so it has no effect to measure",
           "vita": "VitaBench is not scored by this script: compare `envace eval --bench vita:PATH` with "
                   "--rehearsal none and parallel:N instead"}
    bad = [s for s in specs if not (s.bench == "tau2" or (s.bench == "bfcl" and s.arg in MULTI_TURN_CATEGORIES))]
    if bad:
        reasons = "; ".join(dict.fromkeys(why[s.bench] for s in bad))
        raise BenchmarkError(f"--benches {', '.join(s.label for s in bad)}: this script measures only tau2:DOMAIN "
                             f"and bfcl:multi_turn_* ({reasons})")
    return [s.label for s in specs]


def parse_user(text: str | None) -> dict[str, str]:
    """``policy`` (default: run_eval's own default, the evaluated policy simulates the user), an
    ``http(s)://`` OpenAI-compatible base URL, or a model reference -> `EvalOptions` keyword arguments."""
    text = (text or "policy").strip()
    if text == "policy":
        return {}
    if text.startswith(("http://", "https://")):
        return {"user_url": text}
    return {"user_model": text}


# ------------------------------------------------------------------------------------------ results
def item_outcomes(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{bench label: {item id: success in [0, 1]}} from one `run_eval` result.

    tau2: mean over trials of the harness's ``success`` (tau2's ``is_successful(reward)``) per task; records
    left unscored (success None, i.e. judged only by NL assertions) are left out; BFCL: ``valid`` per entry of
    each category."""
    out: dict[str, dict[str, float]] = {}
    for b in result["benches"]:
        if b["bench"] == "tau2":
            per: dict[str, list[float]] = {}
            for r in b["results"]:
                if r.get("success") is not None:
                    per.setdefault(str(r["task_id"]), []).append(float(r["success"]))
            out[f"tau2:{b['name']}"] = {k: statistics.fmean(v) for k, v in per.items()}
        elif b["bench"] == "bfcl":
            for cat, c in b["report"]["categories"].items():
                out[f"bfcl:{cat}"] = {e["id"]: float(bool(e["valid"])) for e in c["entries"]}
    return out


def rehearsal_counts(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{bench label: {"rehearsals": rehearsed trajectories, "rejected": those the verifier dropped,
    "real_calls_in_rehearsal": real tool calls made while rehearsing, "isolation_checked": items whose record
    carries that count}} summed over the items of one `run_eval` result (all 0 for no rehearsal). tau2: a
    record's ``agent_stats`` and ``isolation`` (None under tau2_orchestrator, whose agent holds no environment
    handle: not counted as checked); BFCL multi-turn: an entry's ``rehearsal`` stats (`bfcl_results.EntryResult`).
    Real calls must be 0: the agent raises `rehearsal.IsolationError` otherwise (METHOD.md §4, isolation)."""
    def add(into: dict[str, int], rehearsals: Any, rejected: Any, real: Any) -> None:
        into["rehearsals"] += int(rehearsals or 0)
        into["rejected"] += int(rejected or 0)
        if real is not None:
            into["real_calls_in_rehearsal"] += int(real)
            into["isolation_checked"] += 1

    out: dict[str, dict[str, int]] = {}
    for b in result["benches"]:
        if b["bench"] == "tau2":
            c = out.setdefault(f"tau2:{b['name']}", zero_counts())
            for r in b["results"]:
                st = r.get("agent_stats") or {}
                add(c, st.get("rehearsals"), st.get("rejected"), (r.get("isolation") or {}).get("real_calls_during_rehearsal"))
        elif b["bench"] == "bfcl":
            for cat, cr in b["report"]["categories"].items():
                c = out.setdefault(f"bfcl:{cat}", zero_counts())
                for e in cr["entries"]:
                    st = e.get("rehearsal") or {}
                    add(c, st.get("rehearsals"), st.get("rejected"), st.get("real_calls_during_rehearsal"))
    return out


def zero_counts() -> dict[str, int]:
    """The rehearsal counts of a bench with no item (`rehearsal_counts`)."""
    return {"rehearsals": 0, "rejected": 0, "real_calls_in_rehearsal": 0, "isolation_checked": 0}


def rehearsals_run(result: dict[str, Any]) -> dict[str, int]:
    """{bench label: rehearsed trajectories in total} (0 for no rehearsal; proves rehearsal ran)."""
    return {b: c["rehearsals"] for b, c in rehearsal_counts(result).items()}


def check_same_items(by_condition: dict[str, dict[str, float]], where: str) -> list[str]:
    """The item ids every condition scored (sorted); raises `BenchmarkError` naming the condition and
    the items that differ from ``none``'s."""
    base = set(by_condition["none"])
    for cond, items in by_condition.items():
        if set(items) != base:
            raise BenchmarkError(f"{where}: condition {cond} scored other items than none: missing "
                                 f"{sorted(base - set(items))}, extra {sorted(set(items) - base)}")
    return sorted(base)


def effect(by_condition: dict[str, dict[str, float]], where: str, n_boot: int = 2000,
           seed: int = 0) -> dict[str, dict[str, Any]]:
    """{condition: {"success": mean_ci over items, "diff_vs_none": mean_ci of the paired per-item
    differences (condition - none)}} (Efron & Tibshirani 1993 ch. 13 percentile bootstrap, `stats`)."""
    items = check_same_items(by_condition, where)
    base = by_condition["none"]
    return {c: {"success": mean_ci([v[i] for i in items], n_boot, seed),
                "diff_vs_none": mean_ci([v[i] - base[i] for i in items], n_boot, seed)}
            for c, v in by_condition.items()}


def ci_text(s: dict[str, Any], signed: bool = False) -> str:
    """``mean [low, high]`` of a `stats.mean_ci` result to 3 decimals (signed: with +/-); "n/a" without a mean."""
    if s["mean"] is None:
        return "n/a"
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(s['mean'])} [{f.format(s['ci95'][0])}, {f.format(s['ci95'][1])}]"


def _seconds(c: dict[str, Any]) -> str:
    if c["per_episode_s"] is None:
        return "never timed (all from cache)"
    return f"{c['per_episode_s']:.1f}" + (" (timed in an earlier run)" if c.get("timed") == "earlier run" else "")


def markdown(cells: list[dict[str, Any]]) -> str:
    """The results table: one row per model × bench × condition."""
    rows = ["| model | bench | condition | n | success [95% CI] | Δ vs none [95% CI] | rehearsals | s / episode |",
            "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        sec = _seconds(c)
        diff = "—" if c["condition"] == "none" else ci_text(c["diff_vs_none"], signed=True)
        rows.append(f"| {c['model']} | {c['bench']} | {c['condition']} | {c['success']['n']} | {ci_text(c['success'])} "
                    f"| {diff} | {c['rehearsals']} | {sec} |")
    return "\n".join(rows)


def full_scale_estimate(cells: list[dict[str, Any]], full_items: dict[str, int]) -> dict[str, Any]:
    """Seconds for all `full_items[bench]` items of every cell: per-episode seconds × items, where a
    cell never timed borrows the mean of the same (condition, bench) over models. When some cell has no
    time even so (``unmeasured_cells``), ``seconds``/``hours`` are None (a sum without them would
    understate) and ``timed_seconds`` is the sum over the others."""
    def mean_of(cond: str, bench: str) -> float | None:
        xs = [c["per_episode_s"] for c in cells
              if c["condition"] == cond and c["bench"] == bench and c["per_episode_s"] is not None]
        return statistics.fmean(xs) if xs else None

    total, missing = 0.0, []
    for c in cells:
        s = c["per_episode_s"] if c["per_episode_s"] is not None else mean_of(c["condition"], c["bench"])
        if s is None:
            missing.append(f"{c['model']}/{c['bench']}/{c['condition']}")
        else:
            total += s * full_items[c["bench"]]
    whole = None if missing else total
    return {"seconds": whole, "hours": None if whole is None else whole / 3600, "timed_seconds": total,
            "items": full_items, "unmeasured_cells": missing}


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 360 else f"{seconds:.0f} s"


def estimate_text(est: dict[str, Any]) -> str:
    """The full-scale estimate in words; says which cells were never timed instead of a partial sum."""
    if est["seconds"] is not None:
        return _duration(est["seconds"])
    return (f"not available: never timed (all from cache, no earlier rehearsal_effect.json timing them): "
            f"{', '.join(est['unmeasured_cells'])}; rerun them with a fresh --out to time them"
            + (f"; the timed cells alone: {_duration(est['timed_seconds'])}" if est["timed_seconds"] else ""))


def previous_timings(path: Path) -> dict[tuple, float]:
    """{(model ref, bench, condition, item ids): seconds per episode} of the timed cells of an earlier
    report at `path` ({} when there is none; a report that does not parse is ignored with a warning)."""
    if not path.is_file():
        return {}
    try:
        rep = json.loads(path.read_text())
        refs = {label: m["ref"] for label, m in rep["models"].items()}
        return {(refs[c["model"]], c["bench"], c["condition"], tuple(sorted(c["items"]))): float(c["per_episode_s"])
                for c in rep["cells"] if c.get("per_episode_s") is not None}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"warning: {path} does not parse ({type(e).__name__}: {e}); cached cells stay untimed", file=sys.stderr)
        return {}


def cell_timing(res: dict[str, Any], bench: str, ref: str, cond: str, items: dict[str, float],
                earlier: dict[tuple, float]) -> dict[str, Any]:
    """ran/cached counts and seconds per freshly run episode of one cell; a cell that all came from the
    cache takes the seconds of the same cell (model ref, bench, condition, items) in `earlier`."""
    w = res["work"].get(bench, {})
    ran = w.get("ran", 0)
    if ran:
        sec, timed = res["seconds"][bench] / ran, "this run"
    else:
        sec = earlier.get((ref, bench, cond, tuple(sorted(items))))
        timed = None if sec is None else "earlier run"
    return {"ran": ran, "cached": w.get("cached", 0), "per_episode_s": sec, "timed": timed}


def full_items(benches: list[str]) -> dict[str, int]:
    """Items per bench at full scale: tau2's test split size, the BFCL category's entry count."""
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.evaluation.bfcl import load_bfcl

    return {b: len(load_tasks(b.split(":", 1)[1], "test")) if b.startswith("tau2:") else len(load_bfcl(b.split(":", 1)[1]))
            for b in benches}


# ---------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every model × condition through `run_eval` (module docstring); returns the JSON report."""
    from envace_core.config import load_config
    from envace_core.evaluation.harness import run_eval
    from envace_core.evaluation.options import EvalOptions
    from envace_core.models import resolve_model_ref
    from envace_core.training.policy import load_engine

    conditions, benches = parse_conditions(args.conditions), parse_benches(args.benches)
    models, user = parse_models(args.models, args.trained), parse_user(args.user)
    cfg = load_config(args.profile, args.overrides)
    earlier = previous_timings(Path(args.out) / "rehearsal_effect.json")
    t0, load0 = time.perf_counter(), os.getloadavg()
    cells, meta, user_desc = [], {}, None
    for label, ref in models:
        engine, n_params = load_engine(cfg, resolve_model_ref(ref, cfg.store.registry, base_ref=cfg.model.ref))
        by_bench: dict[str, dict[str, dict[str, float]]] = {b: {} for b in benches}
        timing: dict[tuple[str, str], dict[str, Any]] = {}
        for cond in conditions:
            opts = EvalOptions(model=ref, benches=",".join(benches), out=str(Path(args.out) / "eval"), rehearsal=cond,
                               limit=args.limit, protocol=args.protocol, max_steps=args.max_steps, seed=args.seed,
                               profile=args.profile, overrides=args.overrides, **user)
            res = run_eval(opts, engine=engine, n_params=n_params, log=log)
            user_desc = res["user_simulator"]
            meta[label] = res["model"]
            reh, outcomes = rehearsals_run(res), item_outcomes(res)
            for b, items in outcomes.items():
                by_bench[b][cond] = items
                timing[(b, cond)] = {**cell_timing(res, b, res["model"]["ref"], cond, items, earlier),
                                     "rehearsals": reh.get(b, 0)}
            log(f"[effect] {label} {cond}: " + ", ".join(
                f"{b} {statistics.fmean(v.values()) if v else float('nan'):.3f} (n={len(v)})" for b, v in outcomes.items()))
        for b in benches:
            for cond, stats in effect(by_bench[b], f"{label}/{b}", args.n_boot, args.seed).items():
                cells.append({"model": label, "bench": b, "condition": cond, **stats, **timing[(b, cond)],
                              "items": by_bench[b][cond]})
        del engine
    wall = time.perf_counter() - t0
    return {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": wall,
            "machine": {"cpus": os.cpu_count(), "torch_threads": _torch_threads(), "load_avg_start": load0,
                        "load_avg_end": os.getloadavg()},
            "settings": {"conditions": conditions, "benches": benches, "limit": args.limit, "split": "test",
                         "protocol": args.protocol, "max_steps": args.max_steps, "seed": args.seed, "profile": args.profile,
                         "overrides": args.overrides, "n_boot": args.n_boot,
                         "bfcl_rehearsal": "a round at the start of every user turn (every step with rehearsal.reenter)"},
            "user_simulator": user_desc + (" (each model simulates its own user; --user REF fixes one)"
                                           if not user and len(models) > 1 else ""),
            "models": meta, "cells": cells,
            "estimate_full_scale": full_scale_estimate(cells, full_items(benches))}


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def results_section(report: dict[str, Any]) -> str:
    """The markdown section appended to RESULTS.md (command, wall time, limits, user simulator, load)."""
    s, m, est = report["settings"], report["machine"], report["estimate_full_scale"]
    load = lambda xs: "/".join(f"{x:.2f}" for x in xs)
    models = "; ".join(f"{k}: {v['label']}" for k, v in report["models"].items())
    return "\n".join([
        f"## Private Rehearsal effect, {report['date']}", "",
        (f"Command: `{report['command']}`; wall {report['wall_s']:.0f} s; first {s['limit']} items per bench "
         f"(tau2 {s['split']} split, {_protocol_text(s)}; BFCL rehearsal: {s['bfcl_rehearsal']}); "
         f"models: {models}; user simulator: {report['user_simulator']}; {m['cpus']} CPUs, "
         f"{m['torch_threads']} torch threads, load average "
         f"(1/5/15 min) {load(m['load_avg_start'])} at start, {load(m['load_avg_end'])} at end. Success: tau2 "
         f"reward 1 / bfcl multi-turn checker valid; CIs: 95% percentile bootstrap over items ({s['n_boot']} "
         "resamples); Δ: paired per-item difference to no rehearsal on the same items."), "",
        markdown(report["cells"]), "",
        (f"Full scale ({', '.join(f'{b}: {n}' for b, n in est['items'].items())} items per model and condition), "
         f"estimated from the measured seconds per episode: {estimate_text(est)}."), ""])


def _protocol_text(settings: dict[str, Any]) -> str:
    """The tau2 protocol in a few words (reports written before ``--protocol`` existed: the orchestrator)."""
    from envace_core.evaluation.protocols import TAU2_ORCHESTRATOR

    protocol = settings.get("protocol", TAU2_ORCHESTRATOR)
    if protocol == TAU2_ORCHESTRATOR:
        return f"protocol {protocol}, ≤ {settings['max_steps']} orchestrator steps"
    return f"protocol {protocol} (opening request only, no user simulator)"


def append_section(path: Path, text: str) -> None:
    """Append `text` to `path` atomically (write the whole new file, then rename)."""
    old = path.read_text() if path.is_file() else ""
    atomic_write_text(path, old.rstrip("\n") + "\n\n" + text)


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def build_parser() -> argparse.ArgumentParser:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS, help="LABEL=REF,... (default: %(default)s)")
    ap.add_argument("--trained", help="the trained model, added as label 'trained': registry:NAME@VERSION, "
                    "a local LoRA adapter folder (over the profile's base), a local HF folder, ...")
    ap.add_argument("--conditions", default=DEFAULT_CONDITIONS, help="must include none (default: %(default)s)")
    ap.add_argument("--benches", default=DEFAULT_BENCHES, help="tau2:DOMAIN and bfcl:multi_turn_* (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=3, help="first N items per bench (default 3; full scale is hours)")
    ap.add_argument("--user", default="policy", help="user simulator: policy (run_eval's default: the evaluated "
                    "model itself), a model ref, or an OpenAI-compatible base URL")
    ap.add_argument("--protocol", default=TAU2_ORCHESTRATOR, choices=list(PROTOCOLS),
                    help="tau2 protocol (envace_core.evaluation.protocols; default: %(default)s)")
    ap.add_argument("--max-steps", type=int, default=MAX_STEPS, help="tau2_orchestrator steps per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--out", default=".envace/bench/rehearsal_effect")
    ap.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--heldout", type=int, help="N held-out synthesized tasks per domain instead of the benches: "
                    "hands every argument to rehearsal_effect_heldout.py (see its --help)")
    return ap


def check_report_targets(targets: list[tuple[str, str | None, str]]) -> None:
    """Raises `BenchmarkError` when a report flag's path (``[(flag, path or None, kind)]``, kind "json" or "md")
    would damage a file that is not such a report (`store.files.report_overwrite_problem`: a dataset's
    tasks.parquet, RESULTS.md under --json) or when two flags name the same file (a markdown section would be
    appended into the JSON report, or the report written over the markdown)."""
    from envace_core.store.files import report_overwrite_problem

    seen: dict[Path, str] = {}
    for flag, path, kind in targets:
        if not path or not path.strip():
            continue
        why = report_overwrite_problem(path, kind)
        if why:
            raise BenchmarkError(f"{flag} {path}: {why}")
        key = Path(path).expanduser().resolve()
        if key in seen:
            raise BenchmarkError(f"{flag} {path} is also {seen[key]}: give each report its own file")
        seen[key] = flag


def check_results_md(args: argparse.Namespace) -> None:
    """Raises `BenchmarkError` unless --results-md can be appended to, when the run appends to it (this
    script: unless --no-append; rehearsal_grid.py, which shares these checks: with --append-results), and for
    a --json or --results-md that `check_report_targets` refuses: checked before any work, so that a
    finished run's section is never lost to a bad path and no input is overwritten."""
    from envace_core.store.files import writable_file_problem

    appends = getattr(args, "append_results", None)
    appends = not args.no_append if appends is None else appends
    check_report_targets([("--json", getattr(args, "json", None), "json")]
                         + ([("--results-md", args.results_md, "md")] if appends else []))
    why = writable_file_problem(args.results_md) if appends else None
    if why:
        raise BenchmarkError(f"--results-md {args.results_md}: {why}"
                             + (" (or pass --no-append)" if hasattr(args, "no_append") else ""))


def check_tau2_flags(args: argparse.Namespace) -> None:
    """Raises `BenchmarkError` for --protocol or --max-steps given a value other than its default that no bench
    in --benches uses (--protocol: tau2 only; --max-steps: tau2 under tau2_orchestrator), by
    `evaluation.options.unused_flags`, the rule `envace eval` applies."""
    from envace_core.evaluation.options import parse_benches as parse_specs
    from envace_core.evaluation.options import unused_flags

    for flag, why in unused_flags(parse_specs(args.benches), protocol=args.protocol, max_steps=args.max_steps):
        value = args.protocol if flag == "--protocol" else args.max_steps
        raise BenchmarkError(f"{flag} {value}: {why}; drop it or add a tau2:DOMAIN bench")


def check_args(args: argparse.Namespace) -> None:
    """Everything checkable before a model loads: the options, the profile and overrides
    (`config.load_config`), --max-steps (`EvalOptions.check`), and every model reference (--models,
    --trained, --user REF) with `models.check_model_ref` (registry versions verified, adapter folders
    checked, base model folders found). Raises `EnvaceError` (`BenchmarkError`, `config.ConfigError`,
    `models.ModelRefError`, `models.ModelNotFoundError`); --results-md as `check_results_md`."""
    from envace_core.config import load_config
    from envace_core.evaluation.options import EvalOptions
    from envace_core.models import check_model_ref

    if args.limit is not None and args.limit < 1:
        raise BenchmarkError(f"--limit must be >= 1, got {args.limit}")
    if args.n_boot < 100:
        raise BenchmarkError(f"--n-boot must be >= 100 for a 95% interval, got {args.n_boot}")
    parse_conditions(args.conditions)
    parse_benches(args.benches)
    check_tau2_flags(args)
    models = parse_models(args.models, args.trained)
    cfg = load_config(args.profile, args.overrides)
    from envace_core.evaluation.options import UnusedOptionError
    from envace_core.evaluation.options import parse_benches as parse_specs

    try:  # with the benches: a --user no selected bench calls is refused now, not after the model loads
        EvalOptions(model="", benches=args.benches, out=args.out, limit=args.limit, protocol=args.protocol,
                    max_steps=args.max_steps, seed=args.seed, **parse_user(args.user)).check(parse_specs(args.benches))
    except UnusedOptionError as e:
        raise BenchmarkError(f"--user {args.user}: {str(e).partition(': ')[2]}") from None
    check_results_md(args)
    user = parse_user(args.user).get("user_model")
    for what, ref in [(f"model {label}", ref) for label, ref in models] + ([("--user", user)] if user else []):
        try:
            check_model_ref(ref, cfg)
        except EnvaceError as e:
            raise BenchmarkError(f"{what} ({ref}): {e}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--heldout" or a.startswith("--heldout=") for a in argv):
        sys.path.insert(0, str(HERE))
        from rehearsal_effect_heldout import main as heldout_main

        return heldout_main(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
    except EnvaceError as e:  # argparse's form: one line, exit 2, before any model loads
        print(f"{ap.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        report = run(args)
    except EnvaceError as e:
        print(f"{ap.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    out = Path(args.out) / "rehearsal_effect.json"
    _write_json(out, report)
    est = report["estimate_full_scale"]
    print(markdown(report["cells"]))
    print(f"user simulator: {report['user_simulator']}; wall {report['wall_s']:.0f} s; "
          f"{report['machine']['torch_threads']} torch threads; load average "
          f"{report['machine']['load_avg_start'][0]:.2f} -> {report['machine']['load_avg_end'][0]:.2f}")
    print(f"full-scale estimate ({est['items']} items per model x condition): {estimate_text(est)}")
    print(f"report: {out}")
    if not args.no_append:
        append_section(Path(args.results_md), results_section(report))
        print(f"appended to {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
