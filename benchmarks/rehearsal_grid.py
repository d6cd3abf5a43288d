"""Private Rehearsal grid in wall-clock-bounded, resumable chunks: every model × condition × verifier × bench.

    .venv/bin/python benchmarks/rehearsal_grid.py --models warm_start=REF --trained REF [--engine vllm]
        [--time-budget 540] [--limit N] [--conditions none,parallel:2,parallel:4,parallel:8,sequential:2,sequential:4]
        [--verifier on,off] [--benches tau2:airline,tau2:retail,bfcl:multi_turn_base] [--out DIR]
    .venv/bin/python benchmarks/rehearsal_grid.py --report [--out DIR] [--json PATH] [--append-results]

Made for a GPU machine whose commands are cut at a few minutes (benchmarks/rehearsal_grid.sh wraps it). One
call does as much of the grid as fits in ``--time-budget`` seconds of wall time (model loading included), stops
between chunks, saves its progress and exits with status 3 while work remains; the next call with the same
``--out`` continues where it stopped; status 0 once every cell is done or blocked. ``--report`` loads no model:
it writes the JSON and the table from what the calls so far measured.

Cells: for every model (``--models LABEL=REF,...`` and ``--trained REF``), no rehearsal (``none``, run once: the
verifier filters rehearsals, so it has nothing to act on there) and every other ``--conditions`` item with each
``--verifier`` setting (``parallel:4`` = verifier on, ``parallel:4/no-verifier`` = off; the setting is the
``rehearsal.verifier`` config field, `evaluation.tau2.policy_agent`). Every cell is one `evaluation.harness.run_eval`
setting (its ``--overrides`` add ``rollout.engine=ENGINE`` and, verifier off, ``rehearsal.verifier=false``), so the
protocol, scoring and resume cache are the harness's (`rehearsal_effect` module docstring). Default: tau2 test split
in full (airline 20, retail 40 tasks) and all 200 BFCL multi_turn_base entries (``--limit N``: the first N).

Order and chunks: per model, bench by bench, item-major: items 1..k of every cell before items k+1..: a partial grid
always pairs every condition on (nearly) the same items. A chunk is one `run_eval` call on the first ``done + step``
items of one cell (step 1 for tau2, 4 for BFCL multi-turn, the harness's batch), so its cache serves the items
already done and only the new ones run. Before a chunk the driver estimates its seconds (the slowest seconds per
item seen for that bench and condition in any model, else for that bench, else for any bench) and stops if it
would end past the budget; a model is loaded only if its measured load time fits. With ``--engine vllm`` a call loads one model (vLLM
keeps the GPU memory of an engine until its process exits); the next call starts the next model.

Skipped, and said so in every call's summary and in the report: a chunk that raises (e.g. vLLM refusing a prompt
longer than ``max_model_len``, a BFCL entry whose tool class needs an unavailable dependency, CUDA out of memory)
blocks its cell at that item with the error as the reason (``--retry-blocked`` tries again); tau2 tasks judged only
by NL assertions (reward None: unscored, left out, as in rehearsal_effect); tau2 trials that raised (recorded by the
harness as errors, reward 0, counted as failures as tau2-bench does; listed with the error). `rehearsal.IsolationError`
(a rehearsal touched the real environment) is never skipped: it stops the call.

Report (`report`): per model × bench × cell, success with a 95% percentile bootstrap CI over the items every
unblocked cell of that model × bench has scored (a blocked cell: those of them it has; `stats.mean_ci`, Efron &
Tibshirani 1993 ch. 13), the paired difference to ``none`` on the same items, seconds per freshly run
episode, rehearsals, rehearsals rejected by the verifier, real calls during rehearsal; plus items done / total, the
items left out of the pairing and the skips. Progress lives in ``<out>/grid_state.json`` (written atomically after
every chunk); a state with other run settings (protocol, max steps, seed, profile, overrides, engine, user, a
label's model ref) than the call's is refused, naming the setting, before any model loads.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

_T0 = time.monotonic()  # the time budget counts from here: imports (tau2, torch) are part of a call's wall time
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rehearsal_effect as effect_mod  # noqa: E402  (benchmarks/ is not a package)

import envace_core  # noqa: E402,F401  (offline environment first)
from envace_core import EnvaceError  # noqa: E402
from envace_core.evaluation.protocols import MAX_STEPS, PROTOCOLS, TAU2_ORCHESTRATOR  # noqa: E402
from envace_core.evaluation.stats import mean_ci  # noqa: E402
from envace_core.store.files import atomic_write_text  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_BUDGET_S = 540.0
DEFAULT_OUT = ".envace/bench/rehearsal_grid"
STATE_FILE = "grid_state.json"
REPORT_FILE = "rehearsal_grid.json"
TABLE_FILE = "rehearsal_grid.md"
NO_VERIFIER = "/no-verifier"
EXIT_DONE, EXIT_MORE = 0, 3
# Settings that select the harness's results (its cache fingerprint): a state written under others is refused.
IDENTITY = ("protocol", "max_steps", "seed", "profile", "overrides", "engine", "user")


class GridError(EnvaceError):
    """Bad grid arguments, or an --out whose saved grid was run with other settings."""


# ---------------------------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    """One rehearsal setting of the grid: `condition` (canonical ``none`` / ``parallel:N`` / ``sequential:N``)
    and `verifier` (None for ``none``)."""

    condition: str
    verifier: bool | None

    @property
    def label(self) -> str:
        return self.condition + (NO_VERIFIER if self.verifier is False else "")


def parse_verifier(text: str) -> list[bool]:
    """``on`` / ``off`` / ``on,off`` -> [True] / [False] / [True, False]. Raises `GridError`."""
    names = {"on": True, "off": False}
    items = [s.lower() for s in effect_mod.comma_items(text, "--verifier")]
    bad = [s for s in items if s not in names]
    if not items or bad:
        raise GridError(f"--verifier {text!r}: write on, off or on,off")
    return list(dict.fromkeys(names[s] for s in items))


def grid_cells(conditions: list[str], verifiers: list[bool]) -> list[Cell]:
    """``none`` once, then every other condition with each verifier setting (conditions in their order)."""
    return [Cell("none", None)] + [Cell(c, v) for c in conditions if c != "none" for v in verifiers]


def cell_overrides(base: dict[str, Any], engine: str, verifier: bool | None, default_verifier: bool) -> str:
    """The run_eval ``--overrides`` of a cell: `base` (the user's, parsed) with ``rollout.engine`` = `engine`
    and, when `verifier` differs from the profile's ``rehearsal.verifier``, ``rehearsal.verifier`` = `verifier`;
    canonical JSON (sorted keys), "" when nothing is set, so that the same settings give the same harness
    cache fingerprint."""
    from envace_core.config import deep_merge

    extra: dict[str, Any] = {"rollout": {"engine": engine}}
    if verifier is not None and verifier != default_verifier:
        extra["rehearsal"] = {"verifier": verifier}
    merged = deep_merge(base, extra)
    return json.dumps(merged, sort_keys=True) if merged else ""


def chunk_step(bench: str) -> int:
    """Items per chunk: 1 for tau2 (the harness runs tasks one at a time), 4 for BFCL multi-turn (the
    harness's lockstep batch, `harness.run_bfcl_benches`)."""
    return 1 if bench.startswith("tau2:") else 4


# ---------------------------------------------------------------------------------------------- state
def cell_key(model: str, bench: str, cell: Cell) -> str:
    return f"{model}|{bench}|{cell.label}"


def new_cell_state() -> dict[str, Any]:
    return {"done": 0, "outcomes": {}, "unscored": [], "errors": {}, "rehearsals": 0, "rejected": 0,
            "real_calls_in_rehearsal": 0, "isolation_checked": 0, "ran": 0, "seconds": 0.0,
            "per_item_max_s": None, "blocked": None}


def load_state(out: Path) -> dict[str, Any]:
    """The saved grid under `out` ({} when none). Raises `GridError` when it does not parse (it is left as is)."""
    path = out / STATE_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("cells"), dict):
            raise ValueError("not a grid state object")
        return state
    except ValueError as e:
        raise GridError(f"{path} does not parse ({e}); move it away to start the grid afresh "
                        "(the harness cache under eval/ stays valid)") from None


def save_state(out: Path, state: dict[str, Any]) -> None:
    atomic_write_text(out / STATE_FILE, json.dumps(state, indent=1, sort_keys=True, default=str))


def check_identity(state: dict[str, Any], settings: dict[str, Any], models: list[tuple[str, str]], out: Path) -> None:
    """Raises `GridError` naming every setting (and model label) that differs from the saved grid's."""
    if not state:
        return
    saved = state.get("settings", {})
    diff = [f"{k}: {saved.get(k)!r} there, {settings[k]!r} here" for k in IDENTITY if saved.get(k) != settings[k]]
    refs = saved.get("models", {})
    diff += [f"model {label}: {refs[label]!r} there, {ref!r} here" for label, ref in models
             if label in refs and refs[label] != ref]
    if diff:
        raise GridError(f"--out {out} holds a grid run with other settings ({'; '.join(diff)}); give the same "
                        "settings to continue it, or another --out")


# ----------------------------------------------------------------------------------------- run_eval
def chunk_result(res: dict[str, Any], bench: str) -> dict[str, Any]:
    """What one `run_eval` result holds for `bench`: items returned (``done``), per-item success of the scored
    ones (`rehearsal_effect.item_outcomes`), unscored tau2 tasks, tau2 trials that raised (first line of the
    error), rehearsal counts (`rehearsal_effect.rehearsal_counts`), items freshly run and their seconds."""
    b = res["benches"][0]  # one bench per chunk
    if b["bench"] == "tau2":
        recs = b["results"]
        done = len({str(r["task_id"]) for r in recs})
        unscored = sorted({str(r["task_id"]) for r in recs if r.get("success") is None})
        errors = {str(r["task_id"]): str(r["error"]).strip().splitlines()[0][:300] for r in recs if r.get("error")}
    else:
        done, unscored, errors = len(b["report"]["categories"][bench.split(":", 1)[1]]["entries"]), [], {}
    counts = effect_mod.rehearsal_counts(res).get(bench) or effect_mod.zero_counts()
    return {"done": done, "outcomes": effect_mod.item_outcomes(res).get(bench, {}), "unscored": unscored,
            "errors": errors, **counts, "ran": res["work"].get(bench, {}).get("ran", 0),
            "seconds": float(res["seconds"].get(bench, 0.0))}


@dataclass
class Harness:
    """The real model loader and chunk runner over `run_eval` (tests pass their own)."""

    args: argparse.Namespace
    base_overrides: dict[str, Any]
    default_verifier: bool

    def load(self, label: str, ref: str) -> Any:
        from envace_core.config import load_config
        from envace_core.models import resolve_model_ref
        from envace_core.training.policy import load_engine

        cfg = load_config(self.args.profile, cell_overrides(self.base_overrides, self.args.engine, None, True))
        return load_engine(cfg, resolve_model_ref(ref, cfg.store.registry, base_ref=cfg.model.ref))

    def run(self, handle: Any, ref: str, cell: Cell, bench: str, limit: int) -> dict[str, Any]:
        from envace_core.evaluation.harness import run_eval
        from envace_core.evaluation.options import EvalOptions

        engine, n_params = handle
        a = self.args
        opts = EvalOptions(model=ref, benches=bench, out=str(Path(a.out) / "eval"), rehearsal=cell.condition,
                           limit=limit, protocol=a.protocol, max_steps=a.max_steps, seed=a.seed, profile=a.profile,
                           overrides=cell_overrides(self.base_overrides, a.engine, cell.verifier, self.default_verifier),
                           **effect_mod.parse_user(a.user))
        return chunk_result(run_eval(opts, engine=engine, n_params=n_params, log=lambda _msg: None), bench)


# ---------------------------------------------------------------------------------------------- loop
def _estimate(state: dict[str, Any], bench: str, cell: Cell) -> float | None:
    """Seconds per item to expect: the slowest chunk's per-item seconds of (bench, cell) over models, else of
    the bench over all cells, else of any bench; None before anything ran."""
    same, same_bench, anything = [], [], []
    for key, c in state["cells"].items():
        _, b, label = key.split("|", 2)
        if c.get("per_item_max_s") is not None:
            anything.append(c["per_item_max_s"])
            if b == bench:
                same_bench.append(c["per_item_max_s"])
                if label == cell.label:
                    same.append(c["per_item_max_s"])
    xs = same or same_bench or anything
    return max(xs) if xs else None


def _update(c: dict[str, Any], r: dict[str, Any]) -> None:
    """Fold one chunk's result into its cell's state (the result covers all items so far; the timing adds up)."""
    for k in ("done", "outcomes", "unscored", "errors", "rehearsals", "rejected", "real_calls_in_rehearsal",
              "isolation_checked"):
        c[k] = r[k]
    if r["ran"]:
        c["ran"] += r["ran"]
        c["seconds"] += r["seconds"]
        per = r["seconds"] / r["ran"]
        c["per_item_max_s"] = per if c["per_item_max_s"] is None else max(c["per_item_max_s"], per)


def remaining(state: dict[str, Any], models: list[str], cells: list[Cell], totals: dict[str, int]) -> dict[str, Any]:
    """Items still to run (cells not blocked), items skipped by blocked cells, and the estimated seconds of the
    former (`_estimate` per item; None before anything was timed)."""
    todo, skipped, secs, untimed = 0, 0, 0.0, False
    for m in models:
        for b, total in totals.items():
            for cell in cells:
                c = state["cells"].get(cell_key(m, b, cell)) or new_cell_state()
                left = max(0, total - c["done"])
                if c["blocked"]:
                    skipped += left
                    continue
                todo += left
                est = _estimate(state, b, cell)
                if left and est is None:
                    untimed = True
                secs += left * (est or 0.0)
    return {"items": todo, "skipped_items": skipped, "seconds": None if untimed else secs}


def run_grid(args: argparse.Namespace, models: list[tuple[str, str]], cells: list[Cell], benches: list[str],
             totals: dict[str, int], settings: dict[str, Any], *, load: Callable[[str, str], Any],
             run_chunk: Callable[[Any, str, Cell, str, int], dict[str, Any]],
             clock: Callable[[], float] = time.monotonic, t0: float | None = None,
             log: Callable[[str], None] = print) -> tuple[int, dict[str, Any]]:
    """Run chunks until the grid is done or the next chunk / model load would end past ``args.time_budget``
    seconds after `t0` (default: now). `load(label, ref)` -> handle; `run_chunk(handle, ref, cell, bench, limit)`
    -> `chunk_result`. Saves the state under ``args.out`` after every chunk; returns (exit status: 0 done, 3 more
    to do; the state). Raises `GridError` for a saved grid with other settings, `rehearsal.IsolationError` as is."""
    from envace_core.rehearsal.agent import IsolationError

    out = Path(args.out)
    t0 = clock() if t0 is None else t0
    budget = args.time_budget
    state = load_state(out)
    check_identity(state, settings, models, out)
    state.setdefault("cells", {})
    state.setdefault("loads", {})
    state.setdefault("runs", [])
    state["settings"] = {**settings, "models": {**state.get("settings", {}).get("models", {}), **dict(models)}}
    state["plan"] = {"models": [m for m, _ in models], "cells": [c.label for c in cells], "benches": benches,
                     "totals": totals, "limit": args.limit}
    if args.retry_blocked:
        for c in state["cells"].values():
            c["blocked"] = None
    run = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "chunks": 0, "ran": 0, "stopped": None}
    state["runs"].append(run)

    def left() -> float:
        return float("inf") if budget is None else budget - (clock() - t0)

    loaded_one = False
    try:
        for label, ref in models:
            states = [state["cells"].get(cell_key(label, b, cell)) or new_cell_state() for b in benches for cell in cells]
            totals_of = [totals[b] for b in benches for _ in cells]
            if not any(not c["blocked"] and c["done"] < t for c, t in zip(states, totals_of)):
                continue
            if loaded_one and args.engine == "vllm":
                run["stopped"] = (f"model {label} is next: with engine vllm one model is loaded per call (vLLM "
                                  "keeps an engine's GPU memory until its process exits); call again")
                break
            load_est = state["loads"].get(label) or max(state["loads"].values(), default=None)
            if load_est is not None and load_est > left():
                run["stopped"] = f"loading model {label} (~{load_est:.0f} s) would end past the time budget"
                break
            t1 = clock()
            handle = load(label, ref)
            state["loads"][label] = clock() - t1
            loaded_one = True
            log(f"[grid] model {label} ({ref}) loaded in {state['loads'][label]:.0f} s; {left():.0f} s of the "
                "budget left")
            for b in benches:
                step = chunk_step(b)
                for end in range(step, totals[b] + step, step):
                    end = min(end, totals[b])
                    for cell in cells:
                        c = state["cells"].setdefault(cell_key(label, b, cell), new_cell_state())
                        if c["blocked"] or c["done"] >= end:
                            continue
                        est = _estimate(state, b, cell)
                        if est is not None and est * (end - c["done"]) > left():
                            run["stopped"] = (f"the next chunk ({label} {b} {cell.label} items {c['done'] + 1}-{end}, "
                                              f"~{est * (end - c['done']):.0f} s) would end past the time budget "
                                              f"({max(0.0, left()):.0f} s left)")
                            raise _Stop
                        first = c["done"] + 1
                        try:
                            r = run_chunk(handle, ref, cell, b, end)
                        except IsolationError:
                            raise
                        except Exception as e:  # the item, not the grid: block this cell, carry on with the others
                            c["blocked"] = f"items {first}-{end}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                            save_state(out, state)
                            log(f"[grid] {label} {b} {cell.label}: BLOCKED at {c['blocked']}")
                            continue
                        _update(c, r)
                        run["chunks"] += 1
                        run["ran"] += r["ran"]
                        save_state(out, state)
                        log(f"[grid] {label} {b} {cell.label}: {c['done']}/{totals[b]} items "
                            f"({r['ran']} run in {r['seconds']:.0f} s); {max(0.0, left()):.0f} s left")
            del handle
    except _Stop:
        pass
    rem = remaining(state, [m for m, _ in models], cells, totals)
    run["remaining"] = rem
    run["wall_s"] = clock() - t0
    save_state(out, state)
    return (EXIT_MORE if rem["items"] else EXIT_DONE), state


