"""Does training learn? World Rehearsal GRPO vs standard GRPO vs per-role policy vs the base model.

    .venv/bin/python benchmarks/learning.py [--preset full|quick|seeds3|from_adapter|from_adapter_steps] [--seeds 0,1] [--out DIR] [--no-append]
    .venv/bin/python benchmarks/learning.py --probe      # base model's tool-call / success rates only

Curriculum: synthesized airline + retail tasks (`synth.synthesize`, levels `--levels`, one selection
seed) split deterministically by the sha256 of the task id into train and held-out (disjoint ids,
asserted; synthesis already keeps every task off the tau2 test split's users). The split is written
as a dataset (train / "test" = held-out rows) through the same dataset gate `stages.curate` uses.

Warm start: the 135M base writes no parseable tool call on this curriculum (0/48, RESULTS.md
"Feasibility"), so every GRPO group has equal rewards and nothing can learn. Every trained condition
therefore starts from the warm_start stage (`stages.warm_start.warm_start`, METHOD.md §2b), with the
preset's SFT options as train.* fields (train.sft_warmup_steps, sft_batch_rows, sft_learning_rate,
sft_roles) and train.seed = the run's seed (the stage seeds the LoRA and the SFT batches with it, and
a run must start from the warm start of its own seed: `warm_start.check_warm_start`). Both presets
warm both roles, train.sft_roles = [act, rehearse] (ACT on the train split's gold turns within
rollout.max_turns, REHEARSE on their real transitions; the stage's default): the per-role policy
(train.policy_per_role) warms each adapter on its own role's examples, the shared policy one adapter
on both, so the shared and per-role ablations start from the same data. The stage stores each warm
start under ``warm_starts/<warm_start_id>`` in the benchmark's store; the conditions of one seed that
differ only in GRPO settings (sft, world_rehearsal, standard_grpo) share one id and so one warm start,
per_role (another LoRA layout) has its own; a re-run reuses them. Its id is part of each training
run's id (`loop.training_run_id`) and each run records it (`stages.train.warm_start_lineage`).

Conditions, each trained with `stages.rollout_and_train` for every seed until the
cumulative generated tokens (HFEngine ``generated_tokens``, i.e. every ACT/REHEARSE completion token)
first reach `--token-budget`; the data cursor, RNG and optimizer carry over between chunks through
the stage's own checkpoint (copied to the next chunk's run id; LR schedule forced constant):

* ``base``            no training (the adapter-free base model; greedy, so seed-independent)
* ``sft``             the warm start only (per seed; world_rehearsal and standard_grpo start from it)
* ``world_rehearsal`` rollout.source=imagined (ACT + REHEARSE rows, role-wise GRPO)
* ``standard_grpo``   rollout.source=real (ACT only, against private copies of the real env)
* ``per_role``        rollout.source=imagined, train.policy_per_role=true (two LoRA adapters, each
                      warmed on its own role)
* ``shared_baseline`` rollout.source=imagined, train.shared_baseline=true (one GRPO baseline over both
                      roles' rows of a group instead of one per role: the role-wise baseline's ablation,
                      METHOD.md §3)

Real-environment tool calls each trained run made, from the training loop's ``env_steps/rollout`` and
``env_steps/reward`` (`loop.rollout_metrics`): rollouts (standard GRPO's; World Rehearsal's are 0) and
reward scoring (replays in private environments, gold transpositions) counted apart. The warm start's
gold replays (the same for every condition of a seed) are not in them.

Metrics per condition and seed: held-out ACT success in the real environment (`stages.evaluate`,
rehearsal.mode=none, greedy, success = tau2 reward 1) and REHEARSE fidelity on held-out real
transitions (the gold calls of held-out tasks replayed in tau2: `stages.held_out_transitions`, scored
as in `stages.validate`; an unparseable prediction counts 0). 95% CIs: Student-t over seed means when
a condition has >= 2 seeds, else a percentile bootstrap (2000 resamples) over held-out tasks /
transitions; the method and n are reported. Learning curve: train success rate and mean ACT reward
per iteration against cumulative generated tokens, plus held-out success every `--eval-every`
iterations (PNG). Writes learning.json + learning_curve.png under --out and appends a markdown
section to benchmarks/RESULTS.md (unless --no-append).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)
from envace_core import EnvaceError
from envace_core.evaluation.stats import bootstrap_ci
from envace_core.store.files import (
    atomic_write_text,
    writable_dir_problem,
    writable_file_problem,
)

CONDITIONS: dict[str, dict[str, Any] | None] = {
    "base": None,
    "sft": {},
    "world_rehearsal": {"rollout": {"source": "imagined"}},
    "standard_grpo": {"rollout": {"source": "real"}},
    "per_role": {"rollout": {"source": "imagined"}, "train": {"policy_per_role": True}},
    "shared_baseline": {"rollout": {"source": "imagined"}, "train": {"shared_baseline": True}},
}

# full: sized to ~1.5 h on an idle 2-core box (RESULTS.md, "Learning benchmark"); level-2 retail tasks
# need 3 tool calls, hence max_turns 3. The SFT warm start's options are train.* fields (module docstring);
# train.seed is each run's seed.
PRESETS: dict[str, dict[str, Any]] = {
    "full": {"seeds": [0, 1], "levels": [1, 2], "tasks_per_level": 12, "heldout_mod": 3,
             "token_budget": 12000, "max_iterations": 40, "eval_every": 0, "max_transitions": 16,
             "overrides": {"data": {"policy_max_chars": 200},
                           "rollout": {"group_size": 8, "tasks_per_iteration": 2, "max_turns": 3,
                                       "max_new_tokens_act": 48, "max_new_tokens_rehearse": 48},
                           "train": {"learning_rate": 1e-4, "lr_scheduler": "constant",
                                     "sft_warmup_steps": 60, "sft_batch_rows": 2, "sft_learning_rate": 5e-4,
                                     "sft_roles": ["act", "rehearse"]},
                           "eval": {"max_turns": 3}, "rehearsal": {"mode": "none"}}},
    # seeds3: the product's own settings (profile cpu-smoke: the main job's G, turns, budgets, reward,
    # warm start), 3 seeds, levels 1-3, 25 tasks per level and domain (150) of which 42 held out (sha256 mod 3),
    # the same generated-token budget per trained run; no rehearsal and no base/warm-start comparison
    # inside the evaluation (the benchmark measures those conditions itself).
    "seeds3": {"seeds": [0, 1, 2], "levels": [1, 2, 3], "tasks_per_level": 25, "heldout_mod": 3,
               "token_budget": 6000, "max_iterations": 30, "eval_every": 0, "max_transitions": 16,
               "overrides": {"train": {"lr_scheduler": "constant", "warmup_iterations": 0},
                             "eval": {"compare": []}, "rehearsal": {"mode": "none"}}},
    # from_adapter: every condition starts from one given adapter (--init-adapter, no SFT here) trained on a
    # curated dataset's train split (--dataset); held out: rehearsal_effect.py's fresh synthesized tasks for
    # that dataset (30 per domain, synthesis seed 1, levels 1-3, disjoint from its train split, checked).
    # Seeds vary the GRPO phase only (the warm start is the adapter). The per-role policy gets the adapter
    # in both of its adapters.
    "from_adapter": {"seeds": [0, 1, 2], "levels": [1, 2, 3], "heldout_per_domain": 30, "heldout_seed": 1,
                     "token_budget": 6000, "max_iterations": 30, "eval_every": 0, "max_transitions": 16,
                     "overrides": {"train": {"lr_scheduler": "constant", "warmup_iterations": 0,
                                             "sft_warmup_steps": 0},
                                   "eval": {"compare": []}, "rehearsal": {"mode": "none"}}},
    # from_adapter_steps: from_adapter with the same rollouts and generated-token budget but more update per
    # iteration: minibatches of 8 rows (one AdamW step each) over 2 PPO epochs at η = 1e-4, 16-22 steps per
    # iteration (measured; rows vary) instead of one at 2e-5. Under from_adapter the 3 iterations' 3 steps moved the LoRA update B·A
    # by 0.5 % of its norm and changed no held-out outcome; this asks whether the same data moves more.
    "from_adapter_steps": {"seeds": [0, 1, 2], "levels": [1, 2, 3], "heldout_per_domain": 30, "heldout_seed": 1,
                           "token_budget": 6000, "max_iterations": 30, "eval_every": 0, "max_transitions": 16,
                           "overrides": {"train": {"lr_scheduler": "constant", "warmup_iterations": 0,
                                                   "sft_warmup_steps": 0, "learning_rate": 1e-4,
                                                   "mini_batch_rows": 8, "ppo_epochs": 2},
                                         "eval": {"compare": []}, "rehearsal": {"mode": "none"}}},
    "quick": {"seeds": [0], "levels": [1], "tasks_per_level": 4, "heldout_mod": 2,
              "token_budget": 200, "max_iterations": 2, "eval_every": 0, "max_transitions": 4,
              "overrides": {"data": {"policy_max_chars": 200},
                            "rollout": {"group_size": 4, "tasks_per_iteration": 1, "max_turns": 1,
                                        "max_new_tokens_act": 32, "max_new_tokens_rehearse": 32},
                            "train": {"learning_rate": 1e-4, "lr_scheduler": "constant",
                                      "sft_warmup_steps": 2, "sft_batch_rows": 1, "sft_learning_rate": 5e-4,
                                      "sft_roles": ["act", "rehearse"]},
                            "eval": {"max_turns": 1}, "rehearsal": {"mode": "none"}}},
}


ADAPTER_PRESETS = ("from_adapter", "from_adapter_steps")  # presets that need --init-adapter and --dataset


class BenchmarkError(EnvaceError):
    """The benchmark's inputs cannot give a valid measurement (e.g. an empty held-out split)."""


