"""Tool learning demonstration: hold a tau2 retail tool out of training, add it back by rehearsal.

    .venv/bin/python benchmarks/adapt_tools.py [--tasks 16] [--iterations 3] [--seeds 0,1] [--trials 1]
        [--parent-iterations 2] [--parent-sft-steps 0] [--synthetic 12] [--model REF] [--out DIR] [--no-append]

Protocol (all on the CPU, profile cpu-smoke unless --profile):

1. Parent. The main job's stages (`stages.curate`, `rollout_and_train`, `validate`, `evaluate`,
   `register`) on tau2 retail only with ``data.hidden_tools=[find_user_id_by_name_zip]``: curate drops
   the train tasks whose gold actions call the tool and hides it from every prompt, so the parent
   never saw it. Asserted on the curated dataset: no train task's gold calls it, and no task's prompt
   (`task_context`) shows it. Train tasks: tau2 retail's train split plus ``--synthetic`` synthesized level-1
   tasks (`envs/tau2/synth.py`). ``--parent-sft-steps`` sets ``train.sft_warmup_steps``: the bundled 135M base
   emits no tool call without a warm-up (RESULTS.md, "SFT warm-up probe"), so GRPO gets no signal.
2. Adaptation, per seed in ``--seeds`` (``train.seed``): `tool_learning.adapt` from the registered
   parent with examples/tools/tools.json + examples.jsonl (the tool's tau2 schema and documentation,
   3 real calls on users no tau2 retail task names), ``--tasks`` adaptation tasks (adapt holds 30 %
   of the domain-built ones out, drawn with ``train.seed``, so each seed has its own held-out set),
   ``--iterations`` GRPO iterations, rehearsal only. Asserted: 0 real calls to the new tool during
   training (adapt's own guard count).
3. Measurement, per seed: `tool_learning.measure` of the parent and of that seed's adapted version on
   that seed's held-out tasks (they need the tool; never tau2 test-split users): real-environment
   success and REHEARSE fidelity on real transitions of the new tool. Summary per model: one seed,
   `measure`'s mean and 95% percentile-bootstrap CI over tasks; two or more, the mean of the seeds'
   means with a Student-t 95% CI over them (`learning.t_interval`). Held-out tasks whose gold call
   repeats an example's arguments are listed (they would flatter the adapted model).

Prints the table and appends it, with the exact command, to benchmarks/RESULTS.md (unless
--no-append); writes adapt_tools.json under --out (default .envace/bench/adapt_tools).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import envace_core  # noqa: F401  (offline environment first)
from envace_core import EnvaceError

DOMAIN, TOOL = "retail", "find_user_id_by_name_zip"
EXAMPLES_DIR = HERE.parent / "examples" / "tools"
METRICS = (("success", "real-environment success"), ("fidelity", "REHEARSE fidelity, new tool"))


class BenchmarkError(EnvaceError):
    """The demonstration's own checks failed (the parent saw the tool, a real call during adaptation)."""


def parent_overrides(args) -> dict[str, Any]:
    """The parent's config: retail only, the tool hidden, synthesized level-1 tasks, optional SFT."""
    over: dict[str, Any] = {
        "data": {"domains": [DOMAIN], "hidden_tools": [TOOL], "synthetic_tasks_per_domain": args.synthetic,
                 "synthetic_levels": [1], "max_test_tasks_per_domain": args.parent_test_tasks, "dvc": "off",
                 "max_train_tasks_per_domain": args.parent_tau2_train_tasks},
        "train": {"iterations": args.parent_iterations, "sft_warmup_steps": args.parent_sft_steps},
        "store": {"root": str(args.out / "store"), "registry": str(args.out / "registry")},
    }
    if args.model:
        over["model"] = {"ref": args.model}
    return over


def check_parent_never_saw(dataset: dict[str, Any]) -> dict[str, int]:
    """Counts proving the hold-out; BenchmarkError if a train task calls the tool or shows it."""
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.stages.dataset import load_dataset

    train, test = load_dataset(dataset, "train"), load_dataset(dataset, "test")
    calls = [t.id for t in train if any(a.name == TOOL for a in t.gold_actions)]
    shown = [t.id for t in train + test if TOOL in {s.name for s in task_context(t).tools}]
    if calls or shown:
        raise BenchmarkError(f"the parent's dataset exposes {TOOL}: train tasks calling it {calls[:5]}, "
                             f"prompts showing it {shown[:5]}")
    return {"train": len(train), "test": len(test)}


