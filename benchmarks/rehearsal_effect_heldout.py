"""Private Rehearsal effect on held-out synthesized tasks (``rehearsal_effect.py --heldout N`` runs this).

    .venv/bin/python benchmarks/rehearsal_effect.py --heldout 30 --dataset .envace/store/datasets/<version>
        --models warm_start=ADAPTER_DIR,trained=registry:NAME@VERSION
        --conditions none,parallel:4,parallel:4+noverify,sequential:2 [--limit L] [--max-minutes M]
        [--json benchmarks/results/rehearsal_effect.json] [--out .envace/bench/rehearsal_effect] [--no-append]

Tasks: ``--heldout N`` synthesized tasks per domain (airline, retail; levels ``data.synthetic_levels``) that
no training run saw. They are built the way the curate stage builds its held-out split
(`synth.synthesize_for_curate`): one `synth.synthesize` call of n_train + N tasks per domain, seed
``--synth-seed`` (the dataset's ``data.synthetic_seed``), where n_train is the number of synthesized tasks
in the training dataset's train split; per level the first quota(n_train) tasks are the training ones
(`synth.level_quotas`) and the rest are held out. `check_disjoint` then proves the held-out set shares no
task id, no request text and no gold-action list with the dataset's train split (``--dataset PATH``, a
curated dataset folder holding tasks.parquet) and raises `BenchmarkError` naming the overlap otherwise.
The set is written to ``<out>/heldout_tasks/`` and reread on resume (checked again every time). Each
domain's tasks are interleaved over levels, so ``--limit L`` (first L per domain) covers every level.

Conditions (`parse_conditions`): ``none``, ``parallel:K``, ``sequential:K``, each rehearsing one with
``rehearsal.verifier`` on and, written ``<mode>:<K>+noverify``, off (``none`` has no verifier). They run in
the given order, every model per condition, one episode at a time (``--concurrency K``: K at a time, their
engine calls merged; seconds per episode = a batch's wall / its episodes) through `evaluation.tau2.evaluate_policy`
(protocol ``--protocol``, default opening_request, the evaluate stage's ``eval.protocol``: synthesized tasks
carry no scripted user, only a structured scenario). Every episode is appended to a JSONL cache keyed by
`evaluation.options.fingerprint` (model weights, config with the verifier flag, protocol, seed, condition),
its wall seconds to a sidecar ``timing.jsonl``; a rerun skips cached episodes. ``--max-minutes M`` stops
after the episode during which M minutes passed. The JSON is rewritten after every condition and on stop.

Per model × condition (`cell`): success = mean of tau2's ``is_successful`` over scored tasks with a 95 %
percentile bootstrap CI over tasks (`stats.mean_ci`, Efron & Tibshirani 1993 ch. 13); paired_vs_none = the
mean per-task difference (condition − none) on the tasks scored under both, bootstrap CI over those tasks
(Dror et al. 2018 §3.2, as `stages.compare`); isolation (`isolation`): the figures of the evaluate stage's
isolation line (METHOD.md §4: rehearsal never touches the real environment), real_calls_in_rehearsal must
be 0; changed_vs_none: task ids that failed without rehearsal and succeeded here (gained) and vice versa.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
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
NOVERIFY = "+noverify"


# ------------------------------------------------------------------------------------- conditions
def parse_conditions(text: str) -> list[dict[str, Any]]:
    """``none,parallel:4,parallel:4+noverify,...`` -> [{"name", "mode", "n", "verifier"}] in the given order.
    Raises `BenchmarkError` for a bad item, a duplicate, ``none+noverify`` or no ``none`` (the paired
    baseline)."""
    from envace_core.evaluation.options import parse_rehearsal
    from rehearsal_effect import comma_items

    out: list[dict[str, Any]] = []
    for item in comma_items(text, "--conditions"):
        base, noverify = (item[: -len(NOVERIFY)], True) if item.endswith(NOVERIFY) else (item, False)
        try:
            mode, n = parse_rehearsal(base)
        except EnvaceError as e:
            raise BenchmarkError(f"--conditions item {item!r}: {e}") from None
        if mode == "none" and noverify:
            raise BenchmarkError("--conditions: none has no verifier, so none+noverify means nothing")
        name = "none" if mode == "none" else f"{mode}:{n}" + (NOVERIFY if noverify else "")
        if any(c["name"] == name for c in out):
            raise BenchmarkError(f"--conditions lists {name} twice")
        out.append({"name": name, "mode": mode, "n": n, "verifier": mode != "none" and not noverify})
    if not any(c["name"] == "none" for c in out):
        raise BenchmarkError(f"--conditions {text!r} must include none: every effect is a paired difference to it")
    return out


def condition_config(cfg: Any, cond: dict[str, Any]) -> Any:
    """`cfg` with ``rehearsal.verifier`` set as `cond` asks (on for a rehearsing condition, off for
    ``+noverify``); ``none`` keeps the profile's value (`policy_agent` ignores it without rehearsal)."""
    if cond["mode"] == "none":
        return cfg
    return cfg.model_copy(update={"rehearsal": cfg.rehearsal.model_copy(update={"verifier": cond["verifier"]})})