# ------------------------------------------------------------------------------------ curriculum
def is_held_out(task_id: str, mod: int) -> bool:
    """Deterministic split: held out iff sha256(id) % mod == 0 (process-independent)."""
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:12], 16) % mod == 0


def split_tasks(tasks: list, mod: int) -> tuple[list, list]:
    """(train, held_out) by `is_held_out`; raises BenchmarkError if either side is empty or they
    share an id."""
    train = [t for t in tasks if not is_held_out(t.id, mod)]
    held = [t for t in tasks if is_held_out(t.id, mod)]
    if not train or not held:
        raise BenchmarkError(f"split of {len(tasks)} tasks with heldout_mod={mod} left "
                             f"{len(train)} train / {len(held)} held-out: synthesize more tasks")
    if {t.id for t in train} & {t.id for t in held}:
        raise BenchmarkError("train and held-out tasks share an id")
    return train, held


def curriculum(domains: list[str], levels: list[int], per_level: int, seed: int, mod: int,
               synthesize: Callable | None = None) -> tuple[list, list]:
    """Synthesized tasks (`per_level` per level and domain) split into (train, held_out)."""
    from envace_core.envs.tau2.synth import synthesize as synth

    synthesize = synthesize or synth
    tasks = [t for d in domains for t in synthesize(d, per_level * len(levels), levels, seed)]
    return split_tasks(tasks, mod)


def dataset_curriculum(preset: dict[str, Any], domains: list[str]) -> tuple[list, list]:
    """(train, held_out) of a `from_adapter` preset: the train split of ``preset["dataset_dir"]`` (a curated
    dataset folder) in `domains`, and ``heldout_per_domain`` fresh synthesized tasks per domain
    (`rehearsal_effect_heldout.heldout_tasks`: read from, or built into, .envace/bench/rehearsal_effect,
    disjoint from that train split or BenchmarkError)."""
    from rehearsal_effect_heldout import (
        heldout_tasks,
        limit_per_domain,
        load_dataset_dir,
    )

    train = [t for t in load_dataset_dir(preset["dataset_dir"]).get("train", []) if t.domain in domains]
    held, _ = heldout_tasks(preset["dataset_dir"], preset["heldout_per_domain"], preset["heldout_seed"],
                            preset["levels"], Path(preset.get("heldout_dir", ".envace/bench/rehearsal_effect")))
    held = [t for t in limit_per_domain(held, preset["heldout_per_domain"]) if t.domain in domains]
    if not train or not held:
        raise BenchmarkError(f"{preset['dataset_dir']}: {len(train)} train / {len(held)} held-out tasks in {domains}")
    return train, held


