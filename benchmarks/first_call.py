"""Where ACT fails on held-out synthesized tasks: its first committed tool call against the gold first action.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/first_call.py \
        --models base=bundled:smollm2-135m-instruct,warm_start=ADAPTER_DIR,trained=registry:NAME@VERSION \
        [--tasks .envace/bench/rehearsal_effect/heldout_tasks/<file>.json] [--limit N] \
        [--json benchmarks/results/first_call.json]

Every synthesized level 1–3 task opens with a look-up whose arguments are in the user's first message
(`envs.tau2.synth`: the reservation / order / user id is stated there), so the first ACT turn decides the
episode: a wrong id there gives a "not found" observation and, on the tiny model, a loop of the same call
until ``eval.max_turns`` (the held-out Private Rehearsal chunk ended 16 of 20 episodes that way). This probe
runs exactly that turn, as the evaluate stage does (`evaluation.tau2.policy_agent`'s ACT settings: greedy at
``eval.temperature``, ``rollout.max_new_tokens_act``, the real environment reset to the task), one turn only
(`rollout.real_rollout` with max_turns = 1), and classifies it:

* ``exact``: tool name and arguments equal the gold first action's;
* ``right_tool_wrong_args``: the gold tool, other arguments; of these, ``copy_error`` when an id-like
  gold value (a string argument) was not reproduced verbatim though it is in the user's message;
* ``other_tool``: a different known tool; ``message``: text to the user instead of a call;
* ``parse_error`` / other terminations as `rollout` names them;
* independently, ``grounded``: a call whose every string argument value is in the user's message (the id,
  e-mail or name was copied, not made up), whichever tool it calls.

Rates are over tasks with a 95 % percentile bootstrap CI (`evaluation.stats.mean_ci`), per model and per
level and domain. Per-task records are cached in ``<out>/<label>-<fingerprint>.jsonl`` (`fingerprint`: the
model, a local folder's file checksums, the task file's content, the ACT settings), so a rerun resumes. Writes ``--json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rehearsal_effect import (
    BenchmarkError,
    check_report_targets,
    parse_models,
    resolve_models,
)

import envace_core  # noqa: F401  (offline environment first)

HERE = Path(__file__).resolve().parent
DEFAULT_TASKS = ".envace/bench/rehearsal_effect/heldout_tasks/f676219993e898f4-h30-s0-L123.json"
OUTCOMES = ("exact", "right_tool_wrong_args", "other_tool", "message", "parse_error", "other")


def _strings(value: Any) -> list[str]:
    """Every string leaf of a JSON value (argument values), in order."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def grounded(arguments: Any, request: str) -> bool:
    """True when every string argument value of a call appears verbatim in the user's `request` (the
    synthesized tasks state every id, e-mail and name there; a value found nowhere was made up)."""
    return all(v in request for v in _strings(arguments))


def classify(gold: dict[str, Any], action: Any, termination: str | None, request: str) -> dict[str, Any]:
    """The first turn's outcome (module docstring) for gold first action `gold` ({"name", "arguments"}),
    the turn's tool call `action` (None when it sent text or failed) and its `termination`."""
    rec: dict[str, Any] = {"gold": gold, "call": None, "copy_error": False, "grounded": False}
    if action is None:
        rec["outcome"] = "parse_error" if termination == "parse_error" else (
            "message" if termination == "agent_message" else "other")
        rec["termination"] = termination
        return rec
    rec["call"] = {"name": action.name, "arguments": action.arguments}
    rec["grounded"] = grounded(action.arguments, request)
    if action.name != gold["name"]:
        rec["outcome"] = "other_tool"
    elif action.arguments == gold["arguments"]:
        rec["outcome"] = "exact"
    else:
        rec["outcome"] = "right_tool_wrong_args"
        made = set(_strings(action.arguments))
        rec["copy_error"] = any(s in request and s not in made for s in _strings(gold["arguments"]))
    return rec