# ------------------------------------------------------------------------------------------ tasks
def load_dataset_dir(path: str | Path) -> dict[str, list]:
    """{split: [Task]} of a curated dataset folder (tasks.parquet, as `stages.dataset.write_dataset` writes
    it). Raises `BenchmarkError` when the file is missing."""
    import pandas as pd

    from envace_core.stages.dataset import task_from_record

    f = Path(path) / "tasks.parquet"
    if not f.is_file():
        raise BenchmarkError(f"--dataset {path}: no tasks.parquet there (give a curated dataset folder, "
                             ".envace/store/datasets/<version>)")
    out: dict[str, list] = {}
    for r in pd.read_parquet(f).to_dict("records"):
        out.setdefault(r["split"], []).append(task_from_record(r))
    return out


def request_key(task: Any) -> str:
    """The task's request, normalised (lower case, single spaces): opening message + scenario text."""
    return " ".join(f"{task.first_user_message or ''} || {task.user_scenario or ''}".lower().split())


def actions_key(task: Any) -> str:
    """The task's gold actions as canonical JSON ([[name, arguments], ...] in order), with its domain."""
    return task.domain + ":" + json.dumps([[a.name, a.arguments] for a in task.gold_actions], sort_keys=True)


def check_disjoint(heldout: list, train: list) -> dict[str, Any]:
    """Proof that `heldout` and `train` share no task: no id, no request (`request_key`), no gold-action
    list (`actions_key`; a task without gold actions is compared by id and request only). Returns
    {"train_tasks", "heldout_tasks", "shared_ids": 0, "shared_requests": 0, "shared_gold_actions": 0}.
    Raises `BenchmarkError` naming every held-out task that overlaps and how."""
    ids, reqs = {t.id for t in train}, {request_key(t) for t in train}
    acts = {actions_key(t) for t in train if t.gold_actions}
    bad = {"id": [t.id for t in heldout if t.id in ids],
           "request": [t.id for t in heldout if request_key(t) in reqs],
           "gold actions": [t.id for t in heldout if t.gold_actions and actions_key(t) in acts]}
    if any(bad.values()):
        raise BenchmarkError("held-out tasks overlap the training dataset's train split: " + "; ".join(
            f"same {k}: {', '.join(v)}" for k, v in bad.items() if v))
    return {"train_tasks": len(train), "heldout_tasks": len(heldout), "shared_ids": 0, "shared_requests": 0,
            "shared_gold_actions": 0, "compared": "task id, normalised request text, gold action list"}


def interleave_levels(tasks: list) -> list:
    """Tasks of one domain reordered L1, L2, L3, L1, L2, ... (by level, then in synthesis order)."""
    from envace_core.envs.tau2.synth import level_of

    rank: dict[int, int] = {}
    keyed = []
    for i, t in enumerate(tasks):
        lv = level_of(t)
        keyed.append((rank.get(lv, 0), lv, i, t))
        rank[lv] = rank.get(lv, 0) + 1
    return [t for *_, t in sorted(keyed, key=lambda x: x[:3])]


def build_heldout(train: list, per_domain: int, levels: list[int], seed: int) -> list:
    """`per_domain` held-out synthesized tasks per synthesis domain present in `train` (module docstring),
    each domain's interleaved over levels, split `synth.HELDOUT_SPLIT`. Raises `synth.SynthesisError` when
    a level runs out of valid candidates."""
    from envace_core.envs.tau2.synth import HELDOUT_SPLIT, SYNTH_DOMAINS, level_of, level_quotas, synthesize

    out = []
    for dom in SYNTH_DOMAINS:
        n_train = sum(1 for t in train if t.domain == dom and "/synth-L" in t.id)
        quota = level_quotas(n_train, levels)
        held = []
        for t in synthesize(dom, n_train + per_domain, levels, seed):
            if quota.get(level_of(t), 0) > 0:
                quota[level_of(t)] -= 1
            else:
                held.append(t.model_copy(update={"split": HELDOUT_SPLIT}))
        out += interleave_levels(held)
    return out