def adapter_motion(start_dir: str | None, final_dir: str | None) -> float | None:
    """How far training moved the policy: ‖Δ(B·A)‖_F / ‖(B·A)_start‖_F summed over every LoRA module of the
    folder (both adapters of a per-role policy), with B·A the LoRA update of each target weight (Hu et al.
    2021; the α/r scale cancels in the ratio). 0.01 = the update changed by 1 % of its size. None when either
    folder or a matching weights file is missing, or the starting update is 0 (a fresh LoRA: B = 0)."""
    if not start_dir or not final_dir:
        return None
    import torch
    from safetensors.torch import load_file

    num = den = 0.0
    start_files = sorted(Path(start_dir).rglob("adapter_model.safetensors"))
    for f in start_files:
        g = Path(final_dir) / f.relative_to(start_dir)
        if not g.is_file():
            return None
        a, b = load_file(str(f)), load_file(str(g))
        for k in a:
            if "lora_A" in k and k.replace("lora_A", "lora_B") in a and k in b:
                kb = k.replace("lora_A", "lora_B")
                d0 = a[kb].float() @ a[k].float()
                num += float(torch.linalg.norm(b[kb].float() @ b[k].float() - d0)) ** 2
                den += float(torch.linalg.norm(d0)) ** 2
    return (num / den) ** 0.5 if start_files and den > 0 else None


def per_role_copy(adapter: str, root: Path) -> str:
    """A per-role layout (act/ and rehearse/) of one shared LoRA adapter folder, made once under `root`
    (named by the adapter's checksums): how a per-role policy starts from a shared warm start."""
    import shutil

    from envace_core.store.files import dir_checksums, sha256_bytes

    dst = root / sha256_bytes(json.dumps(dir_checksums(Path(adapter)), sort_keys=True).encode())[:12]
    if not (dst / "rehearse" / "adapter_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root))  # beside dst, so the rename below stays on one file system
        for role in ("act", "rehearse"):
            shutil.copytree(adapter, tmp / role)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
    return str(dst)


def write_dataset(store_root: str, train: list, held: list, domains: list[str]) -> dict[str, Any]:
    """Write train + held-out (split "test") as a dataset in the artifact store, gated like curate.

    Returns the dict `stages.load_dataset` / `rollout_and_train` / `evaluate` take."""
    import pandas as pd

    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.stages.dataset import task_record
    from envace_core.stages.gates import dataset_gate
    from envace_core.store.files import sha256_bytes
    from envace_core.store.uri import open_store

    held = [t.model_copy(update={"split": "test"}) for t in held]
    records = [task_record(t) for t in train + held]
    real_test = {t.id for d in domains for t in load_tasks(d, "test")}
    gate = dataset_gate(pd.DataFrame(records), real_test | {t.id for t in held}, 2,
                        domains=domains)
    gate.raise_if_failed()
    version = sha256_bytes(json.dumps(records, sort_keys=True).encode())[:16]
    store, key = open_store(store_root), f"datasets/{version}"
    if not store.exists(f"{key}/manifest.json"):
        with tempfile.TemporaryDirectory() as tmp:
            pd.DataFrame(records).to_parquet(Path(tmp) / "tasks.parquet", index=False)
            (Path(tmp) / "manifest.json").write_text(json.dumps(
                {"version": version, "n_train": len(train), "n_test": len(held),
                 "source": "envace synth (benchmarks/learning.py)"}))
            store.put_dir(tmp, key)
    return {"store": store_root, "key": key, "dir": store.uri(key), "version": version,
            "n_train": len(train), "n_test": len(held)}


# ---------------------------------------------------------------------------------- statistics
def t_interval(xs: list[float]) -> tuple[float, float]:
    """95% Student-t interval of the mean of xs (n >= 2)."""
    from scipy import stats

    m, n = statistics.fmean(xs), len(xs)
    h = stats.t.ppf(0.975, n - 1) * statistics.stdev(xs) / n ** 0.5
    return m - h, m + h


def item_means(per_seed: dict[int, dict[str, list[float]]], metric: str) -> list[float]:
    """Per-item values of `metric` averaged over seeds (every seed measures the same items in the
    same order: the held-out tasks / transitions; raises BenchmarkError otherwise)."""
    cols = [v[metric] for v in per_seed.values() if v[metric]]
    if not cols:
        return []
    if len({len(c) for c in cols}) != 1:
        raise BenchmarkError(f"seeds measured different numbers of items for {metric}: {[len(c) for c in cols]}")
    return [statistics.fmean(xs) for xs in zip(*cols)]


def summarise(per_seed: dict[int, dict[str, list[float]]], metric: str) -> dict[str, Any]:
    """Mean of `metric` with a 95% percentile bootstrap CI over items (held-out tasks or
    transitions; each item first averaged over seeds), plus a Student-t CI over seed means when
    there are >= 2 seeds (`seed_ci`; wide for few seeds: t(0.975, 2) = 4.3).

    `per_seed`: {seed: {metric: per-item values}}."""
    items = item_means(per_seed, metric)
    if not items:
        return {"mean": None, "ci": None, "n": 0, "method": "no data", "seed_ci": None}
    seed_means = [statistics.fmean(v[metric]) for v in per_seed.values() if v[metric]]
    return {"mean": statistics.fmean(items), "ci": bootstrap_ci(items), "n": len(items),
            "method": f"bootstrap over items ({len(seed_means)} seed(s) averaged)",
            "seed_ci": t_interval(seed_means) if len(seed_means) >= 2 else None, "seeds": len(seed_means)}


def paired_difference(a: dict[int, dict[str, list[float]]], b: dict[int, dict[str, list[float]]],
                      metric: str) -> dict[str, Any]:
    """Mean of (a - b) over the same items (each averaged over its condition's seeds) with a 95%
    percentile bootstrap CI over items; None when either side has no data."""
    xa, xb = item_means(a, metric), item_means(b, metric)
    if not xa or not xb:
        return {"mean": None, "ci": None, "n": 0}
    if len(xa) != len(xb):
        raise BenchmarkError(f"paired difference over different item counts ({len(xa)} vs {len(xb)})")
    d = [x - y for x, y in zip(xa, xb)]
    return {"mean": statistics.fmean(d), "ci": bootstrap_ci(d), "n": len(d)}


# -------------------------------------------------------------------------------- measurements
def iteration_tokens(rec: dict[str, Any]) -> int:
    """Generated tokens of one training iteration (its rollout tokens/s x rollout seconds)."""
    return round(rec.get("rollout_tokens_per_s", 0.0) * rec.get("rollout_seconds", 0.0))


def rehearse_fidelity(cfg, adapter_dir: str | None, held: list, limit: int) -> list[dict[str, Any]]:
    """Per-transition REHEARSE rows on held-out real transitions, scored as `stages.validate` does."""
    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.roles.errors import ParseError
    from envace_core.roles.rehearse import parse_rehearse, rehearse_prompt_ids
    from envace_core.stages.validate import held_out_transitions
    from envace_core.training.policy import load_policy
    from envace_core.training.rewards import fidelity

    trans = held_out_transitions(held, limit)
    model, tok, _ = load_policy(cfg, adapter_dir)
    engine = HFEngine(model, tok, compute_dtype=cfg.model.compute_dtype)
    prompts = [rehearse_prompt_ids(tok, task_context(t, cfg.data.policy_max_chars), h, c,
                                   max_observation_tokens=cfg.rollout.max_observation_tokens)
               for t, h, c, _ in trans]
    sp = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens_rehearse, temperature=0.0, role="rehearse")
    rows = []
    for (task, _, call, real), outs in zip(trans, engine.generate(prompts, sp)):
        try:
            pred = parse_rehearse(tok.decode(outs[0].token_ids, skip_special_tokens=True))
            rows.append({"id": f"{task.id}#{call.id}", "json_valid": 1.0, "fidelity": fidelity(pred, real)})
        except ParseError:
            rows.append({"id": f"{task.id}#{call.id}", "json_valid": 0.0, "fidelity": 0.0})
    return rows