def example_users_in(held: list, examples: list) -> list[str]:
    """Held-out task ids whose gold calls repeat an example's arguments (a leak the reader should see)."""
    seen = [e.call.arguments for e in examples]
    return [t.id for t in held if any(a.name == TOOL and a.arguments in seen for a in t.gold_actions)]


def train_parent(cfg) -> dict[str, Any]:
    """The main job on `cfg` (as `envace train`); returns the registry entry plus the dataset."""
    from envace_core.stages.curate import curate
    from envace_core.stages.evaluate import evaluate
    from envace_core.stages.register import register
    from envace_core.stages.train import rollout_and_train
    from envace_core.stages.validate import validate
    from envace_core.stages.warm_start import warm_start

    ds = curate(cfg)
    counts = check_parent_never_saw(ds)
    tr = rollout_and_train(cfg, ds, warm_start(cfg, ds))
    val = validate(cfg, ds, tr)
    ev = evaluate(cfg, ds, tr)
    reg = register(cfg, ds, tr, val, ev, execution_id="benchmarks/adapt_tools.py")
    return {**reg, "ref": f"registry:{reg['name']}@{reg['version']}", "dataset": ds["version"],
            "counts": counts, "training": tr["history"]}


def _ci(m: dict[str, Any]) -> tuple[float, float] | None:
    ci = m.get("ci95") or m.get("ci")
    return tuple(ci) if ci else None


