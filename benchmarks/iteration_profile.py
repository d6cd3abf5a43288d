"""Where the time of one World Rehearsal iteration goes: wall seconds per phase and a profiler's op table.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/iteration_profile.py \
        --dataset .envace/store/datasets/<version> --warm-start .envace/store/warm_starts/<id> \
        [--profile cpu-smoke] [--overrides ''] [--json benchmarks/results/iteration_profile.json]

Builds exactly what the rollout_and_train stage builds for the first iteration of a fresh run
(`stages.train.rollout_and_train`: `load_policy`, `PolicyTrainer`, `policy_engine`, `rollout_params`,
`loop.start_or_resume` from the given warm start, which must have been made with this config:
`warm_start.check_warm_start`), with the run's checkpoints and rollouts in a temporary store, and runs
`loop.train_iteration` twice:

1. **timed** (no profiler): wall seconds of the iteration split by phase, measured by wrapping the
   functions the iteration calls: the engine's prefill (`HFEngine._prefill_unpadded` / `_prefill_padded`)
   and decode (`HFEngine._decode`, sampling included) per role (ACT / REHEARSE / USER), reward scoring
   (`rollout.score_trajectory`), the update's forward+backward (`PolicyTrainer._accumulate`) and its
   optimizer (`optimizer.step`), the rest of the update (micro-batching, clipping) and "other" (prompt
   building, parsing, tau2 replay outside scoring, Python glue) = iteration wall − the above.
2. **profiled** (every aten op timed by a dispatch mode, `OpTimer`; the next iteration of the same run: other
   tasks, same settings): every op's wall time summed into categories by op name (`CATEGORIES`: attention,
   matmul, elementwise, softmax / log-softmax, sampling (cumsum / searchsorted / rand), copy and cast,
   reductions, indexing, optimizer ops, other), and "outside torch ops" = wall − Σ op time (Python, and
   the timer's own per-op cost). Also the top ops by time.

Writes ``--json`` and prints both tables as markdown. Every figure is from one run; the JSON holds the
load average at start and end (the machine's 2 cores are shared).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)

HERE = Path(__file__).resolve().parent

# (category, substrings of aten op names); first match wins, in this order
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                "_linear_pointwise")),
    ("softmax / log-softmax", ("softmax", "logsumexp")),
    ("sampling", ("cumsum", "searchsorted", "aten::rand", "aten::sort", "multinomial", "argmax", "topk")),
    ("copy and cast", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous",
                       "aten::cat", "aten::stack")),
    ("optimizer", ("_foreach", "addcdiv", "addcmul", "lerp")),
    ("reductions", ("aten::sum", "aten::mean", "aten::norm", "aten::max", "aten::min", "aten::all", "aten::any")),
    ("indexing", ("index", "gather", "scatter", "masked", "aten::where", "nonzero", "aten::select",
                  "aten::slice")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::silu", "aten::pow",
                     "aten::rsqrt", "aten::neg", "aten::exp", "aten::log", "aten::fill_", "aten::zero_",
                     "aten::clamp", "aten::sqrt", "aten::tanh", "aten::sigmoid", "aten::cos", "aten::sin",
                     "_backward")),
]


def category(op: str) -> str:
    """The `CATEGORIES` name of an op (its profiler key, e.g. "aten::mm"), "other" when none matches."""
    for name, keys in CATEGORIES:
        if any(k in op for k in keys):
            return name
    return "other"


class PhaseTimer:
    """Wall seconds per phase, from wrapped functions; nested wraps count in the innermost only."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []

    def wrap(self, owner: Any, attr: str, phase) -> None:
        """Replace ``owner.attr`` by a timed call; `phase` is a name or a function of the call's args."""
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            name = phase(*args, **kwargs) if callable(phase) else phase
            self._stack.append([0.0])
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = self._stack.pop()[0]
                self.seconds[name] += dt - inner
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][0] += dt

        setattr(owner, attr, timed)


@contextmanager
def role_of_calls(engine):
    """Sets ``engine._profile_role`` to each generate call's role while it runs (for the phase names)."""
    orig = engine.generate

    def generate(prompts, params):
        engine._profile_role = params.role or "act"
        try:
            return orig(prompts, params)
        finally:
            engine._profile_role = None

    engine.generate = generate
    try:
        yield
    finally:
        engine.generate = orig


def train_version(ds_dir: Path, version: str | None, split: str) -> str:
    """The dataset's train_version (`stages.dataset.write_dataset`'s hash of the train split's records),
    recomputed from its tasks.parquet after checking that the records hash to the manifest's version (so
    the recomputation is the one the curate stage made). Raises EnvaceError otherwise."""
    import pandas as pd

    from envace_core import EnvaceError
    from envace_core.store.files import sha256_bytes

    path = ds_dir / "tasks.parquet"
    try:
        records = pd.read_parquet(path).to_dict("records")
    except Exception as e:  # noqa: BLE001 - missing or unreadable: name the file
        raise EnvaceError(f"{path}: cannot read the dataset's tasks ({e})") from e
    if sha256_bytes(json.dumps(records, sort_keys=True, default=str).encode())[:16] != version:
        raise EnvaceError(f"{path}: its records do not hash to the manifest's version {version!r}: "
                          "not the dataset the curate stage wrote")
    train = [r for r in records if r["split"] == split]
    return sha256_bytes(json.dumps(train, sort_keys=True, default=str).encode())[:16]