def measure(cfg, dataset: dict[str, Any], adapter_dir: str | None, held: list,
            max_transitions: int) -> dict[str, Any]:
    """Held-out ACT success per task (`stages.evaluate`, no rehearsal) and fidelity per transition."""
    from envace_core.stages.evaluate import evaluate

    ev = evaluate(cfg, dataset, {"adapter_dir": adapter_dir})
    res = [r for r in ev["results"] if r["condition"] == "no_rehearsal"]
    fid = rehearse_fidelity(cfg, adapter_dir, held, max_transitions)
    return {"success": [r["success"] for r in res], "task_ids": [r["task_id"] for r in res],
            "terminations": [r["termination_reason"] for r in res],
            "fidelity": [r["fidelity"] for r in fid], "json_validity": [r["json_valid"] for r in fid]}


def preset_key(preset: dict[str, Any]) -> dict[str, Any]:
    """The preset settings that decide a report's runs (not the seed list, which only selects runs)."""
    return json.loads(json.dumps({k: v for k, v in preset.items() if k not in ("synthesize", "seeds")}))


def condition_config(overrides: dict[str, Any], cond: str, seed: int):
    """The RunConfig of condition `cond` (`CONDITIONS`) for `seed`: the preset's `overrides`, then the
    condition's, with train.seed = `seed` (it seeds the warm start and the GRPO phase alike)."""
    from envace_core.config import load_config

    spec = CONDITIONS[cond] or {}
    return load_config("cpu-smoke", _merge(overrides, {**spec, "train": {**spec.get("train", {}), "seed": seed}}))


def settings_key(overrides: dict[str, Any], seed: int) -> str:
    """sha256 (16 hex) of the resolved settings every condition starts from (`condition_config` of the base
    condition: the cpu-smoke profile, the config defaults and the preset's `overrides`), without where files go
    (``store``) and the seed: a report made under other product settings (e.g. another ``reward.fidelity_lambda``
    in the profile) does not resume into this one."""
    import hashlib

    settings = condition_config(overrides, "base", seed).to_dict()
    settings.pop("store", None)
    settings.get("train", {}).pop("seed", None)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def start_dir(warm: dict[str, Any] | None) -> str | None:
    """The adapter a trained run started from, given its warm start (a `warm_start` result or its recorded
    lineage): the warm start's own adapter (`warm_adapter_dir`), else the train.init_adapter it passed on
    unchanged (no SFT); None without either, or when the warm start's adapter is gone."""
    try:
        return warm_adapter_dir(warm) or (warm or {}).get("init_adapter")
    except EnvaceError:
        return None


def warm_adapter_dir(warm: dict[str, Any] | None) -> str | None:
    """Local directory of a `stages.warm_start.warm_start` result's adapter (`store.uri.init_adapter_dir`
    of its adapter_uri); None without a warm start or for one without an adapter (no SFT, no
    train.init_adapter: the fresh LoRA, i.e. the base model's function)."""
    from envace_core.store.uri import init_adapter_dir

    if not warm or not warm.get("adapter_uri"):
        return None
    return str(init_adapter_dir(warm["adapter_uri"], f"the adapter_uri of warm start {warm['warm_start_id']}"))


