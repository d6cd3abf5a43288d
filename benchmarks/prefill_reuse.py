"""A turn's prefill after a reused prefix, before vs after a change, from one run: what every later turn of a
rollout, an evaluation episode or a private rehearsal pays on `HFEngine` with its prefix pool.

    .venv/bin/python benchmarks/prefill_reuse.py --before 616dc95 [--rounds 3] [--calls 6]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prefill_reuse.py --before HEAD --quick   # smoke run

Run it alone on an idle machine (no other torch process: they stall each other on 2 cores).

Each variant runs in a fresh process (the order rotated every round): ``before`` is envace_core of git revision
--before (a detached worktree, made and removed here), ``after`` this checkout's. Both load the bundled model in
the compute dtype speed.py uses (``resolve_compute_dtype("auto", "cpu")``) into an engine with the product's
prefix pool (--pool-tokens, the ``rollout.prefix_cache_tokens`` default), prefill one ~--prompt-tokens chat
prompt (engine_bench.make_prompt) once, so that the pool holds it, then time --calls engine calls per case,
each one new token (no decode to speak of) for prompts made of that prompt plus a tail never seen before
(token ids drawn at random, seed 0: the cost of a prefill does not depend on which tokens; so each call
reuses exactly the first prompt, checked, and every call's reused tokens are in the JSON):

  1xN   one prompt with an N-token tail (a turn's new tokens: a tool result and the chat template),
  4xN   four such prompts in one call (a group's trajectories, or N parallel rehearsals, after their first turn),

for N in --tails. Per case and variant: seconds (median of the calls, and the minimum), minor page faults and
system CPU seconds per call (getrusage: the kernel's share, from fresh memory the call touches), and
the ratio after / before of the medians. Writes --json (default benchmarks/results/prefill_reuse.json) with
every raw figure, the command line, the load average at start and end, the CPU's bf16 flags and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # decode_ab and engine_bench live beside this script
    sys.path.insert(0, HERE)
DEFAULT_JSON = os.path.join(HERE, "results", "prefill_reuse.json")
QUICK = {"prompt_tokens": 200, "tails": "16", "calls": 2, "rounds": 1}


def worker(src: str, spec_path: str) -> int:
    """One variant: the cases on HFEngine from the envace_core under `src`; prints one JSON line."""
    sys.path.insert(0, src)
    sys.path.insert(1, HERE)
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    import envace_core  # first: engine_bench puts this checkout on sys.path too
    from envace_core.engines.base import SamplingParams, resolve_compute_dtype
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model, load_tokenizer, resolve_model
    from engine_bench import make_prompt

    if os.path.dirname(os.path.abspath(envace_core.__file__)) != os.path.join(os.path.abspath(src), "envace_core"):
        raise RuntimeError(f"envace_core came from {envace_core.__file__}, not {src}")
    model_dir = resolve_model(spec["model"])
    tok = load_tokenizer(model_dir)
    dtype = resolve_compute_dtype("auto", "cpu")
    eng = HFEngine(load_model(model_dir), tok, compute_dtype=dtype, max_batch_size=8,
                   prefix_cache_tokens=spec["pool_tokens"])
    sp = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0, seed=1, ignore_eos=True)
    base = make_prompt(tok, spec["prompt_tokens"], 0)
    eng.generate([base], sp)
    draw = torch.Generator().manual_seed(0)
    vocab = len(tok)

    def tail(n: int) -> list[int]:  # token ids drawn at random: no two tails share a first token, in practice
        return torch.randint(100, vocab, (n,), generator=draw).tolist()

    def call(rows: int, n: int) -> dict:
        prompts = [base + tail(n) for _ in range(rows)]
        cached = eng.stats["cached_tokens"]
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        eng.generate(prompts, sp)
        seconds = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        reused = eng.stats["cached_tokens"] - cached
        if not rows * len(base) <= reused <= rows * (len(base) + 1):
            raise RuntimeError(f"a call reused {reused} tokens, not the first prompt's {len(base)} per row: "
                               "the case would measure another prefill")
        return {"seconds": seconds, "minor_faults": r1.ru_minflt - r0.ru_minflt, "system_s": r1.ru_stime - r0.ru_stime,
                "reused_tokens": reused}

    cases = {}
    for n in spec["tails"]:
        for rows in (1, 4):
            call(rows, n)  # warm-up
            runs = [call(rows, n) for _ in range(spec["calls"])]
            cases[f"{rows}x{n}"] = {"seconds": statistics.median(r["seconds"] for r in runs),
                                    "seconds_min": min(r["seconds"] for r in runs),
                                    "minor_faults": statistics.median(r["minor_faults"] for r in runs),
                                    "system_s": statistics.median(r["system_s"] for r in runs), "calls": runs}
    print(json.dumps({"compute_dtype": str(dtype), "threads": torch.get_num_threads(), "prompt_tokens": len(base),
                      "cases": cases}))
    return 0


def summarise(runs: dict[str, list[dict]]) -> dict:
    """variant -> rounds of worker output  ->  case -> {variant: medians over rounds, after_over_before}."""
    out = {}
    for case in next(iter(runs.values()))[0]["cases"]:
        row = {v: {f: statistics.median(r["cases"][case][f] for r in rounds)
                   for f in ("seconds", "seconds_min", "minor_faults", "system_s")} for v, rounds in runs.items()}
        if "before" in row:
            row["after_over_before"] = row["after"]["seconds"] / row["before"]["seconds"]
        out[case] = row
    return out


def table(summary: dict) -> str:
    lines = ["| case | before s (min) | after s (min) | after / before | page faults before / after | "
             "system s before / after |", "|---|---|---|---|---|---|"]

    def cell(row: dict, variant: str, fmt: str) -> str:
        return fmt.format(**row[variant]) if variant in row else "—"

    for case, row in summary.items():
        ratio = f"{row['after_over_before']:.2f}" if "after_over_before" in row else "—"
        lines.append(f"| {case} | {cell(row, 'before', '{seconds:.3f} ({seconds_min:.3f})')} | "
                     f"{cell(row, 'after', '{seconds:.3f} ({seconds_min:.3f})')} | {ratio} | "
                     f"{cell(row, 'before', '{minor_faults:.0f}')} / {cell(row, 'after', '{minor_faults:.0f}')} | "
                     f"{cell(row, 'before', '{system_s:.2f}')} / {cell(row, 'after', '{system_s:.2f}')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from decode_ab import before_json_model_arguments, sigterm_unwinds

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="git revision of the 'before' variant (omit: after only)")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--tails", default="250,64", help="comma-separated new-token counts per prompt (default 250,64)")
    ap.add_argument("--pool-tokens", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help=f"default {os.path.relpath(DEFAULT_JSON, ROOT)}")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, a smoke run (sizes given on the command line win): " + json.dumps(QUICK))
    ap.add_argument("--worker", nargs=2, metavar=("SRC", "SPEC"), help=argparse.SUPPRESS)
    from speed import parse_with_quick

    args = parse_with_quick(ap, argv, QUICK)
    if args.worker:
        return worker(*args.worker)
    try:
        tails = [int(t) for t in args.tails.split(",")]
    except ValueError:
        ap.error(f"--tails must be comma-separated integers, got {args.tails!r}")
    if not tails or min(tails) < 1:
        ap.error("--tails must hold counts >= 1")
    for name in ("prompt_tokens", "calls", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    least = 4 * (args.prompt_tokens + max(tails)) + 64
    if args.pool_tokens < least:
        ap.error(f"--pool-tokens must hold the prompt and four tails at least (4 x (prompt + tail) + 64 = {least} "
                 f"here), got {args.pool_tokens}")
    out_json = before_json_model_arguments(
        ap, args, "/tmp/envace-prefill-reuse-quick.json" if args.quick else DEFAULT_JSON)
    with sigterm_unwinds():
        return _main_run(ap, args, tails, out_json)


def _main_run(ap: argparse.ArgumentParser, args, tails: list[int], out_json: str) -> int:
    """`main` after the arguments: the worktree, the rounds and the report, the temporary folder removed after."""
    from decode_ab import detached_worktree, run_worker, write_report

    tmp = tempfile.mkdtemp(prefix="envace-prefill-reuse-")
    try:
        with contextlib.ExitStack() as stack:
            trees = {"after": ROOT}
            if args.before:
                try:
                    trees = {"before": stack.enter_context(detached_worktree(args.before, os.path.join(tmp, "b"))),
                             "after": ROOT}
                except ValueError as e:
                    ap.error(f"--before: {e}")
            spec = {k: getattr(args, k) for k in ("model", "prompt_tokens", "pool_tokens", "calls")}
            spec["tails"] = tails
            load_start = os.getloadavg()
            runs: dict[str, list[dict]] = {v: [] for v in trees}
            order = list(trees)
            for rnd in range(args.rounds):
                for variant in order[rnd % len(order):] + order[:rnd % len(order)]:
                    t0 = time.perf_counter()
                    res = run_worker(__file__, trees[variant], spec, os.path.join(tmp, f"{variant}.json"))
                    runs[variant].append(res)
                    got = ", ".join(f"{c} {v['seconds']:.3f} s" for c, v in res["cases"].items())
                    print(f"round {rnd + 1} {variant}: {got} ({time.perf_counter() - t0:.0f} s)", flush=True)
        summary = summarise(runs)
        write_report(out_json, summary, runs, {"before": args.before, "spec": spec, "load_average_start": load_start},
                     table(summary))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