def dataset_record(ds_dir: str, split: str) -> dict[str, Any]:
    """The `curate` result for a dataset folder of the artifact store (``<store>/datasets/<version>``):
    {"store", "key", "version", "train_version"} (`train_version` over the `split` train split). Raises
    rehearsal_effect's `BenchmarkError` for a folder without a readable manifest.json naming its version, or
    one not under a ``datasets`` folder; EnvaceError as `train_version`."""
    from rehearsal_effect import BenchmarkError

    d = Path(ds_dir).resolve()
    try:
        man = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise BenchmarkError(f"--dataset {ds_dir}: no readable manifest.json ({e}); give "
                             "<store>/datasets/<version> as the curate stage wrote it") from None
    if not isinstance(man, dict) or not isinstance(man.get("version"), str):
        raise BenchmarkError(f"--dataset {ds_dir}: its manifest.json has no \"version\"; give "
                             "<store>/datasets/<version> as the curate stage wrote it")
    if d.parent.name != "datasets":
        raise BenchmarkError(f"--dataset {ds_dir}: give the folder as the store holds it, "
                             "<store>/datasets/<version> (the curate stage writes it there)")
    return {"store": str(d.parent.parent), "key": f"datasets/{d.name}", "version": man["version"],
            "train_version": train_version(d, man["version"], split)}


def build_run(args):
    """(config, TrainingRun, RunState) of a fresh run of the config from the warm start ``args.warm_start``
    (module docstring), or from the fresh LoRA of train.seed when it is empty (benchmarks/heap_trim.py)."""
    from envace_core import EnvaceError
    from envace_core.config import load_config
    from envace_core.stages.dataset import load_dataset
    from envace_core.stages.warm_start import check_warm_start
    from envace_core.store.uri import open_store
    from envace_core.training.distributed import init_from_env
    from envace_core.training.loop import TrainingRun, start_or_resume, sync_engine, training_run_id
    from envace_core.training.policy import load_policy, policy_engine, rollout_params
    from envace_core.training.trainer import PolicyTrainer

    cfg = load_config(args.profile, args.overrides)
    dataset = dataset_record(args.dataset, cfg.data.train_split)
    warm = None
    if args.warm_start:
        warm_dir = Path(args.warm_start).resolve()
        meta = warm_dir / "warm_start.json"
        if not meta.is_file():
            raise EnvaceError(f"--warm-start {args.warm_start}: no warm_start.json (a warm start folder in the store)")
        try:
            warm = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EnvaceError(f"{meta} is not readable JSON ({e})") from e
        warm["adapter_uri"] = str(warm_dir / "adapter")
        check_warm_start(cfg, dataset, warm)
    tasks = load_dataset(dataset, "train")
    tmp = tempfile.mkdtemp(prefix="envace-iterprof-")
    model, tok, _ = load_policy(cfg)
    trainer = PolicyTrainer(model, tok, cfg.train, compute_dtype=cfg.model.compute_dtype)
    run = TrainingRun(cfg, tasks, trainer, policy_engine(cfg, trainer.model, tok), rollout_params(cfg),
                      init_from_env(), open_store(tmp), training_run_id(cfg, dataset, warm))
    state = start_or_resume(run, warm)
    sync_engine(run)
    return cfg, run, state


def timed_iteration(run, state) -> dict[str, Any]:
    """Iteration 1 with `PhaseTimer` wraps (module docstring, 1)."""
    from envace_core.engines import hf
    from envace_core.training import loop, rollout

    timer, engine, trainer = PhaseTimer(), run.engine, run.trainer
    role = lambda *a, **k: getattr(engine, "_profile_role", None) or "act"
    if isinstance(engine, hf.HFEngine):
        timer.wrap(engine, "_prefill_unpadded", lambda *a, **k: f"generate: prefill ({role()})")
        timer.wrap(engine, "_prefill_padded", lambda *a, **k: f"generate: prefill ({role()})")
        timer.wrap(engine, "_decode", lambda *a, **k: f"generate: decode + sampling ({role()})")
    timer.wrap(rollout, "score_trajectory", "reward scoring")
    timer.wrap(trainer, "_accumulate", "update: forward + backward")
    timer.wrap(trainer.optimizer, "step", "update: optimizer step")
    timer.wrap(trainer, "update", "update: rest (batching, clipping, metrics)")
    with role_of_calls(engine):
        t0 = time.perf_counter()
        rec = loop.train_iteration(run, state)
        wall = time.perf_counter() - t0
    phases = dict(timer.seconds)
    phases["other (prompts, parsing, Python glue)"] = wall - sum(phases.values())
    return {"wall_s": wall, "phases_s": phases, "calls": dict(timer.calls),
            "iteration": {k: rec.get(k) for k in ("rollout_seconds", "seconds", "frac_zero_std",
                                                  "train/seconds", "train/tokens", "train/forward_tokens")},
            "generated_tokens": engine.stats.get("generated_tokens") if hasattr(engine, "stats") else None}