def heldout_tasks(dataset_dir: str, per_domain: int, seed: int, levels: list[int], out: Path,
                  log=print) -> tuple[list, dict[str, Any]]:
    """(held-out tasks, {"dataset", "file", "disjoint": `check_disjoint`}) for `per_domain` tasks per domain,
    read from ``<out>/heldout_tasks/<dataset version>-h<N>-s<seed>-L<levels>.json`` when built before, else
    built (`build_heldout`, minutes) and written there. Disjointness from the dataset's train split is
    checked either way (raises `BenchmarkError`; a freshly built set that overlaps is not written)."""
    from envace_core.stages.dataset import task_from_record, task_record

    splits = load_dataset_dir(dataset_dir)
    train = splits.get("train", [])
    name = f"{Path(dataset_dir).name}-h{per_domain}-s{seed}-L{''.join(map(str, levels))}.json"
    f = out / "heldout_tasks" / name
    if f.is_file():
        tasks = [task_from_record(r) for r in json.loads(f.read_text())]
        proof = check_disjoint(tasks, train)
    else:
        log(f"[effect] synthesizing {per_domain} held-out tasks per domain (seed {seed}, levels {levels}) ...")
        tasks = build_heldout(train, per_domain, levels, seed)
        proof = check_disjoint(tasks, train)  # a set that overlaps the train split is not kept
        from envace_core.store.files import atomic_write_text

        f.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(f, json.dumps([task_record(t) for t in tasks], indent=1))
    ids = {t.id for t in tasks}
    proof["dataset_heldout_included"] = f"{sum(t.id in ids for t in splits.get('heldout', []))} of the dataset's " \
        f"{len(splits.get('heldout', []))} held-out tasks are in this set (same synthesis order)"
    return tasks, {"dataset": str(dataset_dir), "dataset_resolved": str(Path(dataset_dir).resolve()), "file": str(f),
                   "disjoint": proof}


def limit_per_domain(tasks: list, limit: int | None) -> list:
    """The first `limit` tasks of each domain (all when None), in the original order."""
    if limit is None:
        return list(tasks)
    seen: dict[str, int] = {}
    out = []
    for t in tasks:
        if seen.get(t.domain, 0) < limit:
            out.append(t)
            seen[t.domain] = seen.get(t.domain, 0) + 1
    return out


# ---------------------------------------------------------------------------------------- records
def isolation(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluate stage's isolation figures (`stages.evaluate._print_isolation`: "N rehearsals over M tasks
    made 0 real tool calls; K rehearsals rejected by the verifier") of one cell's records: rehearsals_made
    and rehearsals_rejected (sums of ``agent_stats``), tasks_rehearsed, real_calls_in_rehearsal (sum of
    ``isolation.real_calls_during_rehearsal`` over the records that carry it; None when none does, e.g.
    under tau2_orchestrator), isolation_checked (those records), db_hash_unchanged (all of them)."""
    rehearsed = [r for r in records if (r.get("agent_stats") or {}).get("rehearsals")]
    checked = [r["isolation"] for r in rehearsed if r.get("isolation")]
    return {"rehearsals_made": sum(int(r["agent_stats"]["rehearsals"]) for r in rehearsed),
            "rehearsals_rejected": sum(int(r["agent_stats"].get("rejected", 0)) for r in rehearsed),
            "tasks_rehearsed": len(rehearsed),
            "real_calls_in_rehearsal": sum(int(i["real_calls_during_rehearsal"]) for i in checked) if checked
            else (0 if not rehearsed else None),
            "isolation_checked": len(checked),
            "db_hash_unchanged": all(i.get("db_hash_unchanged", True) for i in checked)}


def outcomes(records: list[dict[str, Any]]) -> dict[str, float]:
    """{task id: committed success 0/1} over the scored records (success not None)."""
    return {r["task_id"]: float(r["success"]) for r in records if r.get("success") is not None}


def ci_fields(s: dict[str, Any]) -> dict[str, Any]:
    """{"mean", "ci_low", "ci_high"} of a `stats.mean_ci` result ({"mean", "ci95": [lo, hi] or None})."""
    lo, hi = s["ci95"] if s["ci95"] else (None, None)
    return {"mean": s["mean"], "ci_low": lo, "ci_high": hi}


def seconds(timings: dict[str, float], task_ids: list[str], fresh: set[str]) -> dict[str, Any]:
    """{"seconds_per_episode", "seconds_timed_episodes", "seconds_note"}: the mean wall seconds of the
    cell's episodes that were timed when they ran (this run: `fresh`; cached ones keep the time recorded
    when they ran earlier); None with the reason when no episode carries a time."""
    xs = [timings[t] for t in task_ids if t in timings]
    now = sum(1 for t in task_ids if t in fresh and t in timings)
    if not xs:
        note = "no episode timed (all from a cache without timings)" if task_ids else "no episode ran"
        return {"seconds_per_episode": None, "seconds_timed_episodes": 0, "seconds_note": note}
    return {"seconds_per_episode": sum(xs) / len(xs), "seconds_timed_episodes": len(xs),
            "seconds_note": f"{now} timed in this run, {len(xs) - now} when they ran earlier (cached now)"}


def cell(records: list[dict[str, Any]], none_records: list[dict[str, Any]] | None, timings: dict[str, float],
         fresh: set[str], n_tasks: int, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The report entry of one model × condition (module docstring). `none_records`: the same model's
    ``none`` records (None while ``none`` has not run: paired figures are then None). `n_tasks`: the
    task set's size (``complete`` says whether every task has a record)."""
    from envace_core.evaluation.stats import mean_ci

    own = outcomes(records)
    base = outcomes(none_records) if none_records is not None else {}
    both = sorted(set(own) & set(base))
    paired = mean_ci([own[t] - base[t] for t in both], n_boot, seed)
    ids = [r["task_id"] for r in records]
    return {"success": ci_fields(mean_ci([own[t] for t in sorted(own)], n_boot, seed)),
            "paired_vs_none": {**ci_fields(paired), "n": len(both)},
            "n": len(own), "n_unscored": len(records) - len(own), "n_run": len(records), "complete": len(records) >= n_tasks,
            "errors": sum(1 for r in records if r.get("error")),
            **seconds(timings, ids, fresh), **isolation(records),
            "changed_vs_none": {"gained": [t for t in both if own[t] > base[t]],
                                "lost": [t for t in both if own[t] < base[t]]},
            "changed_traces": changed_traces(records, none_records or [], own, base),
            "outcomes": own}


