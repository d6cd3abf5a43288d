"""Where ACT fails after its first call: every gold turn of held-out synthesized tasks, teacher-forced.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/act_turns.py \
        --models warm_start=ADAPTER_DIR,trained=registry:NAME@VERSION \
        [--tasks .envace/bench/rehearsal_effect/heldout_tasks/<file>.json] [--limit N per domain] \
        [--json benchmarks/results/act_turns.json]

`first_call.py` measures turn 1 only. This probe measures every ACT turn k of a task's gold trajectory with
the history h_k = user message ⊕ (a_1, o_1) ⊕ .. ⊕ (a_{k-1}, o_{k-1}) of the GOLD calls and their REAL
observations (teacher forcing: each turn is judged on the history a perfect agent would have, so one
wrong turn does not hide the next). The prompts are exactly the SFT warm start's ACT examples
(`training.sft.act_examples` over the task, the last one the final answer after the last call), which are
the prompts the evaluate stage's `rollout.real_rollout` builds at that turn on a perfect trajectory (same
`roles.act_prompt_ids`, same task context; each tool result cut to ``rollout.max_observation_tokens`` as
a rollout cuts it). ACT generates as the evaluate stage does (greedy at ``eval.temperature``,
``rollout.max_new_tokens_act``, the parser's ``eval.lenient_tool_format`` / ``rollout.schema_errors``).

Each turn is classified against its target:

* a gold call: ``exact`` (name and arguments), ``repeat`` (the previous turn's gold call again, after it
  succeeded: the loop seen in held-out episodes), ``right_tool_wrong_args``, ``other_tool``, ``message``,
  ``parse_error``;
* the final answer (`envs.tau2.synth.gold_answer`): ``answer`` (a message stating every
  ``communicate_info`` item, or any message when there is none), ``message`` (a message missing an item),
  ``repeat``, ``other_tool`` (any other call), ``parse_error``.

Rates per turn kind ("first call", "later call", "answer") and per level, with 95 % percentile bootstrap
CIs over turns (`evaluation.stats.mean_ci`); with several models, each one's paired difference to the first
(`paired`: the same turns, bootstrap over turns). Records are cached per model in
``<out>/<label>-<fingerprint>.jsonl`` (the model's files, the task file's content, the ACT settings), so a
rerun resumes. Writes ``--json`` and prints a markdown table.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from first_call import (
    add_run_arguments,
    check_outputs,
    checked_models,
    load_tasks_file,
)
from rehearsal_effect import BenchmarkError
from rehearsal_effect_heldout import limit_per_domain

import envace_core  # noqa: F401  (offline environment first)

HERE = Path(__file__).resolve().parent
KINDS = ("first_call", "later_call", "answer")
OUTCOMES = ("exact", "answer", "repeat", "right_tool_wrong_args", "other_tool", "message", "parse_error")


def info_items(task) -> list[str]:
    """The task's ``communicate_info`` items (what the final answer must state; tau2's COMMUNICATE check)."""
    return list((task.source.get("evaluation_criteria") or {}).get("communicate_info") or [])


def classify(target_call: dict | None, previous_call: dict | None, call: dict | None, message: str | None,
             parse_error: str | None, items: list[str]) -> str:
    """One turn's outcome (module docstring). `target_call` / `previous_call` / `call`: {"name", "arguments"}
    or None (`target_call` None: the turn's target is the final answer); `message`: ACT's text to the user
    when it sent one; `items`: the communicate_info items the answer must state.

    >>> classify(None, {"name": "f", "arguments": {}}, {"name": "f", "arguments": {}}, None, None, [])
    'repeat'
    """
    if parse_error is not None:
        return "parse_error"
    if call is None:
        if target_call is None:
            low = (message or "").lower()
            return "answer" if all(i.lower() in low for i in items) else "message"
        return "message"
    if previous_call is not None and call == previous_call and call != target_call:
        return "repeat"
    if target_call is None:
        return "other_tool"
    if call == target_call:
        return "exact"
    return "right_tool_wrong_args" if call["name"] == target_call["name"] else "other_tool"


def fingerprint(label_key: str, ref: str, cfg: Any, task_file: str) -> str:
    """Cache key of one model's records: the model (a local folder also by its files' sha256), the ACT settings
    of the evaluate stage, the observation bound and the task file's content."""
    from envace_core.store.files import dir_checksums, sha256_path
    from envace_core.training.policy import rollout_params

    p = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=cfg.eval.max_turns,
                       lenient=cfg.eval.lenient_tool_format)
    local = Path(ref)
    weights = dir_checksums(local) if local.is_dir() else None
    blob = json.dumps(["act_turns-1", label_key, weights, repr(p), sha256_path(Path(task_file)),
                       cfg.data.policy_max_chars], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def task_turns(task, tokenizer, cfg: Any) -> list:
    """The teacher-forced ACT turns of `task` (`sft.act_examples` within ``eval.max_turns``, held-out split
    allowed, each tool result cut to ``rollout.max_observation_tokens``)."""
    from envace_core.training.sft import act_examples

    return act_examples([task], tokenizer, cfg.data.policy_max_chars, max_turns=cfg.eval.max_turns,
                        forbid_splits=(), max_observation_tokens=cfg.rollout.max_observation_tokens)


def read_cache(cache: Path) -> dict[str, list[dict[str, Any]]]:
    """The cached turn records of `cache` (a JSONL file `run_model` appends to) by task id; {} when absent.
    Raises `BenchmarkError` naming the file when it is a folder or holds a line that is not a turn record."""
    if cache.is_dir():
        raise BenchmarkError(f"the cache file {cache} is a folder; remove it or give another --out")
    done: dict[str, list[dict[str, Any]]] = {}
    if not cache.is_file():
        return done
    for n, line in enumerate(cache.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            done.setdefault(r["task_id"], []).append(r)
            r["kind"], r["outcome"], r["level"]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise BenchmarkError(f"the cache file {cache} line {n} is not a turn record ({type(e).__name__}); "
                                 "delete the file to measure that model again") from e
    return done


def run_model(cfg: Any, engine_for, tasks: list, cache: Path, log=print) -> list[dict[str, Any]]:
    """Every teacher-forced turn of every task (cached per task id in `cache`, a JSONL file of one record per
    turn)."""
    from envace_core.engines.base import SamplingParams
    from envace_core.envs.tau2.synth import level_of
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.roles.act import parse_act
    from envace_core.roles.errors import ParseError, format_error
    from envace_core.training.policy import rollout_params

    done = read_cache(cache)
    p = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=cfg.eval.max_turns,
                       lenient=cfg.eval.lenient_tool_format)
    sp = SamplingParams(max_new_tokens=p.max_new_tokens_act, temperature=p.temperature, top_p=p.top_p,
                        seed=0, role="act")
    out: list[dict[str, Any]] = []
    for task in tasks:
        if task.id in done:
            out.extend(done[task.id])
            continue
        engine = engine_for()
        ctx = task_context(task, cfg.data.policy_max_chars)
        examples = task_turns(task, engine.tokenizer, cfg)
        t0 = time.perf_counter()
        outs = engine.generate([e.prompt_ids for e in examples], sp)
        seconds = time.perf_counter() - t0
        recs, previous = [], None
        for k, (ex, o) in enumerate(zip(examples, outs)):
            text = engine.tokenizer.decode(o[0].token_ids, skip_special_tokens=True)
            call = message = perr = None
            try:
                parsed = parse_act(text, ctx.tools, strict=p.strict, lenient=p.lenient,
                                   schema_errors=p.schema_errors)
                if parsed.tool_call is not None:
                    call = {"name": parsed.tool_call.name, "arguments": parsed.tool_call.arguments}
                else:
                    message = parsed.message
            except ParseError as e:
                perr = format_error(e)
            target = None if ex.gold is None else {"name": ex.gold.name, "arguments": ex.gold.arguments}
            kind = "answer" if target is None else ("first_call" if k == 0 else "later_call")
            recs.append({"task_id": task.id, "domain": task.domain, "level": level_of(task), "turn": k,
                         "kind": kind, "target": target, "call": call, "message": message, "parse_error": perr,
                         "outcome": classify(target, previous, call, message, perr, info_items(task)),
                         "text": text, "prompt_tokens": len(ex.prompt_ids), "seconds": seconds / len(examples)})
            previous = target
        with cache.open("a") as fh:
            for r in recs:
                fh.write(json.dumps(r, sort_keys=True) + "\n")
        log(f"[act_turns] {task.id}: " + " ".join(f"{r['kind']}={r['outcome']}" for r in recs))
        out.extend(recs)
    return out


def summarize(records: list[dict[str, Any]], n_boot: int, seed: int) -> dict[str, Any]:
    """Per turn kind (and per kind × level): n and each outcome's `stats.mean_ci` over that kind's turns."""
    from envace_core.evaluation.stats import mean_ci

    def block(rs):
        return {"n": len(rs), **{o: mean_ci([float(r["outcome"] == o) for r in rs], n_boot=n_boot, seed=seed)
                                 for o in OUTCOMES}}

    res: dict[str, Any] = {}
    for kind in KINDS:
        rs = [r for r in records if r["kind"] == kind]
        if rs:
            res[kind] = block(rs)
            for lv in sorted({r["level"] for r in rs}):
                res[f"{kind} L{lv}"] = block([r for r in rs if r["level"] == lv])
    return res


def paired(records: dict[str, list[dict[str, Any]]], n_boot: int, seed: int) -> dict[str, Any]:
    """Each model after the first against the first (the reference), on the turns both measured (same task id
    and turn): per turn kind, each outcome's per-turn difference (1, 0 or −1: model minus reference) as
    `stats.mean_ci`, a paired percentile bootstrap over turns (Dror et al. 2018 §3.2, as `stages.compare`).
    `records`: label → turn records, in the --models order. Returns {"reference": label, label: {kind:
    {"n", outcome: mean_ci}}}; {} with fewer than two models."""
    from envace_core.evaluation.stats import mean_ci

    labels = list(records)
    if len(labels) < 2:
        return {}
    ref = {(r["task_id"], r["turn"]): r for r in records[labels[0]]}
    out: dict[str, Any] = {"reference": labels[0]}
    for label in labels[1:]:
        pairs = [(ref[(r["task_id"], r["turn"])], r) for r in records[label] if (r["task_id"], r["turn"]) in ref]
        out[label] = {}
        for kind in KINDS:
            ps = [(a, b) for a, b in pairs if b["kind"] == kind]
            if ps:
                out[label][kind] = {"n": len(ps), **{o: mean_ci([float(b["outcome"] == o) - float(a["outcome"] == o)
                                                                  for a, b in ps], n_boot=n_boot, seed=seed)
                                                     for o in OUTCOMES}}
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = ["| model | turns | n | " + " | ".join(OUTCOMES) + " |", "|---|---|---|" + "---|" * len(OUTCOMES)]
    for label, s in report["models"].items():
        for key, blk in s["summary"].items():
            cells = [f"{blk[o]['mean']:.2f} [{blk[o]['ci95'][0]:.2f}, {blk[o]['ci95'][1]:.2f}]" for o in OUTCOMES]
            lines.append(f"| {label} | {key} | {blk['n']} | " + " | ".join(cells) + " |")
    diff = report.get("paired") or {}
    for label, kinds in diff.items():
        if label == "reference":
            continue
        for kind, blk in kinds.items():
            cells = [f"{blk[o]['mean']:+.2f} [{blk[o]['ci95'][0]:+.2f}, {blk[o]['ci95'][1]:+.2f}]" for o in OUTCOMES]
            lines.append(f"| {label} − {diff['reference']} (paired) | {kind} | {blk['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(ap, "act_turns", "first N tasks of each domain in the file")
    args = ap.parse_args(argv)

    from envace_core.config import load_config
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.models import check_model_ref
    from envace_core.store.files import atomic_write_text
    from envace_core.training.policy import load_engine

    models = checked_models(args)
    tasks = load_tasks_file(args.tasks)
    tasks = limit_per_domain(tasks, args.limit)
    repeated = sorted({t.id for t in tasks if sum(u.id == t.id for u in tasks) > 1})
    if repeated:
        raise BenchmarkError(f"--tasks {args.tasks}: task ids repeat ({repeated[:3]}): each task is measured once")
    cfg = load_config(args.profile, args.overrides)
    for t in tasks:  # an unknown domain is named now, not after a model has loaded
        task_context(t, cfg.data.policy_max_chars)
    # every model found before any loads; errors name the --models item
    resolved = {label: check_model_ref(ref, cfg, flag=f"--models {label}") for label, ref in models}
    out, report_path = check_outputs(args)
    caches = {label: out / f"{label}-{fingerprint(resolved[label].label, ref, cfg, args.tasks)}.jsonl"
              for label, ref in models}
    for cache in caches.values():  # a corrupt cache is named before any model runs
        read_cache(cache)
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
                print(f"[act_turns] loading {label} ({resolved.label})", flush=True)
                engines.append(load_engine(cfg, resolved)[0])
            return engines[0]

        recs = run_model(cfg, engine_for, tasks, caches[label])
        report["models"][label] = {"ref": ref, "summary": summarize(recs, args.n_boot, 0)}
        report["records"][label] = recs
        engines.clear()
    report["paired"] = paired(report["records"], args.n_boot, 0)
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
