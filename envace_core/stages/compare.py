"""Base model vs warm start vs trained policy on the same held-out tasks, with paired 95 % CIs.

Part of the `evaluate` stage: what a run changed is the trained policy's success against the model
it started from (the SFT warm start, METHOD.md §2b) and against the base model, on the same tasks.
Every model acts greedily without rehearsal (``eval.*``, one trial, seed ``train.seed``) under the
evaluate stage's protocol, on two task sets:

- ``test``: the dataset's tau2 test tasks (the benchmark's own held-out split);
- ``heldout``: synthesized tasks of the train split's levels that training never saw
  (``data.synthetic_heldout_per_domain``, split `synth.HELDOUT_SPLIT`).

Per task set and model: pass^1 (mean of tau2's success over scored tasks) with a 95 % percentile
bootstrap CI over tasks; per pair (trained − base, trained − warm start, warm start − base) the
mean paired difference of success on the tasks scored under both, with its bootstrap CI (resampling
tasks, the same draw for both models: a paired bootstrap, e.g. Dror et al. 2018, "The Hitchhiker's
Guide to Testing Statistical Significance in NLP", §3.2). A task unscored under a model (reward
None) is left out of that model's pairs, never counted as 0.
"""

from __future__ import annotations

from typing import Any, Callable

from envace_core.config import RunConfig
from envace_core.stages.dataset import load_dataset

PAIRS = (("trained", "base"), ("trained", "warm_start"), ("warm_start", "base"))


def task_sets(dataset: dict[str, Any]) -> dict[str, list]:
    """{"test": the dataset's test tasks, "heldout": its held-out synthesized tasks} (a set with no
    task is left out)."""
    from envace_core.envs.tau2.synth import HELDOUT_SPLIT

    sets = {"test": load_dataset(dataset, "test"), "heldout": load_dataset(dataset, HELDOUT_SPLIT)}
    return {k: v for k, v in sets.items() if v}


def warm_start_adapter(cfg: RunConfig, trained: dict[str, Any]) -> str | None:
    """A local folder of the warm start's adapter the run started from (fetched from the artifact
    store: on a cluster the warm_start stage ran in another pod); without SFT steps the run's
    train.init_adapter (the adapter it started from), or None when it started from a fresh LoRA
    (then there is nothing between base and trained to compare)."""
    from envace_core.stages.warm_start import WARM_START_KEY
    from envace_core.store.uri import init_adapter_dir, open_store

    warm = trained.get("warm_start") or {}
    if not warm.get("steps"):  # no SFT: the run started from train.init_adapter (or a fresh LoRA)
        if not warm.get("init_adapter"):
            return None
        return str(init_adapter_dir(warm["init_adapter"]))
    if not warm.get("warm_start_id"):
        return None
    key = WARM_START_KEY.format(warm_start_id=warm["warm_start_id"])
    return str(open_store(cfg.store.root).get_dir(key) / "adapter")


def success_by_task(records: list[dict[str, Any]]) -> dict[str, float]:
    """{task id: success (0/1)} over the scored records (success not None)."""
    return {r["task_id"]: float(r["success"]) for r in records if r.get("success") is not None}


def summarize(success: dict[str, dict[str, dict[str, float]]], n_tasks: dict[str, int]) -> dict[str, Any]:
    """`success` {task set: {model: {task id: 0/1}}} → {task set: {"n_tasks", "models": {model:
    `stats.mean_ci` of success}, "paired": {"<a> - <b>": `stats.mean_ci` of the per-task differences
    on the tasks scored under both}}}."""
    from envace_core.evaluation.stats import mean_ci

    out: dict[str, Any] = {}
    for name, by_model in success.items():
        models = {m: mean_ci(list(s.values())) for m, s in by_model.items()}
        paired = {}
        for a, b in PAIRS:
            if a in by_model and b in by_model:
                both = sorted(set(by_model[a]) & set(by_model[b]))
                paired[f"{a} - {b}"] = mean_ci([by_model[a][t] - by_model[b][t] for t in both])
        out[name] = {"n_tasks": n_tasks[name], "models": models, "paired": paired}
    return out


def regressions(summary: dict[str, Any]) -> list[str]:
    """One line per (task set, pair) of `summarize`'s result where the trained policy scores below the
    model it is compared with (trained − base or trained − warm start: mean < 0), saying whether the
    paired 95 % CI lies wholly below 0 ("significant") or includes 0 ("within noise"). Empty when the
    trained policy is at least as good everywhere or nothing was compared."""
    out = []
    for set_name, s in (summary or {}).items():
        for pair in ("trained - base", "trained - warm_start"):
            d = s.get("paired", {}).get(pair) or {}
            if d.get("mean") is None or d["mean"] >= 0:
                continue
            lo, hi = d["ci95"]
            how = "significant: the CI is below 0" if hi < 0 else "within noise: the CI includes 0"
            out.append(f"{set_name}: {pair.replace('_', ' ')} = {d['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                       f"over {d['n']} tasks ({how})")
    return out


def compare_models(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any],
                   trained_test_records: list[dict[str, Any]],
                   say: Callable[[str], None] = print) -> dict[str, Any]:
    """Evaluate ``eval.compare``'s models ("base", "warm_start") and the trained policy on
    `task_sets` without rehearsal (module docstring); the trained policy's test-set records are
    `trained_test_records` (the evaluate stage's "no_rehearsal" run), not re-run.

    Returns {"summary": `summarize`'s result, "results": the harness records of the runs made here,
    each with "model" and "task_set"}; {} when ``eval.compare`` is empty. Errors inside a task
    propagate, as in the evaluate stage."""
    from envace_core.evaluation.tau2 import evaluate_policy
    from envace_core.training.heap import release_free_heap
    from envace_core.training.policy import load_policy, policy_engine

    if not cfg.eval.compare:
        return {}
    sets = task_sets(dataset)
    adapters: dict[str, str | None] = {"base": None}
    if "warm_start" in cfg.eval.compare:
        warm = warm_start_adapter(cfg, trained)
        if warm is None:
            say("[evaluate] no SFT warm start in this run (train.sft_warmup_steps = 0): base vs trained only")
        else:
            adapters["warm_start"] = warm
    if "base" not in cfg.eval.compare:
        adapters.pop("base")
    adapters["trained"] = trained["adapter_dir"]
    results: list[dict[str, Any]] = []
    success: dict[str, dict[str, dict[str, float]]] = {name: {} for name in sets}
    for model_name, adapter in adapters.items():
        todo = {n: ts for n, ts in sets.items() if not (model_name == "trained" and n == "test")}
        if model_name == "trained" and "test" in sets:
            success["test"]["trained"] = success_by_task(trained_test_records)
        if not todo:
            continue
        model, tok, _ = load_policy(cfg, adapter)
        engine = policy_engine(cfg, model, tok)
        for set_name, tasks in todo.items():
            run = evaluate_policy(cfg, engine, tasks, cfg.eval.protocol, mode="none", n=0, seed=cfg.train.seed,
                                  raise_errors=True, progress=f"compare {model_name} on {set_name}")
            recs = [{"model": model_name, "task_set": set_name, **r} for r in run["results"]]
            success[set_name][model_name] = success_by_task(recs)
            results += recs
        del model, engine
        release_free_heap()  # the next model loads into the pages this one freed, not beside them
    return {"summary": summarize(success, {n: len(ts) for n, ts in sets.items()}), "results": results}