def changed_traces(records: list[dict[str, Any]], none_records: list[dict[str, Any]], own: dict[str, float],
                   base: dict[str, float]) -> dict[str, dict[str, Any]]:
    """{task id: {"with": trace, "without": trace}} for each task whose success differs from ``none``'s: the
    records' ``trace`` (`rehearsal.trace.episode`: rehearsals, memory, committed steps), or {"missing": why}
    where a record has none: the episode raised (its error's first line), or the record predates traces or
    comes from a protocol that stores none (tau2_orchestrator)."""
    def one(r: dict[str, Any] | None) -> dict[str, Any]:
        if r is None:
            return {"missing": "no record"}
        if r.get("trace"):
            return r["trace"]
        if r.get("error"):
            return {"missing": "the episode raised: " + str(r["error"]).strip().splitlines()[-1][:200]}
        return {"missing": f"no trace in the record (protocol {r.get('protocol', '?')}; opening_request records "
                           "hold one since the harness stores it)"}

    mine, theirs = {r["task_id"]: r for r in records}, {r["task_id"]: r for r in none_records}
    return {t: {"with": one(mine.get(t)), "without": one(theirs.get(t))}
            for t in sorted(set(own) & set(base)) if own[t] != base[t]}


def _md(text: Any, k: int) -> str:
    """`text` on one line (`roles.tools.one_line`), at most `k` characters, with ``<`` and backticks escaped for
    GitHub markdown."""
    from envace_core.roles.tools import one_line

    return one_line(text)[:k].replace("&", "&amp;").replace("<", "&lt;").replace("`", "'")


def _step_text(step: dict[str, Any], k: int = 140) -> str:
    if "call" in step:
        c = step["call"]
        obs = "(no observation)" if step.get("observation") is None else _md(step["observation"], k)
        return f"`{_md(c.get('name'), 60)}({_md(json.dumps(c.get('arguments'), sort_keys=True), k)})` → {obs}"
    return f"says: {_md(step.get('message'), k)}"


def _steps_text(steps: list[dict[str, Any]], k: int) -> str:
    return "; ".join(_step_text(s, k) for s in steps) or "(no step)"


CHANGED_SHOWN = 6  # changed tasks shown per condition in the markdown; all of them are in the JSON


def changed_markdown(report: dict[str, Any], shown: int = CHANGED_SHOWN) -> str:
    """Per task whose outcome a condition changed (the first `shown` per condition): the kept and rejected
    rehearsals, the memory, and the committed steps with and without rehearsal, from the benchmark's own
    records (`changed_traces`)."""
    out = []
    for model, conds in report.items():
        for name, c in ({} if model == "run" else conds).items():
            items = list((c.get("changed_traces") or {}).items())
            for tid, tr in items[:shown]:
                gained = tid in c["changed_vs_none"]["gained"]
                out += [f"**{model} {name}, {tid}: {'gained' if gained else 'lost'}**", ""]
                for rnd in tr["with"].get("rounds", []):
                    for x in rnd["rehearsals"]:
                        verdict = "rejected: " + _md("; ".join(x["reasons"]), 160) if x["rejected"] else "kept"
                        out.append(f"- rehearsal {x['index']} ({verdict}): {_steps_text(x['steps'], 80)}")
                    out.append(f"- memory: {_md(rnd['memory'], 600) or '(empty)'}")
                for label, t in (("committed with rehearsal", tr["with"]), ("committed without", tr["without"])):
                    text = _steps_text(t["committed"]["steps"], 140) if "committed" in t else \
                        f"(not recorded: {_md(t.get('missing') or t.get('error'), 200)})"
                    out.append(f"- {label}: {text}")
                out.append("")
            if len(items) > shown:
                out += [f"({len(items) - shown} more changed tasks of {model} {name}: `changed_traces` in the JSON)", ""]
    return "\n".join(out)