class _Stop(Exception):
    """The time budget is reached (internal control flow of `run_grid`)."""


# -------------------------------------------------------------------------------------------- report
def report(state: dict[str, Any], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The grid's results from its state (no model): cells (module docstring) and ``by_model``
    {model: {bench: {cell: {success: {mean, ci_low, ci_high}, paired_vs_none: {...}, n, seconds_per_episode,
    rehearsals, rejected, real_calls_in_rehearsal}}}}, the skips, and whether the grid is complete."""
    plan = state["plan"]
    totals = plan["totals"]
    cells_out, by_model, skipped = [], {}, []
    complete = True
    for m in plan["models"]:
        for b in plan["benches"]:
            st = {lab: state["cells"].get(f"{m}|{b}|{lab}") or new_cell_state() for lab in plan["cells"]}
            base = st["none"]["outcomes"]
            # paired on the items every unblocked cell scored (a blocked cell: on those of them it has)
            open_cells = [c for c in st.values() if not c["blocked"]] or list(st.values())
            common = set(base).intersection(*(set(c["outcomes"]) for c in open_cells))
            for lab, c in st.items():
                items = sorted(common & set(c["outcomes"]))
                succ = mean_ci([c["outcomes"][i] for i in items], n_boot, seed)
                diff = mean_ci([c["outcomes"][i] - base[i] for i in items], n_boot, seed)
                done = c["done"] >= totals[b]
                complete &= done or bool(c["blocked"])
                per = c["seconds"] / c["ran"] if c["ran"] else None
                cell = {"model": m, "bench": b, "condition": lab, "success": succ, "diff_vs_none": diff,
                        "done": c["done"], "total": totals[b], "complete": done, "blocked": c["blocked"],
                        "left_out_of_pairing": sorted(set(c["outcomes"]) - set(items)), "unscored": c["unscored"],
                        "errors": c["errors"], "rehearsals": c["rehearsals"], "rejected": c["rejected"],
                        "real_calls_in_rehearsal": c["real_calls_in_rehearsal"],
                        "isolation_checked": c["isolation_checked"], "ran": c["ran"], "per_episode_s": per}
                cells_out.append(cell)
                pair = lambda s: {"mean": s["mean"], "ci_low": (s["ci95"] or [None])[0],
                                  "ci_high": (s["ci95"] or [None, None])[1]}
                by_model.setdefault(m, {}).setdefault(b, {})[lab] = {
                    "success": pair(succ), "paired_vs_none": pair(diff), "n": succ["n"], "seconds_per_episode": per,
                    "rehearsals": c["rehearsals"], "rejected": c["rejected"],
                    "real_calls_in_rehearsal": c["real_calls_in_rehearsal"]}
                if c["blocked"]:
                    skipped.append(f"{m} {b} {lab}: items {c['done'] + 1}-{totals[b]} not run ({c['blocked']})")
                if c["unscored"]:
                    skipped.append(f"{m} {b} {lab}: unscored (NL assertions only), left out: {', '.join(c['unscored'])}")
                if c["errors"]:
                    skipped.append(f"{m} {b} {lab}: trials that raised (counted as failures): "
                                   + "; ".join(f"{k}: {v}" for k, v in c["errors"].items()))
    models = plan["models"]
    cells = [_cell_from_label(x) for x in plan["cells"]]
    return {"settings": {**state["settings"], "limit": plan["limit"], "n_boot": n_boot, "split": "test"},
            "totals": totals, "complete": complete, "remaining": remaining(state, models, cells, totals),
            "runs": state["runs"], "loads_s": state["loads"], "cells": cells_out, "by_model": by_model,
            "skipped": skipped}


def _cell_from_label(label: str) -> Cell:
    if label == "none":
        return Cell("none", None)
    return Cell(label.removesuffix(NO_VERIFIER), not label.endswith(NO_VERIFIER))


def markdown(rep: dict[str, Any]) -> str:
    """The table: one row per model × bench × cell; n = items paired across that model × bench's cells."""
    rows = ["| model | bench | condition | done | n paired | success [95% CI] | Δ vs none [95% CI] | rehearsals "
            "| rejected | real calls in rehearsal | s / episode |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rep["cells"]:
        diff = "—" if c["condition"] == "none" else effect_mod.ci_text(c["diff_vs_none"], signed=True)
        done = f"{c['done']}/{c['total']}" + (" blocked" if c["blocked"] else "")
        sec = "—" if c["per_episode_s"] is None else f"{c['per_episode_s']:.1f}"
        real = f"{c['real_calls_in_rehearsal']} ({c['isolation_checked']} checked)" if c["condition"] != "none" else "—"
        rows.append(f"| {c['model']} | {c['bench']} | {c['condition']} | {done} | {c['success']['n']} | "
                    f"{effect_mod.ci_text(c['success'])} | {diff} | {c['rehearsals']} | {c['rejected']} | {real} | {sec} |")
    return "\n".join(rows)


def summary_text(rep: dict[str, Any]) -> str:
    """Done / remaining / skipped in a few lines (printed after every call)."""
    rem = rep["remaining"]
    secs = "unknown (nothing timed yet)" if rem["seconds"] is None else f"~{rem['seconds'] / 60:.0f} min"
    lines = [f"[grid] {'COMPLETE' if rep['complete'] else 'INCOMPLETE'}: "
             f"{sum(c['done'] for c in rep['cells'])}/{sum(c['total'] for c in rep['cells'])} items done; "
             f"{rem['items']} to run ({secs} of chunks at the slowest per-item seconds seen), "
             f"{rem['skipped_items']} skipped by blocked cells"]
    last = rep["runs"][-1] if rep["runs"] else {}
    if last.get("stopped"):
        lines.append(f"[grid] this call stopped: {last['stopped']}")
    lines += [f"[grid] skipped: {s}" for s in rep["skipped"]] or ["[grid] skipped: nothing"]
    return "\n".join(lines)


def write_report(out: Path, rep: dict[str, Any], json_path: Path | None = None) -> Path:
    """Writes the JSON (``<out>/rehearsal_grid.json`` or `json_path`) and ``<out>/rehearsal_grid.md``."""
    path = json_path or out / REPORT_FILE
    atomic_write_text(path, json.dumps(rep, indent=2, sort_keys=True, default=str))
    atomic_write_text(out / TABLE_FILE, markdown(rep) + "\n\n" + summary_text(rep) + "\n")
    return path


# ---------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true", help="write the JSON + table from the saved grid; no model")
    ap.add_argument("--models", default="", help="LABEL=REF,... e.g. warm_start=.envace/store/warm_starts/ID/adapter")
    ap.add_argument("--trained", help="the trained model (label 'trained'): registry:NAME@VERSION, an adapter folder")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="rollout.engine of every cell "
                    "(default: %(default)s)")
    ap.add_argument("--time-budget", type=float, default=DEFAULT_BUDGET_S,
                    help="wall seconds per call, model loading included (default %(default)s; 0 = no budget)")
    ap.add_argument("--conditions", default=effect_mod.DEFAULT_CONDITIONS, help="must include none")
    ap.add_argument("--verifier", default="on,off", help="rehearsal.verifier settings: on, off or on,off (default)")
    ap.add_argument("--benches", default=effect_mod.DEFAULT_BENCHES)
    ap.add_argument("--limit", type=int, default=None, help="first N items per bench (default: all)")
    ap.add_argument("--user", default="policy", help="user simulator: policy (the evaluated model) or an "
                    "OpenAI-compatible base URL")
    ap.add_argument("--protocol", default=TAU2_ORCHESTRATOR, choices=list(PROTOCOLS))
    ap.add_argument("--max-steps", type=int, default=MAX_STEPS, help="tau2_orchestrator steps per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="", help="config overrides for every cell (a.b=v pairs, JSON/YAML)")
    ap.add_argument("--retry-blocked", action="store_true", help="run blocked cells again")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--json", help="where --report writes the JSON (default <out>/rehearsal_grid.json)")
    ap.add_argument("--append-results", action="store_true", help="--report: append the table to benchmarks/RESULTS.md")
    ap.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    return ap


def check_grid_args(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[Cell], list[str], dict[str, Any]]:
    """Everything checkable before a model loads (`rehearsal_effect.check_args` for the shared options, then the
    budget, --verifier, --user, --engine vllm's import, a saved grid's settings). Returns (models, cells, benches,
    identity settings). Raises `EnvaceError`."""
    import importlib.util

    from envace_core.config import load_config, parse_overrides

    effect_mod.check_args(args)
    if args.time_budget < 0:
        raise GridError(f"--time-budget must be >= 0 seconds (0 = no budget), got {args.time_budget}")
    verifiers = parse_verifier(args.verifier)
    if "user_model" in effect_mod.parse_user(args.user):
        raise GridError(f"--user {args.user!r}: a user model would be loaded again for every chunk (run_eval loads "
                        "it per call); use policy, or serve it and give its OpenAI-compatible URL")
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise GridError("--engine vllm needs vLLM, which is not installed here: pip install 'envace[gpu]' on a "
                        "CUDA machine, or --engine hf (the transformers engine)")
    load_config(args.profile, cell_overrides(parse_overrides(args.overrides), args.engine, False, True))
    models = effect_mod.parse_models(args.models, args.trained)
    cells = grid_cells(effect_mod.parse_conditions(args.conditions), verifiers)
    settings = {"protocol": args.protocol, "max_steps": args.max_steps, "seed": args.seed, "profile": args.profile,
                "overrides": cell_overrides(parse_overrides(args.overrides), args.engine, None, True),
                "engine": args.engine, "user": args.user}
    check_identity(load_state(Path(args.out)), settings, models, Path(args.out))
    return models, cells, effect_mod.parse_benches(args.benches), settings


def main(argv: list[str] | None = None, t0: float | None = None) -> int:
    """The command line (module docstring); `t0`: the monotonic time the budget counts from (default: this
    module's import). Exit status: 0 grid done (or --report written), 3 time budget reached with work left,
    1 a run error, 2 bad arguments (before any model loads)."""
    t0 = _T0 if t0 is None else t0
    ap = build_parser()
    args = ap.parse_args(argv)
    args.time_budget = None if args.time_budget == 0 else args.time_budget
    out = Path(args.out)

    def fail(e: Exception, code: int) -> int:
        print(f"{ap.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return code

    if args.report:
        try:
            effect_mod.check_report_targets([("--json", args.json, "json")]
                                            + ([("--results-md", args.results_md, "md")] if args.append_results else []))
            state = load_state(out)
        except EnvaceError as e:
            return fail(e, 2)
        if not state.get("plan"):
            return fail(GridError(f"--out {out}: no grid has run there yet (no {STATE_FILE})"), 2)
        rep = report(state, args.n_boot, args.seed)
        rep["command"] = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
        path = write_report(out, rep, Path(args.json) if args.json else None)
        print(markdown(rep))
        print(summary_text(rep))
        print(f"report: {path}; table: {out / TABLE_FILE}")
        if args.append_results:
            effect_mod.append_section(Path(args.results_md), f"## Private Rehearsal grid, {time.strftime('%Y-%m-%d %H:%M %Z')}"
                               f"\n\nCommand: `{rep['command']}`\n\n{markdown(rep)}\n\n{summary_text(rep)}\n")
            print(f"appended to {args.results_md}")
        return 0
    try:
        models, cells, benches, settings = check_grid_args(args)
    except EnvaceError as e:
        return fail(e, 2)
    if args.time_budget is not None and args.time_budget > 0:
        print(f"[grid] time budget {args.time_budget:.0f} s from now; --out {out}", flush=True)
    try:
        totals = {b: min(n, args.limit) if args.limit else n for b, n in effect_mod.full_items(benches).items()}
        from envace_core.config import load_config, parse_overrides

        default_verifier = load_config(args.profile, args.overrides).rehearsal.verifier
        h = Harness(args, parse_overrides(args.overrides), default_verifier)
        code, state = run_grid(args, models, cells, benches, totals, settings, load=h.load, run_chunk=h.run, t0=t0,
                               log=lambda s: print(s, flush=True))
    except EnvaceError as e:
        return fail(e, 1)
    rep = report(state, args.n_boot, args.seed)
    path = write_report(out, rep)
    print(summary_text(rep))
    print(f"[grid] {'done: run --report for the final JSON + table' if code == EXIT_DONE else 'call again to continue'}"
          f" (partial report: {path})")
    return code


if __name__ == "__main__":
    sys.exit(main())