def fingerprint(label_key: str, ref: str, cfg: Any, task_file: str) -> str:
    """Cache key of one model's records: the model (its resolved label; for a local folder also every
    file's sha256, so retraining into the same path is a new key), the ACT settings and the task file's
    content (not its name)."""
    from envace_core.store.files import dir_checksums, sha256_path
    from envace_core.training.policy import rollout_params

    p = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=1, lenient=cfg.eval.lenient_tool_format)
    local = Path(ref)
    weights = dir_checksums(local) if local.is_dir() else None
    blob = json.dumps([label_key, weights, repr(p), sha256_path(Path(task_file)), cfg.data.policy_max_chars],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_tasks_file(path: str) -> list:
    """The held-out tasks of `path` (a JSON list of dataset task records, as `rehearsal_effect.py --heldout`
    writes). Raises `BenchmarkError` naming the file for anything else: unreadable, not JSON, not a
    non-empty list of records, or a task without a gold first action of a known shape."""
    from envace_core.stages.dataset import task_from_record

    f = Path(path)
    if not f.is_file():
        there = sorted(Path(DEFAULT_TASKS).parent.glob("*.json"))
        raise BenchmarkError(f"--tasks {path}: " + ("a folder" if f.is_dir() else "no such file") + "; give the JSON "
                             "task file rehearsal_effect.py --heldout writes" + (
                                 f" (here: {', '.join(str(p) for p in there[:3])})" if there else ""))
    try:
        records = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchmarkError(f"--tasks {path}: not a readable JSON file ({e})") from e
    if not isinstance(records, list) or not records:
        raise BenchmarkError(f"--tasks {path}: expected a non-empty JSON list of task records")
    tasks = []
    for k, r in enumerate(records):
        try:
            task = task_from_record(r)
        except Exception as e:
            raise BenchmarkError(f"--tasks {path}: record {k} is not a task record ({type(e).__name__}: {e})") from e
        if not task.gold_actions:
            raise BenchmarkError(f"--tasks {path}: task {task.id} has no gold action to compare the first call with")
        tasks.append(task)
    return tasks


def run_model(cfg: Any, engine_for, tasks: list, cache: Path, log=print) -> list[dict[str, Any]]:
    """The first ACT turn of every task (cached per task id in `cache`, a JSONL file)."""
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.synth import level_of
    from envace_core.evaluation.tau2 import task_context
    from envace_core.training.policy import rollout_params
    from envace_core.training.rollout import real_rollout

    done = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["task_id"]] = r
    requests = {t.id: t.first_user_message for t in tasks}
    for r in done.values():  # records written before `grounded` existed
        if "grounded" not in r and r["task_id"] in requests:
            r["grounded"] = bool(r["call"]) and grounded(r["call"]["arguments"], requests[r["task_id"]])
    p = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=1, lenient=cfg.eval.lenient_tool_format)
    out = []
    for task in tasks:
        if task.id in done:
            out.append(done[task.id])
            continue
        engine = engine_for()
        env = Tau2Environment(task.domain)
        env.reset(task)
        ctx = task_context(task, cfg.data.policy_max_chars)
        t0 = time.perf_counter()
        traj = real_rollout(engine, ctx, env, p, seed=0)
        step = traj.steps[0] if traj.steps else None
        action = step.action if step is not None else None
        termination = traj.termination if action is None else None
        if action is None and step is not None and step.message:
            termination = "agent_message"
        gold = task.gold_actions[0]
        rec = classify({"name": gold.name, "arguments": gold.arguments}, action, termination, ctx.first_user_message)
        g = traj.generations[0] if traj.generations else None
        rec.update(text=g.text if g is not None else None, parse_detail=g.parse_error if g is not None else None,
                   task_id=task.id, domain=task.domain, level=level_of(task), seconds=time.perf_counter() - t0,
                   observation_error=bool(step is not None and step.observation is not None
                                          and step.observation.error))
        with cache.open("a") as fh:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
        log(f"[first_call] {task.id}: {rec['outcome']}{' (copy error)' if rec['copy_error'] else ''}"
            f" {json.dumps(rec['call'])[:160]}")
        out.append(rec)
    return out


def summarize(records: list[dict[str, Any]], n_boot: int, seed: int) -> dict[str, Any]:
    """Per outcome `stats.mean_ci` ({mean, ci95, n, method}) over tasks, copy_error and grounded the same, n; and
    the same per level and per domain."""
    from envace_core.evaluation.stats import mean_ci

    def block(rs):
        res = {"n": len(rs)}
        for o in OUTCOMES:
            res[o] = mean_ci([float(r["outcome"] == o) for r in rs], n_boot=n_boot, seed=seed)
        for k in ("copy_error", "grounded"):
            res[k] = mean_ci([float(r[k]) for r in rs], n_boot=n_boot, seed=seed)
        return res

    levels = sorted({r["level"] for r in records})
    domains = sorted({r["domain"] for r in records if "domain" in r})
    return {"all": block(records),
            "by_level": {str(lv): block([r for r in records if r["level"] == lv]) for lv in levels},
            "by_domain": {d: block([r for r in records if r.get("domain") == d]) for d in domains}}