def over_seeds(per_seed: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One seed: its measurement as is (bootstrap CI). Several: mean and Student-t CI of seed means."""
    from learning import t_interval

    ms = [m[key] for m in per_seed if (m.get(key) or {}).get("mean") is not None]
    if not ms:
        return {"mean": None, "ci": None, "n": 0, "method": "no data"}
    if len(ms) == 1:
        return {"mean": ms[0]["mean"], "ci": _ci(ms[0]), "n": ms[0].get("n"),
                "method": ms[0].get("method", "bootstrap over items")}
    means = [m["mean"] for m in ms]
    return {"mean": statistics.fmean(means), "ci": t_interval(means), "n": len(means), "method": "t over seeds"}


def _fmt(s: dict[str, Any]) -> str:
    if s["mean"] is None:
        return "—"
    return f"{s['mean']:.3f}" + (f" [{s['ci'][0]:.3f}, {s['ci'][1]:.3f}]" if s["ci"] else "")


def markdown(report: dict[str, Any]) -> str:
    rows = ["| model | " + " | ".join(f"{label} (95% CI) | CI method, n" for _, label in METRICS) + " |",
            "|---|" + "---|---|" * len(METRICS)]
    for cond, summ in report["summary"].items():
        rows.append(f"| {cond} | " + " | ".join(f"{_fmt(summ[k])} | {summ[k]['method']}, {summ[k]['n']}"
                                               for k, _ in METRICS) + " |")
    return "\n".join(rows)


def run(args) -> dict[str, Any]:
    """Parent, adaptation per seed, measurement; the JSON-able report (also written under --out)."""
    from envace_core.config import load_config
    from envace_core.stages.dataset import load_dataset
    from envace_core.tool_learning.adapt import adapt
    from envace_core.tool_learning.inputs import load_examples, load_tools
    from envace_core.tool_learning.measure import measure
    from envace_core.tool_learning.tasks import HELD_OUT_SPLIT

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    tools = load_tools(EXAMPLES_DIR / "tools.json")
    examples = load_examples(EXAMPLES_DIR / "examples.jsonl", tools)
    base = parent_overrides(args)
    parent = train_parent(load_config(args.profile, base))
    print(f"[adapt_tools] parent {parent['ref']}: {parent['counts']['train']} train / "
          f"{parent['counts']['test']} test tasks, {TOOL} hidden ({time.perf_counter() - t0:.0f}s)")
    adapt_over = {**base, "data": {**base["data"], "hidden_tools": []}}
    runs = []
    for seed in args.seeds:
        cfg = load_config(args.profile, {**adapt_over, "train": {"iterations": args.iterations, "seed": seed}})
        res = adapt(cfg, parent["ref"], tools, examples, domain=DOMAIN, n_tasks=args.tasks,
                       name=f"{parent['name']}-tools")
        if res["real_calls_to_new_tools"] != 0:
            raise BenchmarkError(f"seed {seed}: {res['real_calls_to_new_tools']} real calls to {TOOL} in training")
        held = load_dataset(res["dataset"], HELD_OUT_SPLIT)  # drawn with train.seed: one per seed
        if not held:
            raise BenchmarkError(f"seed {seed}: no held-out task needs {TOOL}; raise --tasks")
        ref = f"registry:{res['name']}@{res['version']}"
        before = measure(cfg, parent["ref"], held, tools=[TOOL], trials=args.trials, seed=seed)
        after = measure(cfg, ref, held, tools=[TOOL], trials=args.trials, seed=seed)
        runs.append({"seed": seed, "ref": ref, "held_out_ids": [t.id for t in held], "before": before,
                     "after": after, "result": res, "example_users_held_out": example_users_in(held, examples)})
        print(f"[adapt_tools] seed {seed}: {ref}, {len(held)} held-out tasks, success "
              f"{before['success']['mean']:.3f} -> {after['success']['mean']:.3f} "
              f"({time.perf_counter() - t0:.0f}s)")
    report = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "parent": parent, "runs": runs,
        "summary": {f"parent ({TOOL} hidden)": {k: over_seeds([r["before"] for r in runs], k) for k, _ in METRICS},
                    "adapted": {k: over_seeds([r["after"] for r in runs], k) for k, _ in METRICS}},
        "wall_seconds": time.perf_counter() - t0,
    }
    (args.out / "adapt_tools.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=16, help="adaptation tasks built (train + held-out)")
    ap.add_argument("--iterations", type=int, default=3, help="GRPO iterations of each adaptation run")
    ap.add_argument("--seeds", default="0", help="comma-separated train.seed values, one adaptation each")
    ap.add_argument("--trials", type=int, default=1, help="measurement trials per held-out task")
    ap.add_argument("--parent-iterations", type=int, default=2, help="GRPO iterations of the parent")
    ap.add_argument("--parent-sft-steps", type=int, default=0, help="parent's train.sft_warmup_steps")
    ap.add_argument("--parent-test-tasks", type=int, default=2, help="tau2 retail test tasks the parent's "
                    "own evaluate stage runs (only for its registry entry; not the demonstration's measure)")
    ap.add_argument("--synthetic", type=int, default=12, help="synthesized level-1 retail train tasks")
    ap.add_argument("--parent-tau2-train-tasks", type=int, default=None,
                    help="tau2 retail train-split tasks the parent draws from (default: all); fewer keeps its "
                    "SFT warm-up on short level-1 turns, which is what teaches the 135M model the format")
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--model", help="base model ref (default: the profile's, the bundled 135M)")
    ap.add_argument("--out", type=Path, default=Path(".envace/bench/adapt_tools"))
    ap.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not args.seeds or args.tasks < 2:
        raise BenchmarkError("need --seeds and --tasks >= 2")
    report = run(args)
    table, cmd = markdown(report), " ".join([".venv/bin/python"] + sys.argv)
    print(table)
    print(f"wall {report['wall_seconds']:.0f}s; report {args.out}/adapt_tools.json")
    if not args.no_append:
        p, runs = report["parent"], report["runs"]
        leaks = sorted({i for r in runs for i in r["example_users_held_out"]})
        with open(args.results_md, "a") as f:
            f.write(f"\n### adapt_tools.py run ({time.strftime('%Y-%m-%d')}): tau2 retail, `{TOOL}` held out "
                    f"and added back\n\nCommand: `{cmd}`; wall {report['wall_seconds']:.0f} s. Parent "
                    f"`{p['ref']}` ({p['counts']['train']} train tasks, none calling or showing the tool). "
                    f"Adapted (one per seed): {', '.join('`' + r['ref'] + '`' for r in runs)}; held-out tasks "
                    f"needing the tool per seed: {', '.join(str(len(r['held_out_ids'])) for r in runs)}; real "
                    f"calls to it during adaptation: 0. Held-out tasks repeating an example's arguments: "
                    f"{', '.join(leaks) or 'none'}.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