def assemble(run: dict[str, Any], records: dict[str, dict[str, list]], timings: dict[str, dict[str, dict]],
             fresh: dict[str, dict[str, set]], n_tasks: int, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The JSON report {"run": run, <model>: {<condition>: `cell`}} from {model: {condition: [records]}}
    (conditions in run order), `timings` {model: {condition: {task id: seconds}}} and `fresh` {model:
    {condition: task ids run now}}. Raises `BenchmarkError` for a model labelled "run"."""
    if "run" in records:
        raise BenchmarkError("a model may not be labelled 'run' (the report's run block)")
    out: dict[str, Any] = {"run": run}
    for model, by_cond in records.items():
        out[model] = {c: cell(rs, by_cond.get("none"), timings.get(model, {}).get(c, {}),
                              fresh.get(model, {}).get(c, set()), n_tasks, n_boot, seed)
                      for c, rs in by_cond.items()}
    return out


def markdown(report: dict[str, Any]) -> str:
    """One row per model × condition: n, success [CI], Δ vs none [CI], rehearsals (rejected), real calls in
    rehearsal, seconds per episode, tasks gained/lost vs none."""
    f = lambda s, fmt: "n/a" if s["mean"] is None else f"{fmt.format(s['mean'])} [{fmt.format(s['ci_low'])}, {fmt.format(s['ci_high'])}]"
    rows = ["| model | condition | n | success [95% CI] | Δ vs none [95% CI] | rehearsals (rejected) "
            "| real calls in rehearsal | s / episode | gained / lost vs none |", "|---|---|---|---|---|---|---|---|---|"]
    for model, conds in report.items():
        if model == "run":
            continue
        for name, c in conds.items():
            diff = "—" if name == "none" else f(c["paired_vs_none"], "{:+.3f}")
            sec = "n/a" if c["seconds_per_episode"] is None else f"{c['seconds_per_episode']:.1f}"
            ch = c["changed_vs_none"]
            part = "" if c["complete"] else " (partial)"
            rows.append(f"| {model} | {name}{part} | {c['n']} | {f(c['success'], '{:.3f}')} | {diff} | "
                        f"{c['rehearsals_made']} ({c['rehearsals_rejected']}) | {c['real_calls_in_rehearsal']} | {sec} "
                        f"| {len(ch['gained'])} / {len(ch['lost'])} |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------- run
def cache_dir(out: Path, cfg: Any, ref: str, resolved: Any, cond: dict[str, Any], protocol: str, seed: int,
              profile: str, overrides: str) -> Path:
    """``<out>/cache/<fingerprint>``: `options.fingerprint` of the model (weights included), the condition's
    config (verifier flag included), protocol and seed, plus ``heldout`` (a separate cache from run_eval's).
    ``none`` rehearses nothing, so its fingerprint sees `overrides` as their parsed mapping without the
    ``rehearsal`` settings (and `cfg`'s rehearsal section as the profile's): runs that differ only in
    rehearsal settings, or in how the same overrides are written, share its episodes."""
    from envace_core.config import load_config, parse_overrides
    from envace_core.evaluation.options import EvalOptions, fingerprint

    if cond["mode"] == "none" and overrides:
        over = parse_overrides(overrides)
        over.pop("rehearsal", None)
        overrides = json.dumps(over, sort_keys=True) if over else ""
        cfg = load_config(profile, overrides)
    opts = EvalOptions(model=ref, benches="tau2:airline", out=str(out), rehearsal="none" if cond["mode"] == "none"
                       else f"{cond['mode']}:{cond['n']}", protocol=protocol, seed=seed, profile=profile,
                       overrides=overrides)
    fp = fingerprint(opts, condition_config(cfg, cond), resolved)
    return out / "cache" / hashlib.sha256(f"heldout:{fp}".encode()).hexdigest()[:16]


def read_timings(path: Path) -> dict[str, float]:
    """{task id: seconds} from a ``timing.jsonl`` (a line that does not parse is skipped)."""
    out: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                out[str(r["task_id"])] = float(r["seconds"])
            except (ValueError, KeyError, TypeError):
                continue
    return out


def run_cell(cfg: Any, engine_for, tasks: list, cond: dict[str, Any], cdir: Path, protocol: str, seed: int,
             deadline: float | None, evaluate=None, concurrency: int = 1) -> tuple[list[dict], set[str], bool]:
    """Every task of one model × condition through `evaluate_policy` with the cache ``<cdir>/episodes.jsonl``:
    one episode at a time, or with `concurrency` K > 1 batches of up to 2 K uncached tasks, K episodes at a
    time with their engine calls merged (`evaluation.tau2.run_tau2`). Fresh episodes' wall seconds are
    appended to ``<cdir>/timing.jsonl`` (a batch's wall divided by its episodes, with "concurrency").
    `engine_for()` loads the model on first need (a fully cached cell loads nothing). Stops after the
    episode (batch) that passes `deadline` (time.monotonic() seconds; cached episodes are still read).
    Returns (records, task ids run now, stopped early)."""
    if evaluate is None:
        from envace_core.evaluation.tau2 import evaluate_policy as evaluate
    ccfg = condition_config(cfg, cond)
    cdir.mkdir(parents=True, exist_ok=True)
    cache, tfile = cdir / "episodes.jsonl", cdir / "timing.jsonl"
    records, fresh, i, size = [], set(), 0, 1 if concurrency <= 1 else 2 * concurrency
    extra = {"concurrency": concurrency} if concurrency > 1 else {}
    while i < len(tasks):
        if _cached(cache, tasks[i]):
            records += evaluate(ccfg, None, [tasks[i]], protocol, mode=cond["mode"], n=cond["n"], seed=seed,
                                cache_path=cache)["results"]
            i += 1
            continue
        if deadline is not None and time.monotonic() > deadline:
            return records, fresh, True  # cached episodes still count: they cost nothing
        batch = [tasks[i]]
        while len(batch) < size and i + len(batch) < len(tasks) and not _cached(cache, tasks[i + len(batch)]):
            batch.append(tasks[i + len(batch)])
        engine = engine_for()  # loading the model is not part of an episode's time
        t0 = time.perf_counter()
        res = evaluate(ccfg, engine, batch, protocol, mode=cond["mode"], n=cond["n"], seed=seed, cache_path=cache,
                       **extra)
        dt = (time.perf_counter() - t0) / len(batch)
        records += res["results"]
        with tfile.open("a") as fh:
            for task in batch:
                fresh.add(task.id)
                fh.write(json.dumps({"task_id": task.id, "seconds": dt, "load1": os.getloadavg()[0], **extra}) + "\n")
        i += len(batch)
    return records, fresh, False


def _cached(cache: Path, task: Any) -> bool:
    from envace_core.evaluation.tau2 import _load_cache

    return (task.domain, task.id, 0) in _load_cache(cache) if cache.is_file() else False


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Every condition (in order) × model over the held-out tasks (module docstring); writes the JSON to
    ``--json`` after every finished condition and when ``--max-minutes`` stops the run; returns the report."""
    from envace_core.config import load_config
    from envace_core.evaluation.code_ledger import begin as ledger_begin
    from envace_core.evaluation.code_ledger import code_version, record, reuse_note
    from envace_core.training.policy import load_engine
    from rehearsal_effect import parse_models, resolve_models

    conditions, models = parse_conditions(args.conditions), parse_models(args.models, args.trained)
    cfg = load_config(args.profile, args.overrides)
    resolved = resolve_models(models, cfg)  # a bad reference fails before any task synthesis
    levels = [int(x) for x in cfg.data.synthetic_levels]
    seed = args.synth_seed if args.synth_seed is not None else cfg.data.synthetic_seed
    out = Path(args.out)
    all_tasks, task_info = heldout_tasks(args.dataset, args.heldout, seed, levels, out, log)
    tasks = limit_per_domain(all_tasks, args.limit)
    t_start, load0, code = time.monotonic(), os.getloadavg(), code_version()
    deadline = None if args.max_minutes is None else t_start + 60 * args.max_minutes
    engines: dict[str, Any] = {}
    records: dict[str, dict[str, list]] = {label: {} for label, _ in models}
    timings: dict[str, dict[str, dict]] = {label: {} for label, _ in models}
    fresh: dict[str, dict[str, set]] = {label: {} for label, _ in models}
    run_block = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                 "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_avg_start": list(load0), "cpus": os.cpu_count(),
                 "dataset": task_info["dataset"], "heldout_file": task_info["file"], "disjoint": task_info["disjoint"],
                 "heldout_per_domain": args.heldout, "limit_per_domain": args.limit, "synth_seed": seed,
                 "levels": levels, "protocol": args.protocol, "seed": args.seed, "profile": args.profile,
                 "overrides": args.overrides, "n_boot": args.n_boot, "conditions": [c["name"] for c in conditions],
                 "concurrency": args.concurrency,
                 "verifier": {c["name"]: c["verifier"] for c in conditions if c["mode"] != "none"},
                 "models": {label: {"ref": ref, "label": resolved[label].label} for label, ref in models},
                 "task_ids": [t.id for t in tasks], "stopped_early": False, "code": code, "cache_notes": {},
                 "success": "tau2 is_successful (reward 1) of the committed trajectory",
                 "ci": f"95% percentile bootstrap over tasks ({args.n_boot} resamples); paired_vs_none: same tasks"}

    def write() -> dict[str, Any]:
        run_block.update(load_avg_end=list(os.getloadavg()), wall_s=time.monotonic() - t_start)
        rep = assemble(run_block, records, timings, fresh, len(tasks), args.n_boot, args.seed)
        from envace_core.store.files import atomic_write_text

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json), json.dumps(rep, indent=2, sort_keys=True, default=str))
        return rep

    def engine_for(label: str):
        def get():
            if label not in engines:
                log(f"[effect] loading {label} ({resolved[label].label})")
                engines[label] = load_engine(cfg, resolved[label])[0]
            return engines[label]
        return get

    rep: dict[str, Any] = {}
    for cond in conditions:
        for label, ref in models:
            cdir = cache_dir(out, cfg, ref, resolved[label], cond, args.protocol, args.seed, args.profile, args.overrides)
            ledger_begin(cdir)
            recs, now, stopped = run_cell(cfg, engine_for(label), tasks, cond, cdir, args.protocol, args.seed, deadline,
                                          concurrency=args.concurrency)
            records[label][cond["name"]], fresh[label][cond["name"]] = recs, now
            note = reuse_note(cdir, len(recs) - len(now), code)  # cached episodes from other code, if any
            record(cdir, len(now), code)
            if note:
                run_block["cache_notes"][f"{label} {cond['name']}"] = note
                log(f"[effect] note: {note}")
            timings[label][cond["name"]] = read_timings(cdir / "timing.jsonl")
            log(f"[effect] {label} {cond['name']}: {len(recs)}/{len(tasks)} tasks ({len(now)} run now), "
                f"success {sum(outcomes(recs).values())}/{len(outcomes(recs))}")
            if stopped:
                run_block["stopped_early"] = f"--max-minutes {args.max_minutes} passed during {label} {cond['name']}"
                log(f"[effect] stopping: {run_block['stopped_early']}; rerun the same command to resume")
                return write()
        rep = write()
    return rep


