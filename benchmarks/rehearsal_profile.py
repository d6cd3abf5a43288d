"""Where the seconds of a rehearsing episode go: rehearsal vs committed execution, per role, prefill vs decode.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/rehearsal_profile.py --dataset .envace/store/datasets/<version>
        --model ADAPTER_DIR [--heldout 30 --synth-seed 1 --tasks 8] [--conditions none,parallel:4]
        [--overrides rehearsal.memory_content=consensus] [--json benchmarks/results/rehearsal_profile.json]

Runs ``--tasks`` of the held-out synthesized tasks that ``rehearsal_effect.py --heldout`` measures (the same
task file, every ``len // tasks``-th task so that both domains and all levels are in), each condition once,
with no episode cache, through `evaluation.tau2.evaluate_policy` (the benchmark's path). Every
`HFEngine.generate` call is recorded: phase (inside `RehearsalAgent.rehearse_round` = "rehearsal", else
"committed"), role (`SamplingParams.role`), rows, prompt tokens fed and reused from the prefix pool, tokens
generated, decode steps (the longest row: a batch decodes until its last row stops), and seconds, split into
prefill and decode where the engine has those phases. "outside generate" is the rest of the episode (the tau2
environment, scoring, verifier, memory). One untimed warm-up episode comes first.

A second part times one decode step alone (`SamplingParams(ignore_eos=True)`, a prompt of ``--decode-len``
tokens already in the prefix pool): (time of 72 new tokens − time of 8) / 64, the minimum of 2 calls, for 1 row and
for N rows, N the largest rehearsal count of the conditions. Where a step costs about the same for 1 and N rows,
N parallel rehearsals cost what their longest one decodes, and the cost ratio to no rehearsal is set by decode
steps, not by N.

Writes ``--json`` and prints a table; adds nothing to RESULTS.md (the numbers go there by hand, with the
command and the load average).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)
from envace_core import EnvaceError

HERE = Path(__file__).resolve().parent
FIELDS = ("calls", "rows", "tokens_fed", "tokens_cached", "tokens_generated", "decode_steps", "seconds",
          "prefill_s", "decode_s")


class Recorder:
    """Wraps one engine's `generate` (and, when present, its prefill and decode phases) to record every call."""

    def __init__(self, engine: Any):
        if not isinstance(getattr(engine, "stats", None), dict):
            raise EnvaceError(f"{type(engine).__name__} keeps no token counts (`stats`): this profile needs the "
                              "transformers engine (rollout.engine=hf)")
        self.engine, self.calls, self.phase = engine, [], "committed"
        self._timers = {"prefill_s": 0.0, "decode_s": 0.0}
        for name, key in (("_prefill_padded", "prefill_s"), ("_prefill_unpadded", "prefill_s"), ("_decode", "decode_s")):
            if hasattr(engine, name):
                setattr(engine, name, self._timed(getattr(engine, name), key))
        self._generate = engine.generate
        engine.generate = self.generate

    def _timed(self, fn, key: str):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._timers[key] += time.perf_counter() - t0
        return run

    def generate(self, prompts, params):
        s0, t0 = dict(self.engine.stats), time.perf_counter()
        self._timers.update(prefill_s=0.0, decode_s=0.0)
        out = self._generate(prompts, params)
        st = self.engine.stats
        self.calls.append({"phase": self.phase, "role": params.role or "?", "calls": 1,
                           "rows": sum(len(o) for o in out),
                           "tokens_fed": st["prompt_tokens"] - s0["prompt_tokens"],
                           "tokens_cached": st["cached_tokens"] - s0["cached_tokens"],
                           "tokens_generated": st["generated_tokens"] - s0["generated_tokens"],
                           "decode_steps": max((len(c.token_ids) for o in out for c in o), default=0),
                           "seconds": time.perf_counter() - t0, **self._timers})
        return out


def summarise_calls(calls: list[dict]) -> dict[str, dict[str, float]]:
    """{"phase/role": {FIELDS summed}} plus "all"."""
    parts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for c in calls:
        for key in (f"{c['phase']}/{c['role']}", "all"):
            for f in FIELDS:
                parts[key][f] += c[f]
    return {k: {f: round(v[f], 3) for f in FIELDS} for k, v in sorted(parts.items())}