def train_to_budget(cfg, dataset: dict[str, Any], warm: dict[str, Any] | None, budget: int, max_iterations: int,
                    eval_every: int, on_eval: Callable[[str, int], dict] | None = None) -> dict[str, Any]:
    """`stages.rollout_and_train` from the warm start `warm` (`stages.warm_start.warm_start` of
    `cfg`; None: train.init_adapter or a fresh LoRA) in chunks until the cumulative generated tokens
    first reach `budget`.

    A chunk never runs past the point where the budget could be reached (sized from 1.5x the most
    tokens any iteration so far generated; 1 iteration when unknown) nor past `eval_every`; the
    previous chunk's checkpoint is copied to the next chunk's run id so the stage resumes it exactly.
    Returns {"history", "adapter_dir", "tokens", "iterations", "overshoot_iterations", "curve_heldout"}.
    """
    from envace_core.stages.train import rollout_and_train
    from envace_core.store.uri import open_store
    from envace_core.training.loop import training_run_id

    if cfg.train.lr_scheduler != "constant" or cfg.train.warmup_iterations:
        raise BenchmarkError("train_to_budget resumes across chunks with a constant LR only: set "
                             "train.lr_scheduler=constant, train.warmup_iterations=0")
    store, history, prev, curve, trained = open_store(cfg.store.root), [], None, [], None
    while True:
        toks = [iteration_tokens(h) for h in history]
        if (toks and sum(toks) >= budget) or len(history) >= max_iterations:
            break
        room = int((budget - sum(toks)) // (1.5 * max(toks))) if toks and max(toks) else 1
        k = max(1, min(room, eval_every or room, max_iterations - len(history)))
        c = cfg.model_copy(deep=True)
        c.train.iterations = len(history) + k
        key = f"runs/{training_run_id(c, dataset, warm)}/checkpoint"
        if prev and not store.exists(f"{key}/state.json"):
            _copy_checkpoint(store, prev, key)
        trained = rollout_and_train(c, dataset, warm)
        history, prev = trained["history"], key
        if on_eval and eval_every and len(history) % eval_every == 0:
            curve.append({"iteration": len(history), "tokens": sum(iteration_tokens(h) for h in history),
                          **on_eval(trained["adapter_dir"], len(history))})
    cum, first = 0, len(history)
    for i, h in enumerate(history):
        cum += iteration_tokens(h)
        if cum >= budget:
            first = i + 1
            break
    return {"history": history, "adapter_dir": trained["adapter_dir"] if trained else None,
            "tokens": sum(iteration_tokens(h) for h in history), "iterations": len(history),
            "overshoot_iterations": len(history) - first, "curve_heldout": curve}


def _copy_checkpoint(store, src: str, dst: str) -> None:
    """Copy a checkpoint to another key; put_dir writes a fresh CHECKSUMS.json for the copy."""
    import shutil

    from envace_core.store.files import CHECKSUMS

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(store.get_dir(src), Path(tmp) / "ckpt", ignore=shutil.ignore_patterns(CHECKSUMS))
        store.put_dir(Path(tmp) / "ckpt", dst)


# ------------------------------------------------------------------------------------- reporting
def plot_curve(runs: dict[str, dict[int, dict]], path: Path) -> None:
    """Train success rate (lines) and held-out success (markers) against generated tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for ci, (cond, seeds) in enumerate(runs.items()):
        color = f"C{ci}"
        for s, run in seeds.items():
            hist = run.get("history") or []
            xs = [sum(iteration_tokens(h) for h in hist[:i + 1]) for i in range(len(hist))]
            lab = cond if s == min(seeds) else None
            if hist:
                a1.plot(xs, [h.get("success_rate") or 0.0 for h in hist], "-o", color=color, alpha=.7, label=lab)
                a2.plot(xs, [h.get("reward_mean/act") or 0.0 for h in hist], "-o", color=color, alpha=.7, label=lab)
            pts = run.get("curve_heldout") or []
            a1.plot([p["tokens"] for p in pts], [statistics.fmean(p["success"]) for p in pts], "s",
                    color=color, ms=8, mfc="none")
            if run.get("final"):
                a1.axhline(statistics.fmean(run["final"]["success"] or [0]), color=color, ls=":", lw=1)
    a1.set(xlabel="generated tokens", ylabel="success rate", title="train (lines) / held-out final (dotted)")
    a2.set(xlabel="generated tokens", ylabel="mean ACT reward", title="train reward per iteration")
    for a in (a1, a2):
        a.set_ylim(-0.05, 1.05)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(s: dict[str, Any] | None, signed: bool = False) -> str:
    """``mean [lo, hi]`` of a summary or paired difference ("—" without data); `signed` for differences."""
    if not s or s.get("mean") is None:
        return "—"
    f = "+.3f" if signed else ".3f"
    return f"{s['mean']:{f}} [{s['ci'][0]:{f}}, {s['ci'][1]:{f}}]"


def _seed_ci(s: dict[str, Any]) -> str:
    return f"[{s['seed_ci'][0]:.3f}, {s['seed_ci'][1]:.3f}]" if s.get("seed_ci") else "—"


def markdown(report: dict[str, Any]) -> str:
    """Two tables: per condition (CIs over held-out items, seeds averaged; t over seeds), and the
    paired differences against the warm start ("sft") and standard GRPO."""
    rows = [("| condition | seeds | held-out ACT success (95% CI over tasks) | t-CI over seeds | "
             "REHEARSE fidelity (95% CI over transitions) | t-CI over seeds | JSON validity | "
             "iterations (per seed) | generated tokens (per seed) | train frac_zero_std (mean) | "
             "real env steps in training, rollouts / reward (per seed) |"),
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cond, s in report["summary"].items():
        steps = [env_steps(r["history"]) for r in report["runs"][cond].values()]
        shown = ", ".join(f"{'—' if x['rollouts'] is None else x['rollouts']} / "
                          f"{'—' if x['reward_replays'] is None else x['reward_replays']}" for x in steps)
        rows.append(f"| {cond} | {s['success'].get('seeds', 1)} | {_fmt(s['success'])} (n={s['success']['n']}) | "
                    f"{_seed_ci(s['success'])} | {_fmt(s['fidelity'])} (n={s['fidelity']['n']}) | "
                    f"{_seed_ci(s['fidelity'])} | {_fmt(s['json_validity'])} | {s['iterations']} | "
                    f"{s['tokens']} | {s['frac_zero_std']} | {shown} |")
    diffs = [(cond, k, v) for cond, s in report["summary"].items() for k, v in s.items() if "_vs_" in k]
    if diffs:
        rows += ["", "| condition | difference (same held-out items, 95% bootstrap CI) | mean [CI] | n |",
                 "|---|---|---|---|"]
        rows += [f"| {cond} | {k.replace('_vs_', ' − ')} | "
                 f"{_fmt(v, signed=True)} | {v['n']} |"
                 for cond, k, v in diffs]
    return "\n".join(rows)


# -------------------------------------------------------------------------------------------- run
def run(preset: dict[str, Any], out: Path, conditions: list[str], log: Callable[[str], None] = print,
        model_ref: str | None = None, merge: list[Path] = (), results_json: Path | None = None) -> dict[str, Any]:
    """The whole benchmark for one preset; returns the JSON-able report (also written to out/).

    Each trained condition first gets its warm start from the warm_start stage (module docstring;
    trained once per id into out/store, reused afterwards). A report in `out` made with the same
    preset, dataset, base model (`models.base_model_lineage`; with the preset and seed they decide
    every warm start id) and resolved settings (`settings_key`) resumes: its finished (condition, seed) runs are
    kept.

    `merge`: other output folders of the same preset, dataset and base model (e.g. conditions run
    in a second process); their finished runs count as done here. A folder whose report was made
    with other settings raises BenchmarkError. `results_json`: where `results_summary` is also written,
    after every finished run (so a partial measurement is on disk)."""
    from envace_core.models import base_model_lineage
    from envace_core.stages.train import warm_start_lineage
    from envace_core.stages.warm_start import warm_start

    t0 = time.perf_counter()
    domains = preset.get("domains", ["airline", "retail"])
    over = json.loads(json.dumps(preset["overrides"]))
    over.setdefault("data", {})["domains"] = domains
    over["store"] = {"root": str(out / "store"), "registry": str(out / "registry")}
    if model_ref:
        over["model"] = {"ref": model_ref}
    if preset.get("init_adapter"):
        over.setdefault("train", {})["init_adapter"] = preset["init_adapter"]
    if preset.get("dataset_dir"):
        train, held = dataset_curriculum(preset, domains)
    else:
        train, held = curriculum(domains, preset["levels"], preset["tasks_per_level"],
                                 preset.get("synthetic_seed", 0), preset["heldout_mod"],
                                 preset.get("synthesize"))
    dataset = write_dataset(str(out / "store"), train, held, domains)
    log(f"[learning] curriculum: {len(train)} train / {len(held)} held-out synthesized tasks "
        f"(levels {preset['levels']}), dataset {dataset['version']}")
    runs: dict[str, dict[int, dict]] = {}
    base_model = base_model_lineage(condition_config(over, "base", preset["seeds"][0]).model.ref)
    report_key = {"preset": preset_key(preset), "dataset": dataset["version"], "base_model": base_model["sha256"],
                  "settings": settings_key(over, preset["seeds"][0])}
    done = _finished_runs(out, report_key)  # a killed benchmark resumes: finished (condition, seed) runs are kept
    for other in merge:
        theirs = _finished_runs(Path(other), report_key)
        if not theirs:
            raise BenchmarkError(f"--merge {other}: no learning.json there with this preset, dataset and base model")
        for cond, seeds in theirs.items():
            done.setdefault(cond, {}).update(seeds)
    for cond, seeds in done.items():  # conditions not asked for this time stay in the report
        if cond not in conditions and cond in CONDITIONS:
            runs[cond] = dict(seeds)
    # seed-major: every condition of the first seed finishes before the next seed starts
    for seed in preset["seeds"]:
        for cond in conditions:
            spec = CONDITIONS[cond]  # None: base model; {}: the warm start only; else GRPO on top of it
            if spec is None and seed != preset["seeds"][0]:
                continue  # greedy evaluation of the untrained base does not depend on the seed
            if seed in done.get(cond, {}):
                r = runs.setdefault(cond, {})[seed] = done[cond][seed]
                if spec and "adapter_motion" not in r:  # a report from before it was measured
                    r["adapter_motion"] = adapter_motion(start_dir(r.get("warm_start")), r["adapter_dir"])
                log(f"[learning] {cond} seed {seed}: kept from the previous report")
                continue
            cfg = condition_config(over, cond, seed)
            if cfg.train.policy_per_role and cfg.train.init_adapter and \
                    not (Path(cfg.train.init_adapter) / "act").is_dir():  # one shared adapter: in both roles
                cfg.train.init_adapter = per_role_copy(cfg.train.init_adapter, out / "store" / "per_role_init")
            t1 = time.perf_counter()
            # one warm_start call per condition config; an id already in out/store is reused, not trained
            warm = warm_start(cfg, dataset, say=log) if spec is not None else None
            if not spec:
                r: dict[str, Any] = {"history": [], "tokens": 0, "iterations": 0,
                                     "adapter_dir": warm_adapter_dir(warm)}
            else:
                r = train_to_budget(cfg, dataset, warm, preset["token_budget"], preset["max_iterations"],
                                    preset["eval_every"],
                                    lambda a, _, c=cfg: measure(c, dataset, a, held, preset["max_transitions"]))
            r["warm_start"] = warm_start_lineage(warm)
            if spec:
                r["adapter_motion"] = adapter_motion(start_dir(warm), r["adapter_dir"])
            r["final"] = measure(cfg, dataset, r["adapter_dir"], held, preset["max_transitions"])
            r["seconds"] = time.perf_counter() - t1
            runs.setdefault(cond, {})[seed] = r
            log(f"[learning] {cond} seed {seed}: {r['iterations']} iterations, {r['tokens']} tokens, "
                f"held-out success {statistics.fmean(r['final']['success']):.3f}, fidelity "
                f"{statistics.fmean(r['final']['fidelity'] or [0]):.3f}, {r['seconds']:.0f}s")
            _write_report(out, _report(preset, dataset, train, held, runs, report_key,
                                       time.perf_counter() - t0, complete=False), results_json)
    report = _report(preset, dataset, train, held, runs, report_key, time.perf_counter() - t0, complete=True)
    _write_report(out, report, results_json)
    return report


def _finished_runs(out: Path, key: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """Runs of an earlier report in `out` with the same `key` (preset, dataset, base model; {} otherwise)."""
    f = out / "learning.json"
    if not f.is_file():
        return {}
    try:
        old = json.loads(f.read_text())
    except ValueError as e:
        raise BenchmarkError(f"{f} is not valid JSON ({e}): move it away to start this benchmark afresh") from None
    if old.get("key") != json.loads(json.dumps(key, default=str)):
        return {}
    return {cond: {int(s): r for s, r in seeds.items()} for cond, seeds in old.get("runs", {}).items()}


def _write_report(out: Path, report: dict[str, Any], results_json: Path | None = None) -> None:
    """learning.json (atomically: temp file + rename) and learning_curve.png; with `results_json`, also
    `results_summary` of the report there."""
    atomic_write_text(out / "learning.json", json.dumps(report, indent=1, default=str))
    plot_curve(report["runs"], out / "learning_curve.png")
    if results_json is not None:
        results_json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(results_json, json.dumps(results_summary(report), indent=1, default=str))


# the names the results file gives the conditions (the warm start is "sft" inside this script)
RESULT_NAMES = {"sft": "warm_start"}


def _ci(s: dict[str, Any] | None) -> dict[str, Any]:
    """{"mean", "ci_low", "ci_high", "n"} of a `summarise` / `paired_difference` result (None parts when
    it has no data)."""
    s = s or {}
    lo, hi = s.get("ci") or (None, None)
    return {"mean": s.get("mean"), "ci_low": lo, "ci_high": hi, "n": s.get("n", 0)}


def env_steps(history: list[dict[str, Any]]) -> dict[str, int | None]:
    """Real-environment tool calls of one trained run: {"rollouts", "reward_replays"} summed over its
    iterations (`loop.rollout_metrics`'s ``env_steps/rollout`` and ``env_steps/reward``); None for a
    phase some iteration did not record (a run made before they were counted)."""
    out: dict[str, int | None] = {}
    for key, name in (("env_steps/rollout", "rollouts"), ("env_steps/reward", "reward_replays")):
        vals = [h.get(key) for h in history]
        out[name] = int(sum(vals)) if all(v is not None for v in vals) else None
    return out


def results_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The committed results file: {"run": what was measured and how, <condition>: {"success": held-out
    ACT success {mean, ci_low, ci_high, n} (95 % bootstrap over tasks, each task averaged over seeds) with
    "seed_ci" (Student-t over seed means, >= 2 seeds), "paired": {"vs_warm_start", "vs_standard_grpo"}:
    {mean, ci_low, ci_high, n} (same tasks), "fidelity" (REHEARSE on held-out real transitions), "seeds",
    "n_tasks", "real_env_steps": {"rollouts", "reward_replays"} mean per seed (and "per_seed"),
    "generated_tokens" per seed, "adapter_motion" per seed (`adapter_motion`; None for base and the warm
    start)}}. Conditions are named as `RESULT_NAMES` says (sft → warm_start)."""
    out: dict[str, Any] = {"run": {
        "complete": report["complete"], "preset": report["preset"], "dataset": report["dataset"]["version"],
        "n_train_tasks": report["dataset"]["n_train"], "n_heldout_tasks": report["dataset"]["n_test"],
        "token_budget": report["preset"].get("token_budget"), "wall_seconds": report["wall_seconds"],
        "ci": "success/fidelity: 95% percentile bootstrap over held-out items (each averaged over seeds); "
              "seed_ci: Student-t over seed means; paired: bootstrap over the same items",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
    for cond, s in report["summary"].items():
        seeds = report["runs"][cond]
        steps = {str(k): env_steps(r["history"]) for k, r in seeds.items()}
        mean_steps = {}
        for name in ("rollouts", "reward_replays"):
            vals = [v[name] for v in steps.values()]
            mean_steps[name] = statistics.fmean(vals) if vals and None not in vals else None
        seed_ci = s["success"].get("seed_ci")
        out[RESULT_NAMES.get(cond, cond)] = {
            "success": {**_ci(s["success"]),
                        "seed_ci": {"ci_low": seed_ci[0], "ci_high": seed_ci[1]} if seed_ci else None},
            "paired": {"vs_warm_start": _ci(s.get("success_vs_sft")) if cond != "sft" else None,
                       "vs_standard_grpo": _ci(s.get("success_vs_standard_grpo")) if cond != "standard_grpo" else None},
            "fidelity": _ci(s["fidelity"]), "seeds": sorted(int(k) for k in seeds),
            "n_tasks": s["success"]["n"], "real_env_steps": {**mean_steps, "per_seed": steps},
            "generated_tokens": s["tokens"],
            "adapter_motion": [r.get("adapter_motion") for r in seeds.values()] if CONDITIONS.get(cond) else None}
    return out


def _report(preset, dataset, train, held, runs, key, wall: float, complete: bool) -> dict[str, Any]:
    """The JSON-able report of the runs so far: summaries per condition and paired differences, and
    "warm_starts" {warm_start_id: `warm_start_lineage`} over the runs (each run also records its own
    under "warm_start"; None for base)."""
    runs = {c: runs[c] for c in CONDITIONS if c in runs}  # table order
    warms = {r["warm_start"]["warm_start_id"]: r["warm_start"]
             for seeds in runs.values() for r in seeds.values() if r.get("warm_start")}
    report = {"key": key, "complete": complete,
              "preset": {k: v for k, v in preset.items() if k != "synthesize"}, "dataset": dataset,
              "warm_starts": warms, "held_out_ids": [t.id for t in held], "train_ids": [t.id for t in train],
              "summary": {}, "runs": runs, "wall_seconds": wall}
    for cond, seeds in runs.items():
        finals = {s: r["final"] for s, r in seeds.items()}
        hist = [h for r in seeds.values() for h in r["history"]]
        zs = [h["frac_zero_std"] for h in hist if h.get("frac_zero_std") is not None]
        report["summary"][cond] = {
            **{m: summarise(finals, m) for m in ("success", "fidelity", "json_validity")},
            "iterations": [r["iterations"] for r in seeds.values()],
            "tokens": [r["tokens"] for r in seeds.values()],
            "frac_zero_std": round(statistics.fmean(zs), 3) if zs else "—",
            **({f"{m}_vs_{ref}": paired_difference(finals, {k: v["final"] for k, v in runs[ref].items()}, m)
                for m in ("success", "fidelity") for ref in ("sft", "standard_grpo")
                if ref in runs and ref != cond}),
            "seconds_per_iteration": (statistics.fmean(h["seconds"] for h in hist) if hist else None)}
    return report


def _merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def probe(n_tasks: int, group: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Base model on level-1 synthesized tasks, real env, T=1: share of ACT outputs that parse as a
    tool call and trajectory success rate (the learning signal GRPO can get at all)."""
    from envace_core.config import load_config
    from envace_core.engines.hf import HFEngine
    from envace_core.envs.tau2.synth import synthesize
    from envace_core.training.policy import load_policy, rollout_params
    from envace_core.training.rollout import training_group
    from envace_core.types import Role

    tasks = synthesize("airline", n_tasks, [1], 0) + synthesize("retail", n_tasks, [1], 0)
    cfg = load_config("cpu-smoke", _merge(overrides, {"rollout": {"source": "real", "group_size": group}}))
    model, tok, _ = load_policy(cfg)
    engine = HFEngine(model, tok, compute_dtype=cfg.model.compute_dtype)
    acts, calls, wins = 0, 0, []
    for i, t in enumerate(tasks):
        for tr in training_group(engine, t, cfg, rollout_params(cfg), seed=i):
            wins.append(float((tr.reward or 0) >= 1.0))
            for g in tr.generations:
                if g.role == Role.ACT:
                    acts, calls = acts + 1, calls + int("<tool_call>" in g.text and g.parse_error is None)
    return {"tasks": len(tasks), "group_size": group, "act_outputs": acts, "tool_call_rate": calls / max(acts, 1),
            "success_rate": statistics.fmean(wins), "generated_tokens": engine.stats["generated_tokens"]}


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """(preset, conditions) from the command line, every value checked before any work starts (a bad
    one is `ap.error`, exit 2): seeds (distinct integers in [0, 2**32)), conditions, --out (a folder that
    can be made), --results-json (a writable file that is not the resume report), --results-md (when
    appended to), --merge (folders holding a report of the same preset)."""
    preset = dict(PRESETS[args.preset])
    if args.seeds:
        try:
            preset["seeds"] = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            ap.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1")
        if len(set(preset["seeds"])) != len(preset["seeds"]):
            ap.error(f"--seeds {args.seeds!r}: seeds repeat")
        if any(not 0 <= x < 2 ** 32 for x in preset["seeds"]):
            ap.error(f"--seeds {args.seeds!r}: each seed must be in [0, 2**32)")
    if (args.preset in ADAPTER_PRESETS) != bool(args.init_adapter and args.dataset) or \
            (args.preset not in ADAPTER_PRESETS and (args.init_adapter or args.dataset)):
        ap.error(f"--init-adapter and --dataset go together with --preset {' or '.join(ADAPTER_PRESETS)} (and "
                 "only with those)")
    if args.init_adapter:
        if not (Path(args.init_adapter) / "adapter_config.json").is_file():
            ap.error(f"--init-adapter {args.init_adapter}: no adapter_config.json there (give a LoRA adapter folder)")
        from envace_core.models import check_adapter_dir

        try:  # its weights and config, as `envace eval --model` checks them (no model loads)
            check_adapter_dir(args.init_adapter)
        except EnvaceError as e:
            ap.error(f"--init-adapter {args.init_adapter}: {' '.join(str(e).split())}")
        if not (Path(args.dataset) / "tasks.parquet").is_file():
            ap.error(f"--dataset {args.dataset}: no tasks.parquet there (give .envace/store/datasets/<version>)")
        # absolute but not resolved: a store's dataset folder is a link to its versioned copy, and the held-out
        # file is named after the folder as given (rehearsal_effect_heldout.heldout_tasks)
        preset["init_adapter"] = os.path.abspath(args.init_adapter)
        preset["dataset_dir"] = os.path.abspath(args.dataset)
    from rehearsal_effect import comma_items

    try:
        conds = comma_items(args.conditions, "--conditions")
    except EnvaceError as e:
        ap.error(str(e))
    bad = [c for c in conds if c not in CONDITIONS]
    if bad or not conds or len(set(conds)) != len(conds):
        ap.error(f"--conditions {args.conditions!r}: give distinct names from {list(CONDITIONS)}"
                 + (f" (unknown: {bad})" if bad else ""))
    if not args.out.strip():
        ap.error("--out is empty: give the benchmark's folder, e.g. .envace/bench/learning")
    out = Path(args.out)
    why = writable_dir_problem(out)  # made and tried with a real file, as the report paths below
    if why:
        ap.error(f"--out {args.out}: {why}")
    if args.results_json:  # a bad place fails now, not after hours of training
        rj = Path(args.results_json)
        if rj.resolve() == (out / "learning.json").resolve():
            ap.error(f"--results-json {rj}: that is the resume report under --out; give another file, "
                     "e.g. benchmarks/results/learning.json")
        why = writable_file_problem(rj)
        if why:
            ap.error(f"--results-json {rj}: {why}")
    if not args.no_append:
        why = writable_file_problem(args.results_md)
        if why:
            ap.error(f"--results-md {args.results_md}: {why} (or pass --no-append)")
    from rehearsal_effect import check_report_targets

    try:  # neither report over an input or the other report (RESULTS.md under --results-json)
        check_report_targets([("--results-json", args.results_json, "json")]
                             + ([("--results-md", args.results_md, "md")] if not args.no_append else []))
    except EnvaceError as e:
        ap.error(str(e))
    for m in args.merge if args.results_json else ():
        if Path(args.results_json).resolve() == (Path(m) / "learning.json").resolve():
            ap.error(f"--results-json {args.results_json} is the report of --merge {m}, which this run reads; "
                     "give another file")
    for m in args.merge:  # cheap checks first: the full key check needs the curriculum and base model
        f = Path(m) / "learning.json"
        try:
            other = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--merge {m}: cannot read {f} ({e})")
        if not isinstance(other, dict) or not isinstance(other.get("key"), dict):
            ap.error(f"--merge {m}: {f} is not a learning.py report (no key object)")
        if other["key"].get("preset") != preset_key(preset):
            ap.error(f"--merge {m}: its report was made with another preset than --preset {args.preset}")
    return preset, conds


def main() -> int:
    from envace_core.cli_args import OnceArgumentParser

    ap = OnceArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--seeds", default="", help="comma-separated; default: the preset's")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--out", default=".envace/bench/learning")
    ap.add_argument("--results-md", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--merge", action="append", default=[], metavar="DIR",
                    help="another --out of the same preset (e.g. conditions run in a second process): "
                         "its finished runs are kept; repeatable")
    ap.add_argument("--probe", action="store_true", help="only measure the base model's tool-call rate")
    ap.add_argument("--init-adapter", default="", metavar="DIR",
                    help="presets from_adapter*: the LoRA adapter every condition starts from (its warm start)")
    ap.add_argument("--dataset", default="", metavar="DIR",
                    help="presets from_adapter*: the curated dataset folder whose train split the adapter and GRPO use")
    ap.add_argument("--results-json", default="", metavar="FILE",
                    help="also write the summary in the committed format here after every finished run "
                         "(e.g. benchmarks/results/learning.json); default: none")
    args = ap.parse_args()
    if args.probe:
        given = [f for f, v in (("--seeds", args.seeds), ("--results-json", args.results_json),
                                ("--merge", args.merge)) if v]
        if given:
            ap.error(f"--probe measures the base model only: {', '.join(given)} do not apply")
        print(json.dumps(probe(3, 8, PRESETS[args.preset]["overrides"]), indent=1))
        return 0
    preset, conds = check_args(ap, args)
    try:
        report = run(preset, Path(args.out), conds, merge=[Path(m) for m in args.merge],
                     results_json=Path(args.results_json) if args.results_json else None)
    except EnvaceError as e:
        print(f"learning.py: error: {e}", file=sys.stderr)
        return 1
    table = markdown(report)
    cmd = " ".join([".venv/bin/python"] + sys.argv)
    print(table)
    print(f"wall {report['wall_seconds']:.0f}s; report {args.out}/learning.json, plot {args.out}/learning_curve.png")
    if not args.no_append:
        with open(args.results_md, "a") as f:
            f.write(f"\n### learning.py run, preset {args.preset} ({time.strftime('%Y-%m-%d')})\n\n"
                    f"Command: `{cmd}`; wall {report['wall_seconds']:.0f} s; "
                    f"{report['dataset']['n_train']} train / {report['dataset']['n_test']} held-out "
                    f"synthesized tasks; token budget {preset['token_budget']} per run.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
