"""Our engine's generation, before vs after a change, from one run: the speed.py workload (g8, distinct8, g1)
on `HFEngine` from two source trees, and with the fused decode step on and off in the current one.

    .venv/bin/python benchmarks/decode_ab.py --before 6b7f807 [--rounds 3] [--repeats 2]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_ab.py --before HEAD --quick   # smoke run

Run it alone on an idle machine (no other torch process: they stall each other on 2 cores).

Variants (each in a fresh process, the order rotated every round so drift and warm caches spread evenly):
  before      envace_core of git revision --before (a detached worktree under --worktree, made and removed
              here), engine defaults;
  after       this checkout's envace_core, engine defaults (fused decode on where supported);
  unfused     this checkout with ``HFEngine(fused_decode=False)``: the transformers forward per decode step.
Every variant gets the same token ids (speed.build_workload on the bundled tokenizer: a ~--prompt-tokens
prompt sampled --group ways, --distinct different prompts one sample each, the first prompt once; and
`root_case`: --distinct / 2 prompts made of that first prompt and a different ~--prompt-tokens / 4-token
tail each, as a group's trajectories after their first turn), decodes
exactly --max-new tokens per sample (ignore_eos, temperature 1, top-p 1, seed 1) after one warm-up call, in
the compute dtype speed.py uses (``resolve_compute_dtype("auto", "cpu")``); with --lora R the model carries
a random rank-R LoRA adapter on q/v (`with_lora`), as the trainer's policy does during rollouts. Per case
and variant, as speed.py (`speed.case_summary`): seconds (median of --repeats calls), prefill_s (median of
--repeats calls with one new token), decode_ms_per_step = (seconds - prefill_s) / (max_new - 1) * 1000.

Reported per case: each variant's median over rounds, and the ratios after / before and after / unfused of
decode ms per step and of seconds (< 1: faster). Writes --json (default benchmarks/results/decode_ab.json)
with every raw figure, the command line, the load average at start and end, the CPU's bf16 flags and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_JSON = os.path.join(HERE, "results", "decode_ab.json")
QUICK = {"prompt_tokens": 96, "max_new": 8, "group": 2, "distinct": 2, "repeats": 1, "rounds": 1}
if HERE not in sys.path:  # speed.py lives beside this script
    sys.path.insert(0, HERE)


def worker(src: str, spec_path: str) -> int:
    """One variant: the workload on HFEngine from the envace_core under `src`; prints one JSON line."""
    sys.path.insert(0, src)
    sys.path.insert(1, HERE)
    spec = json.load(open(spec_path))
    import torch

    import envace_core
    from envace_core.engines.base import SamplingParams, resolve_compute_dtype
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model, load_tokenizer, resolve_model
    from speed import build_workload, measure_cases

    if os.path.dirname(os.path.abspath(envace_core.__file__)) != os.path.join(os.path.abspath(src), "envace_core"):
        raise RuntimeError(f"envace_core came from {envace_core.__file__}, not {src}")
    model_dir = resolve_model(spec["model"])
    tok = load_tokenizer(model_dir)
    w = build_workload(tok, argparse.Namespace(**spec["workload"]))
    w["cases"].append(root_case(tok, spec["workload"]))
    dtype = resolve_compute_dtype("auto", "cpu")
    model = load_model(model_dir)
    if spec.get("lora"):
        model = with_lora(model, spec["lora"])
    eng = HFEngine(model, tok, compute_dtype=dtype,
                   max_batch_size=max(8, *(len(c["prompts"]) * c["n"] for c in w["cases"])), **spec["engine_kwargs"])

    def gen(prompts, n, max_new):
        sp = SamplingParams(max_new_tokens=max_new, n=n, temperature=1.0, top_p=1.0, seed=1, ignore_eos=True)
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp)
        return {"seconds": time.perf_counter() - t0, "tokens": sum(len(c.token_ids) for g in outs for c in g)}

    wu = w["warmup"]
    gen(wu["prompts"], wu["n"], wu["max_new"])
    cases = measure_cases(gen, w)
    print(json.dumps({"compute_dtype": str(dtype), "threads": torch.get_num_threads(),
                      "cases": {k: {f: v[f] for f in ("seconds", "prefill_s", "decode_ms_per_step", "exact_length")}
                                for k, v in cases.items()}}))
    return 0


def with_lora(model, r: int):
    """`model` as the trainer's policy: a peft LoRA adapter of rank `r` on q_proj and v_proj (alpha 2r),
    both factors drawn at random (seed 0) so that the adapter changes the output, in eval mode."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).eval()