def decode_step_ms(engine: Any, length: int, rows: int) -> float:
    """ms per decode step for `rows` rows of a `length`-token prompt (module docstring)."""
    from envace_core.engines.base import SamplingParams

    tok = engine.tokenizer
    body = tok.encode("You are a customer service agent in the airline domain. Follow the policy. " * 200)
    prompts = [body[:length - 8] + tok.encode(f" row {r} asks")[:8] for r in range(rows)]

    def run(n_new: int) -> float:
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=n_new, temperature=1.0, seed=1, ignore_eos=True))
        return time.perf_counter() - t0

    run(1)  # the prompts' KV into the prefix pool
    short, long_ = min(run(8) for _ in range(2)), min(run(72) for _ in range(2))
    return round(1000 * (long_ - short) / 64, 2)


def profile_conditions(args: argparse.Namespace, cfg: Any, engine: Any, rec: Recorder, tasks: list,
                       conditions: list[dict[str, Any]]) -> dict[str, Any]:
    """One untimed warm-up episode, then every condition over `tasks` with `rec` recording (module docstring)."""
    from rehearsal_effect_heldout import condition_config

    from envace_core.evaluation.tau2 import evaluate_policy

    evaluate_policy(cfg, engine, tasks[:1], args.protocol, mode="none", n=0, seed=args.seed)  # warm-up
    out: dict[str, Any] = {}
    for cond in conditions:
        rec.calls.clear()
        t0 = time.perf_counter()
        res = evaluate_policy(condition_config(cfg, cond), engine, tasks, args.protocol, mode=cond["mode"],
                              n=cond["n"], seed=args.seed)
        wall = time.perf_counter() - t0
        parts = summarise_calls(rec.calls)
        in_gen = parts.get("all", {}).get("seconds", 0.0)
        out[cond["name"]] = {
            "episodes": len(tasks), "wall_s": round(wall, 2), "wall_s_per_episode": round(wall / len(tasks), 3),
            "outside_generate_s": round(wall - in_gen, 2), "parts": parts,
            "successes": sum(1 for r in res["results"] if r.get("success")),
            "load_avg_after": os.getloadavg()[0]}
    none = out.get("none")
    for name, c in out.items():
        if none and name != "none":
            c["seconds_ratio_vs_none"] = round(c["wall_s"] / none["wall_s"], 3)
            steps = [x["parts"].get("all", {}).get("decode_steps", 0) for x in (c, none)]
            c["decode_steps_ratio_vs_none"] = round(steps[0] / max(1, steps[1]), 3)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rehearsal_effect_heldout import (
        heldout_tasks,
        limit_per_domain,
        parse_conditions,
    )
    from speed import cpu_flags

    from envace_core.config import load_config
    from envace_core.models import resolve_model_ref
    from envace_core.rehearsal.agent import RehearsalAgent
    from envace_core.training.policy import load_engine

    conditions = parse_conditions(args.conditions)
    cfg = load_config(args.profile, args.overrides)
    levels = [int(x) for x in cfg.data.synthetic_levels]
    seed = args.synth_seed if args.synth_seed is not None else cfg.data.synthetic_seed
    tasks, info = heldout_tasks(args.dataset, args.heldout, seed, levels, Path(args.out))
    tasks = limit_per_domain(tasks, args.heldout)
    tasks = tasks[::max(1, len(tasks) // args.tasks)][:args.tasks]
    resolved = resolve_model_ref(args.model, cfg.store.registry, base_ref=cfg.model.ref)
    engine = load_engine(cfg, resolved)[0]
    rec = Recorder(engine)
    inner = RehearsalAgent.rehearse_round

    def rehearse_round(self, *a, **k):
        rec.phase = "rehearsal"
        try:
            return inner(self, *a, **k)
        finally:
            rec.phase = "committed"

    load0 = os.getloadavg()
    RehearsalAgent.rehearse_round = rehearse_round
    try:
        out = profile_conditions(args, cfg, engine, rec, tasks, conditions)
    finally:
        RehearsalAgent.rehearse_round = inner
    n_max = max([c["n"] for c in conditions if c["mode"] != "none"] or [1])
    micro = {f"rows={r}": decode_step_ms(engine, args.decode_len, r) for r in sorted({1, n_max})}
    commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short=12", "HEAD"],
                            check=False, capture_output=True, text=True).stdout.strip()
    return {"run": {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                    "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit, "cpu": cpu_flags()["model"],
                    "cpus": os.cpu_count(), "torch_threads": __import__("torch").get_num_threads(),
                    "load_avg_start": list(load0), "load_avg_end": list(os.getloadavg()),
                    "model": {"ref": args.model, "label": resolved.label}, "heldout_file": info["file"],
                    "task_ids": [t.id for t in tasks], "overrides": args.overrides, "protocol": args.protocol,
                    "seed": args.seed},
            "conditions": out, "decode_ms_per_step": {"prompt_tokens": args.decode_len, **micro}}


def markdown(rep: dict[str, Any]) -> str:
    head = ("| condition | part | calls | rows | tokens fed / reused | generated | decode steps | s | prefill s | "
            "decode s | ms / step |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in rep["conditions"].items():
        for part, p in c["parts"].items():
            ms = 1000 * p["decode_s"] / p["decode_steps"] if p["decode_steps"] else 0.0
            lines.append(f"| {name} | {part} | {p['calls']:.0f} | {p['rows']:.0f} | {p['tokens_fed']:.0f} / "
                         f"{p['tokens_cached']:.0f} | {p['tokens_generated']:.0f} | {p['decode_steps']:.0f} | "
                         f"{p['seconds']:.1f} | {p['prefill_s']:.1f} | {p['decode_s']:.1f} | {ms:.1f} |")
        lines.append(f"| {name} | outside generate | | | | | | {c['outside_generate_s']:.1f} | | | |")
        extra = "" if name == "none" else (f"; {c['seconds_ratio_vs_none']}× none's seconds, "
                                           f"{c['decode_steps_ratio_vs_none']}× its decode steps")
        lines.append(f"| {name} | **episode** | | | | | | **{c['wall_s_per_episode']:.2f} / episode** | | | "
                     f"{c['successes']}/{c['episodes']} succeed{extra} |")
    d = rep["decode_ms_per_step"]
    lines.append("")
    lines.append(f"One decode step alone, {d['prompt_tokens']}-token prompt: " +
                 ", ".join(f"{k}: {v} ms" for k, v in d.items() if k != "prompt_tokens"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, help="the training dataset folder (tasks.parquet)")
    ap.add_argument("--model", required=True, help="a model reference (adapter folder, registry:NAME@VERSION, ...)")
    ap.add_argument("--heldout", type=int, default=30, help="held-out tasks per domain of the task file")
    ap.add_argument("--synth-seed", type=int, help="synthesis seed (default: the profile's data.synthetic_seed)")
    ap.add_argument("--tasks", type=int, default=8, help="tasks profiled (spread over the held-out set)")
    ap.add_argument("--conditions", default="none,parallel:4", help="as rehearsal_effect.py --heldout's")
    ap.add_argument("--protocol", default="opening_request", choices=["opening_request", "tau2_orchestrator"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-len", type=int, default=1700, help="prompt tokens of the decode-step timing")
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")
    ap.add_argument("--out", default=".envace/bench/rehearsal_effect", help="the held-out task-set folder")
    ap.add_argument("--json", default=str(HERE / "results" / "rehearsal_profile.json"))
    return ap


def check_args(args: argparse.Namespace) -> None:
    """What can fail before tasks are synthesized or a model loads: the profile and overrides, the model
    reference (`models.check_model_ref`), the ``--out`` folder and the ``--json`` file's folder (made and tried
    now, so that a finished run is never lost to them). Raises `EnvaceError`."""
    from rehearsal_effect import check_report_targets
    from rehearsal_effect_heldout import check_condition_overrides

    from envace_core.config import load_config
    from envace_core.models import check_model_ref
    from envace_core.store.files import writable_dir_problem, writable_file_problem

    cfg = load_config(args.profile, args.overrides)
    check_condition_overrides(args.overrides)
    check_model_ref(args.model, cfg)
    for flag in ("--out", "--json"):  # '' would be the current folder
        if not getattr(args, flag[2:]).strip():
            raise EnvaceError(f"{flag} is empty; give a " + ("folder" if flag == "--out" else "file path"))
    for flag, why in (("--out", writable_dir_problem(args.out)), ("--json", writable_file_problem(args.json))):
        if why:
            raise EnvaceError(f"{flag} {getattr(args, flag[2:])}: {why}")
    check_report_targets([("--json", args.json, "json")])


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.tasks < 1 or args.heldout < 1 or args.decode_len < 16:
        ap.error("--tasks and --heldout must be >= 1, --decode-len >= 16")
    if not (Path(args.dataset) / "tasks.parquet").is_file():
        ap.error(f"--dataset {args.dataset}: no tasks.parquet there")
    try:
        check_args(args)
        rep = run(args)
    except EnvaceError as e:
        print(f"{ap.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    from envace_core.store.files import atomic_write_text

    atomic_write_text(Path(args.json), json.dumps(rep, indent=2))
    print(markdown(rep))
    r = rep["run"]
    print(f"load average {r['load_avg_start'][0]:.2f} -> {r['load_avg_end'][0]:.2f}; report: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