def results_section(report: dict[str, Any]) -> str:
    """The "Private Rehearsal effect" section for RESULTS.md: command, tasks, load, the table."""
    r = report["run"]
    load = lambda xs: "/".join(f"{x:.2f}" for x in xs)
    d = r["disjoint"]
    return "\n".join([
        f"## Private Rehearsal effect on held-out synthesized tasks, {r['date']}", "",
        (f"Command: `{r['command']}`; wall {r['wall_s']:.0f} s; {len(r['task_ids'])} held-out tasks "
         f"({r['heldout_per_domain']} per domain built, limit {r['limit_per_domain']}; levels {r['levels']}, "
         f"synthesis seed {r['synth_seed']}), disjoint from the train split of {r['dataset']} "
         f"({d['train_tasks']} tasks; 0 shared ids, requests, gold action lists); protocol {r['protocol']}; "
         f"{r['cpus']} CPUs, {r.get('concurrency', 1)} episode(s) at a time, load average (1/5/15 min) "
         f"{load(r['load_avg_start'])} at start, "
         f"{load(r['load_avg_end'])} at end" + (f"; stopped early: {r['stopped_early']}" if r["stopped_early"] else "")
         + f". Success: {r['success']}; CIs: {r['ci']}. `+noverify`: rehearsal.verifier off."), "",
        *[f"- note ({cell}): {note}" for cell, note in (r.get("cache_notes") or {}).items()],
        *([""] if r.get("cache_notes") else []),
        markdown(report), "", changed_markdown(report)])