class OpTimer:
    """A `TorchDispatchMode` that sums wall seconds and calls per aten op (the outermost op each time: ops
    run inside an op's kernel are not seen again), with constant memory: torch.profiler's event list of a
    whole iteration (millions of ops) did not fit in this machine's memory. Its per-op Python cost makes
    the wrapped run slower than an unwrapped one; the time outside ops includes it."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        timer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                t0 = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                key = str(func.overloadpacket.__name__)
                timer.seconds[key] += time.perf_counter() - t0
                timer.calls[key] += 1
                return out

        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.mode = _Mode()


def profiled_iteration(run, state, top: int) -> dict[str, Any]:
    """The next iteration with every aten op timed (`OpTimer`; module docstring, 2)."""
    from envace_core.training import loop

    gen0 = dict(getattr(run.engine, "stats", {}))
    timer = OpTimer()
    t0 = time.perf_counter()
    with timer.mode:
        loop.train_iteration(run, state)
    wall = time.perf_counter() - t0
    by_cat: dict[str, float] = defaultdict(float)
    ops = []
    for name, sec in timer.seconds.items():
        key = f"aten::{name}"
        by_cat[category(key)] += sec
        ops.append((sec, timer.calls[name], key))
    ops.sort(reverse=True)
    total = sum(by_cat.values())
    return {"wall_s": wall, "op_self_s": total, "categories_s": dict(by_cat),
            "outside_torch_ops_s": wall - total,
            "top_ops": [{"op": k, "self_s": s, "calls": c, "category": category(k)} for s, c, k in ops[:top]],
            "generated_tokens": (run.engine.stats.get("generated_tokens", 0) - gen0.get("generated_tokens", 0))
            if gen0 else None}


def markdown(report: dict[str, Any]) -> str:
    t, p = report["timed"], report["profiled"]
    lines = [f"Iteration 1, timed (wall {t['wall_s']:.1f} s):", "", "| phase | seconds | share |", "|---|---|---|"]
    for k, v in sorted(t["phases_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {v:.1f} | {v / t['wall_s']:.0%} |")
    lines += ["", f"Iteration 2 with every aten op timed (wall {p['wall_s']:.1f} s, time in torch ops "
              f"{p['op_self_s']:.1f} s):", "", "| category | seconds | share of wall |", "|---|---|---|"]
    rows = sorted(p["categories_s"].items(), key=lambda kv: -kv[1]) + [("outside torch ops (Python, op timer)",
                                                                        p["outside_torch_ops_s"])]
    for k, v in rows:
        lines.append(f"| {k} | {v:.1f} | {v / p['wall_s']:.0%} |")
    lines += ["", "| top op | seconds | calls | category |", "|---|---|---|---|"]
    for o in p["top_ops"][:10]:
        lines.append(f"| `{o['op']}` | {o['self_s']:.2f} | {o['calls']} | {o['category']} |")
    return "\n".join(lines)


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments `build_run` reads: --dataset, --warm-start, --profile, --overrides."""
    ap.add_argument("--dataset", required=True, help="a curated dataset folder, e.g. .envace/store/datasets/<v>")
    ap.add_argument("--warm-start", required=True, help="a warm start folder, e.g. .envace/store/warm_starts/<id>")
    ap.add_argument("--profile", default="cpu-smoke")
    ap.add_argument("--overrides", default="")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(ap)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=str(HERE / "results" / "iteration_profile.json"))
    args = ap.parse_args(argv)

    import torch

    from envace_core.store.files import atomic_write_text

    load0, t0 = os.getloadavg(), time.monotonic()
    cfg, run, state = build_run(args)
    timed = timed_iteration(run, state)
    print(f"[profile] timed iteration: {timed['wall_s']:.1f} s", flush=True)
    profiled = profiled_iteration(run, state, args.top)
    report = {"run": {"command": " ".join([sys.executable, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                      "profile": args.profile, "overrides": args.overrides, "dataset": args.dataset,
                      "warm_start": args.warm_start, "torch_threads": torch.get_num_threads(),
                      "compute_dtype": run.trainer.compute_dtype, "load_avg_start": list(load0),
                      "load_avg_end": list(os.getloadavg()), "wall_s": time.monotonic() - t0,
                      "rollout": {"tasks_per_iteration": cfg.rollout.tasks_per_iteration,
                                  "group_size": cfg.rollout.group_size, "max_turns": cfg.rollout.max_turns,
                                  "temperature": cfg.rollout.temperature}},
              "timed": timed, "profiled": profiled}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(args.json), json.dumps(report, indent=2, sort_keys=True, default=str))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    from envace_core import EnvaceError

    try:
        sys.exit(main())
    except EnvaceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