def root_case(tok, workload: dict) -> dict:
    """A GRPO group's later turn: --distinct // 2 prompts that share their first ~--prompt-tokens tokens (one
    engine_bench prompt) and end in different ~--prompt-tokens / 4-token tails, one sample each."""
    from engine_bench import make_prompt
    from speed import distinct_prompt

    root = make_prompt(tok, workload["prompt_tokens"], 0)
    tails = [distinct_prompt(tok, max(workload["prompt_tokens"] // 4, 8), v)[1:]
             for v in range(max(workload["distinct"] // 2, 2))]
    return {"name": f"root{len(tails)}", "prompts": [root + t for t in tails], "n": 1}


@contextlib.contextmanager
def detached_worktree(rev: str, where: str):
    """A detached git worktree of this checkout at revision `rev` under `where`, removed on exit, also on SIGTERM
    (`sigterm_unwinds`); yields its path. Raises ValueError when `rev` is not a commit of this checkout, when
    `where` exists and is not an empty folder, or when ``git worktree add`` fails (git's message)."""
    found = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                           check=False, capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"not a git revision of {ROOT}: {rev!r} ({found.stderr.strip()})")
    existed = os.path.lexists(where)
    if existed and not (os.path.isdir(where) and not os.path.islink(where) and not os.listdir(where)):
        raise ValueError(f"{where} exists and is not an empty folder: give a worktree path that does not exist")
    with sigterm_unwinds():
        try:  # a stop during `worktree add` leaves a half-made, locked worktree: removed below as well
            added = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", where, found.stdout.strip()],
                                   check=False, capture_output=True, text=True)
            if added.returncode != 0:
                raise ValueError(f"git worktree add {where} failed: {added.stderr.strip()}")
            yield where
        finally:
            remove_worktree(where, keep_folder=existed)


def remove_worktree(where: str, keep_folder: bool = False) -> None:
    """Removes the worktree at `where` (``--force`` twice: also a locked one, as a stopped ``worktree add`` leaves),
    deletes what git left of it (with `keep_folder`, the folder itself stays: it was there, empty, before), then
    prunes this checkout's records of worktrees whose folder is gone. Never raises."""
    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", "--force", where], check=False,
                   capture_output=True)
    if os.path.isdir(where) and not os.path.islink(where):
        if keep_folder:
            for name in os.listdir(where):
                full = os.path.join(where, name)
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(full)
        else:
            shutil.rmtree(where, ignore_errors=True)
    if keep_folder and not os.path.lexists(where):  # `worktree remove` takes the folder too
        with contextlib.suppress(OSError):
            os.mkdir(where)
    subprocess.run(["git", "-C", ROOT, "worktree", "prune"], check=False, capture_output=True)


_STOPPING = False  # set by the first SIGTERM under `sigterm_unwinds`: the process is on its way out


@contextlib.contextmanager
def sigterm_unwinds():
    """While inside, SIGTERM (``kill``, ``timeout``) raises SystemExit(143) instead of ending the process at once,
    so `finally` blocks run: a stopped benchmark removes its worktree and temporary folder (a running worker
    child is killed by `subprocess.run` on the way out). Further SIGTERMs are ignored until it exits, so they
    cannot interrupt that cleanup. Nests (the innermost restores the outer handler). SIGKILL cannot be caught.
    Outside the main thread, where Python cannot set handlers, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        global _STOPPING
        if _STOPPING:  # a second SIGTERM must not cut the cleanup short
            return
        _STOPPING = True
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def model_argument(ref: str) -> str:
    """``--model`` as a worker (run from the checkout's root) can load it: ``bundled:…`` and ``s3://…`` as given, a
    local folder made absolute. Raises ValueError for a local path that is not a model folder (config.json)."""
    if ref.startswith(("bundled:", "s3://")):
        return ref
    path = os.path.abspath(os.path.expanduser(ref))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{ref!r} is not a model folder (no config.json); give a local HF model folder, "
                         "bundled:smollm2-135m-instruct or s3://...")
    return path


def json_argument(path: str | None, default: str) -> str:
    """``--json`` checked before anything is measured: None -> `default`; refused (ValueError) when empty, a
    folder, an existing file that cannot be written, or where no file can be written (its folder cannot be made
    or written: `writable_dir_problem`)."""
    from envace_core.store.files import writable_dir_problem

    if path is None:
        path = default
    if not path.strip():
        raise ValueError("is empty; give a file path for the report")
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        raise ValueError(f"{path} is a folder; give a file path for the report")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ValueError(f"{path} exists and cannot be written")
    problem = writable_dir_problem(os.path.dirname(full))
    if problem:
        raise ValueError(problem)
    return full


def before_json_model_arguments(ap: argparse.ArgumentParser, args, default_json: str) -> str:
    """The checks of --before, --json and --model that the before/after benchmarks share, before any work:
    an empty --before, a bad --json (`json_argument`) or --model (`model_argument`) end in ``ap.error``.
    Makes ``args.model`` loadable by a worker; returns the report's path."""
    if args.before is not None and not args.before.strip():
        ap.error("--before is empty; give a git revision, or leave the option out for no before variant")
    try:
        out_json = json_argument(args.json, default_json)
    except ValueError as e:
        ap.error(f"--json: {e}")
    try:
        args.model = model_argument(args.model)
    except ValueError as e:
        ap.error(f"--model: {e}")
    return out_json


def run_worker(script: str, src: str, spec: dict, spec_path: str) -> dict:
    """Run `script --worker SRC SPEC` in a fresh process (the spec written to `spec_path` first); returns the
    JSON of its last stdout line. Raises RuntimeError with its stderr's tail when it fails."""
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--worker", src, spec_path],
                          check=False, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"worker for {src} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_report(out_json: str, summary: dict, runs: dict, details: dict, table_text: str) -> None:
    """Write {summary, runs, details} to `out_json` (its folder made), details completed with the command line, the
    load average at the end, the date and the CPU's bf16 flags; print `table_text` and where the report went."""
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    details = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]), **details,
               "load_average_end": os.getloadavg(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "cpu_bf16_flags": sorted(f for f in ("avx512_bf16", "amx_bf16") if f in cpuinfo)}
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump({"summary": summary, "runs": runs, "details": details}, f, indent=1)
    print(table_text)
    print(f"wrote {out_json}")


def summarise(runs: dict[str, list[dict]]) -> dict:
    """variant -> rounds of worker output  ->  case -> {variant medians, ratios}."""
    cases = sorted(next(iter(runs.values()))[0]["cases"])
    out = {}
    for case in cases:
        row = {}
        for variant, rounds in runs.items():
            row[variant] = {f: statistics.median(r["cases"][case][f] for r in rounds)
                            for f in ("seconds", "prefill_s", "decode_ms_per_step")}
            row[variant]["decode_ms_per_step_rounds"] = [round(r["cases"][case]["decode_ms_per_step"], 2)
                                                        for r in rounds]
            row[variant]["exact_length"] = all(r["cases"][case]["exact_length"] for r in rounds)
        for num, den in (("after", "before"), ("after", "unfused")):
            if num in row and den in row:
                row[f"{num}_over_{den}"] = {f: row[num][f] / row[den][f] for f in ("decode_ms_per_step", "seconds")}
        out[case] = row
    return out


def table(summary: dict) -> str:
    lines = ["| case | before ms/step | after ms/step | unfused ms/step | after / before | after / unfused |",
             "|---|---|---|---|---|---|"]
    for case, row in summary.items():
        def ms(v):
            return f"{row[v]['decode_ms_per_step']:.1f}" if v in row else "—"

        def r(k):
            return f"{row[k]['decode_ms_per_step']:.2f}" if k in row else "—"

        lines.append(f"| {case} | {ms('before')} | {ms('after')} | {ms('unfused')} | {r('after_over_before')} | "
                     f"{r('after_over_unfused')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=False, help="git revision of the 'before' variant (omit: no before)")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--distinct", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="decode a policy as the trainer does: a LoRA adapter of rank R on q/v (0: the base model)")
    ap.add_argument("--worktree", default=None, help="where the before worktree goes (default: a temp dir)")
    ap.add_argument("--json", default=None, help=f"default {os.path.relpath(DEFAULT_JSON, ROOT)}")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, a smoke run (sizes given on the command line win): " + json.dumps(QUICK))
    ap.add_argument("--worker", nargs=2, metavar=("SRC", "SPEC"), help=argparse.SUPPRESS)
    from speed import parse_with_quick

    args = parse_with_quick(ap, argv, QUICK)
    if args.worker:
        return worker(*args.worker)
    if args.lora < 0:
        ap.error("--lora must be >= 0")
    for name in ("prompt_tokens", "max_new", "group", "distinct", "repeats", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_new < 2:
        ap.error("--max-new must be >= 2 (decode ms per step needs a step after the first token)")
    out_json = before_json_model_arguments(
        ap, args, "/tmp/envace-decode-ab-quick.json" if args.quick else DEFAULT_JSON)

    with sigterm_unwinds():
        return _main_run(ap, args, out_json)


def _main_run(ap: argparse.ArgumentParser, args, out_json: str) -> int:
    """`main` after the arguments: the worktree, the rounds and the report, the temporary folder removed after."""
    tmp = tempfile.mkdtemp(prefix="envace-decode-ab-")
    trees = {"after": ROOT}
    try:
        with contextlib.ExitStack() as stack:
            if args.before:
                try:
                    trees["before"] = stack.enter_context(
                        detached_worktree(args.before, args.worktree or os.path.join(tmp, "before")))
                except ValueError as e:
                    ap.error(f"--before: {e}")
            return _run(args, trees, tmp, out_json)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args, trees: dict[str, str], tmp: str, out_json: str) -> int:
    """The rounds of every variant (`main`), then the report."""
    variants = {"before": {}, "after": {}, "unfused": {"fused_decode": False}}
    variants = {k: v for k, v in variants.items() if k in trees or k == "unfused"}
    workload = {k: getattr(args, k) for k in ("prompt_tokens", "max_new", "group", "distinct", "repeats")}
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    order = list(variants)
    for rnd in range(args.rounds):
        for variant in order[rnd % len(order):] + order[:rnd % len(order)]:
            spec = {"model": args.model, "workload": workload, "engine_kwargs": variants[variant],
                    "lora": args.lora}
            t0 = time.perf_counter()
            res = run_worker(__file__, trees.get(variant, ROOT), spec, os.path.join(tmp, f"{variant}.json"))
            runs[variant].append(res)
            steps = ", ".join(f"{c} {v['decode_ms_per_step']:.1f}" for c, v in sorted(res["cases"].items()))
            print(f"round {rnd + 1} {variant}: decode ms/step {steps} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    summary = summarise(runs)
    write_report(out_json, summary, runs, {"before": args.before, "workload": workload, "model": args.model,
                                           "lora": args.lora, "load_average_start": load_start}, table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