def build_parser() -> argparse.ArgumentParser:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(prog="rehearsal_effect.py --heldout", description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", type=int, required=True, help="held-out synthesized tasks per domain")
    ap.add_argument("--dataset", required=True, help="the training dataset folder (tasks.parquet), e.g. "
                    ".envace/store/datasets/<version>: the held-out tasks must be disjoint from its train split")
    ap.add_argument("--models", default="base=bundled:smollm2-135m-instruct", help="LABEL=REF,...")
    ap.add_argument("--trained", help="added as label 'trained'")
    ap.add_argument("--conditions", default="none,parallel:4,parallel:4+noverify,sequential:2,parallel:2,"
                    "sequential:4,parallel:8", help="in run order; <mode>:<K>+noverify = verifier off")
    ap.add_argument("--limit", type=int, help="first N held-out tasks per domain (a chunk; default all)")
    ap.add_argument("--max-minutes", type=float, help="stop after the episode that passes M minutes")
    ap.add_argument("--concurrency", type=int, default=1, help="episodes run at once, engine calls merged "
                    "(eval.concurrency); seconds per episode are then a batch's wall / its episodes (default 1)")
    ap.add_argument("--synth-seed", type=int, help="synthesis seed (default: the profile's data.synthetic_seed)")
    ap.add_argument("--protocol", default="opening_request", choices=["opening_request", "tau2_orchestrator"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--out", default=".envace/bench/rehearsal_effect", help="cache and task-set folder")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="the report, written whole after every condition; a "
                    "file holding other results is refused (default: %(default)s)")
    ap.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--no-append", action="store_true")
    return ap


def report_clash(path: str, models: list[tuple[str, str]]) -> str | None:
    """Why writing this run's report to `path` would lose another one, else None. The report replaces the
    file whole, so an existing file may only be a report of this benchmark (a "run" block naming its task
    file) over no model label other than this run's `models` (a rerun, which resumes from the cache); the
    pooled `results/rehearsal_effect.json` holds many labels and is refused."""
    p = Path(path)
    if not p.is_file() or p.stat().st_size == 0:
        return None
    try:
        old = json.loads(p.read_text())
    except (OSError, ValueError):
        return "exists and is not a JSON report: writing this run's report would replace it; pass another --json"
    labels = {label for label, _ in models}
    others = sorted(k for k in old if k != "run") if isinstance(old, dict) else []
    is_report = isinstance(old, dict) and isinstance(old.get("run"), dict) and "heldout_file" in old["run"]
    if is_report and set(others) <= labels:
        return None
    return (f"holds other results ({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}), which this run's "
            "report would replace (it is written whole): pass --json with a new file, e.g. "
            "benchmarks/results/heldout_<what>.json, and pool reports with benchmarks/rehearsal_effect_pool.py")


def check_args(args: argparse.Namespace) -> None:
    """Everything checkable before synthesis or a model load: numbers, conditions, models (labels and
    `models.check_model_ref`), the dataset folder, --out (a folder made and written), --json (a file that can
    be written), --results-md (unless --no-append), the profile. Raises `EnvaceError`."""
    from envace_core.config import load_config
    from envace_core.store.files import writable_dir_problem, writable_file_problem
    from rehearsal_effect import check_results_md, parse_models, resolve_models

    for name, v, lo in (("--heldout", args.heldout, 1), ("--limit", args.limit, 1), ("--n-boot", args.n_boot, 100),
                        ("--concurrency", args.concurrency, 1)):
        if v is not None and v < lo:
            raise BenchmarkError(f"{name} must be >= {lo}, got {v}")
    if args.concurrency > 64:
        raise BenchmarkError(f"--concurrency must be <= 64 (eval.concurrency's bound), got {args.concurrency}")
    if args.max_minutes is not None and not 0 < args.max_minutes < float("inf"):  # nan and inf too
        raise BenchmarkError(f"--max-minutes must be a finite number > 0, got {args.max_minutes}")
    parse_conditions(args.conditions)
    models = parse_models(args.models, args.trained)
    if any(label == "run" for label, _ in models):
        raise BenchmarkError("a model may not be labelled 'run' (the report's run block)")
    if not (Path(args.dataset) / "tasks.parquet").is_file():
        raise BenchmarkError(f"--dataset {args.dataset}: no tasks.parquet there")
    for flag, why in (("--out", writable_dir_problem(args.out)),
                      ("--json", writable_file_problem(args.json) or report_clash(args.json, models))):
        if why:
            raise BenchmarkError(f"{flag} {getattr(args, flag[2:])}: {why}")
    check_results_md(args)
    cfg = load_config(args.profile, args.overrides)
    check_condition_overrides(args.overrides)
    resolve_models(models, cfg)


def check_condition_overrides(overrides: str | None) -> None:
    """Raises `BenchmarkError` when `overrides` (an ``--overrides`` text, already valid for `load_config`) sets
    rehearsal.mode, .n or .verifier: every condition sets these itself, so the override would be silently
    replaced."""
    from envace_core.config_text import parse_overrides

    reh = parse_overrides(overrides).get("rehearsal")
    for key in ("mode", "n", "verifier"):
        if isinstance(reh, dict) and key in reh:
            raise BenchmarkError(f"--overrides sets rehearsal.{key}, which every condition sets itself: give it in "
                                 "--conditions instead (MODE:N, with +noverify for the verifier off)")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
        report = run(args)
    except EnvaceError as e:
        print(f"{ap.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(markdown(report))
    r = report["run"]
    print(f"wall {r['wall_s']:.0f} s; load average {r['load_avg_start'][0]:.2f} -> {r['load_avg_end'][0]:.2f}; "
          f"report: {args.json}" + (f"; stopped early ({r['stopped_early']})" if r["stopped_early"] else ""))
    if not args.no_append:
        append_section(Path(args.results_md), results_section(report))
        print(f"appended to {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