def markdown(report: dict[str, Any]) -> str:
    cols = ["exact", "right_tool_wrong_args", "copy_error", "other_tool", "grounded", "message", "parse_error"]
    lines = ["| model | tasks | n | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for label, s in report["models"].items():
        for lv, blk in [("all", s["all"]), *(("level " + k, v) for k, v in s["by_level"].items()),
                        *s.get("by_domain", {}).items()]:
            cells = [f"{blk[c]['mean']:.2f} [{blk[c]['ci95'][0]:.2f}, {blk[c]['ci95'][1]:.2f}]" for c in cols]
            lines.append(f"| {label} | {lv} | {blk['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_run_arguments(ap: argparse.ArgumentParser, name: str, limit_help: str) -> None:
    """The arguments `first_call.py` and `act_turns.py` share; `name` names the default cache folder and report."""
    ap.add_argument("--models", required=True, help="LABEL=REF,... (bundled:..., an adapter folder, registry:...)")
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help="held-out task file (rehearsal_effect.py --heldout writes it)")
    ap.add_argument("--limit", type=int, help=limit_help)
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--out", default=f".envace/bench/{name}")
    ap.add_argument("--json", default=str(HERE / "results" / f"{name}.json"))
    ap.add_argument("--n-boot", type=int, default=2000)


def checked_models(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, ref) of ``--models`` after checking ``--limit``, ``--n-boot`` and that labels can name cache files.
    Raises `BenchmarkError`."""
    if args.limit is not None and args.limit < 1:
        raise BenchmarkError(f"--limit must be >= 1, got {args.limit}")
    if args.n_boot < 1:
        raise BenchmarkError(f"--n-boot must be >= 1, got {args.n_boot}")
    models = parse_models(args.models, None)
    bad = [label for label, _ in models if not re.fullmatch(r"[A-Za-z0-9_.-]+", label)]
    if bad:
        raise BenchmarkError(f"--models labels name cache files: use letters, digits, '_', '.', '-' ({bad})")
    return models


def check_outputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """(``--out``, ``--json``) as paths, both folders made and writable, before any model runs: a report that cannot
    be written would lose the run. Raises `BenchmarkError` for a report path that is a folder, the task file,
    ``--out`` or a folder above it, and for a folder that cannot be made or written (tried with a temporary file:
    `os.access` says yes on /proc for root)."""
    from envace_core.store.files import writable_dir_problem

    for flag in ("out", "json"):
        if not getattr(args, flag).strip():
            raise BenchmarkError(f"--{flag} is empty; give a " + ("folder" if flag == "out" else "file path"))
    out, report_path = Path(args.out), Path(args.json)
    for flag, path in (("--out", out), ("--json", report_path)):
        try:
            path.exists()
        except OSError as e:  # a name longer than the file system allows (ENAMETOOLONG), ...
            raise BenchmarkError(f"{flag}: cannot use the path ({e.strerror or e})") from None
    if report_path.is_dir():
        raise BenchmarkError(f"--json {args.json} is a folder; give a file path")
    rp, op = report_path.resolve(), out.resolve()
    if rp == Path(args.tasks).resolve():
        raise BenchmarkError(f"--json {args.json} is the --tasks file: the report would overwrite the tasks")
    if rp == op or rp in op.parents:
        raise BenchmarkError(f"--json {args.json} is --out {args.out} or a folder above it; give another file")
    check_report_targets([("--json", args.json, "json")])
    for flag, d in (("--out", out), ("--json", report_path.parent)):
        why = writable_dir_problem(d)
        if why:
            raise BenchmarkError(f"{flag}: {why}")
    return out, report_path


def main(argv=None) -> int:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(ap, "first_call", "first N tasks of the file")
    args = ap.parse_args(argv)

    from envace_core.config import load_config
    from envace_core.store.files import atomic_write_text
    from envace_core.training.policy import load_engine

    models = checked_models(args)
    tasks = load_tasks_file(args.tasks)
    tasks = tasks[:args.limit] if args.limit else tasks
    cfg = load_config(args.profile, args.overrides)
    resolved = resolve_models(models, cfg)
    out, report_path = check_outputs(args)
    t0, load0 = time.monotonic(), os.getloadavg()
    report: dict[str, Any] = {"run": {"command": " ".join([sys.executable, *sys.argv]), "tasks": args.tasks,
                                      "n_tasks": len(tasks), "load_avg_start": list(load0),
                                      "date": time.strftime("%Y-%m-%d %H:%M %Z"), "profile": args.profile,
                                      "overrides": args.overrides, "temperature": cfg.eval.temperature,
                                      "max_new_tokens_act": cfg.rollout.max_new_tokens_act},
                              "models": {}, "records": {}}
    for label, ref in models:
        engines: list = []

        def engine_for(resolved=resolved[label], engines=engines, label=label):
            if not engines:
                print(f"[first_call] loading {label} ({resolved.label})", flush=True)
                engines.append(load_engine(cfg, resolved)[0])
            return engines[0]

        cache = out / f"{label}-{fingerprint(resolved[label].label, ref, cfg, args.tasks)}.jsonl"
        recs = run_model(cfg, engine_for, tasks, cache)
        report["models"][label] = {"ref": ref, **summarize(recs, args.n_boot, 0)}
        report["records"][label] = recs
        engines.clear()
    report["run"].update(wall_s=time.monotonic() - t0, load_avg_end=list(os.getloadavg()))
    atomic_write_text(report_path, json.dumps(report, indent=2, sort_keys=True, default=str))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    from envace_core import EnvaceError

    try:
        sys.exit(main())
    except (BenchmarkError, EnvaceError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
