"""The `evaluate` stage: the tau2 evaluation harness with and without Private Rehearsal on held-out tasks."""

from __future__ import annotations

from typing import Any

from envace_core.config import RunConfig
from envace_core.stages.compare import compare_models
from envace_core.stages.console import print_comparison_table, print_eval_table
from envace_core.stages.dataset import load_dataset
from envace_core.training.heap import release_free_heap
from envace_core.training.policy import load_policy, policy_engine


# -------------------------------------------------------------------------------------- evaluate
def evaluate(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """The dataset's tau2 test tasks through `evaluation.tau2.evaluate_policy` under ``eval.protocol``,
    without rehearsal ("no_rehearsal") and, unless ``rehearsal.mode`` is "none", with it ("<mode>:<n>").

    One trial per task, seed ``train.seed``; under tau2_orchestrator the policy also simulates the user
    (`protocols.MAX_STEPS` steps, `protocols.USER_MAX_NEW_TOKENS` tokens per reply), the defaults of
    `envace eval`, so ``envace eval --protocol P --rehearsal <mode>:<n> --seed <train.seed>`` on the same
    model and tasks gives the same records. Errors inside a task propagate (a job does not score a crash 0).

    Returns {"summary": {"<condition>|<domain or all>": `tau2.summarize_results` + "pass^1" (tau2's pass^1
    over scored tasks, None when none was scored) + "n" (tasks)}, "results": the harness records, each
    with its "condition", "comparison": `compare.compare_models` (base and warm start vs the trained
    policy on the test and held-out synthesized tasks, ``eval.compare``; {} when off), "protocol":
    `protocols.describe` of the protocol used}.
    """
    from envace_core.evaluation.protocols import MAX_STEPS, TAU2_ORCHESTRATOR, USER_MAX_NEW_TOKENS, describe
    from envace_core.evaluation.tau2 import evaluate_policy

    model, tok, _ = load_policy(cfg, trained["adapter_dir"])
    engine = policy_engine(cfg, model, tok)
    protocol = cfg.eval.protocol
    conditions = {"no_rehearsal": ("none", 0)}
    if cfg.rehearsal.mode != "none":
        conditions[f"{cfg.rehearsal.mode}:{cfg.rehearsal.n}"] = (cfg.rehearsal.mode, cfg.rehearsal.n)
    tasks = load_dataset(dataset, "test")
    results = []
    for cond, (mode, n) in conditions.items():  # eval.concurrency tasks at a time, engine calls merged
        run = evaluate_policy(cfg, engine, tasks, protocol, mode=mode, n=n, seed=cfg.train.seed, raise_errors=True,
                              progress=f"evaluate {cond} ({protocol})")
        results += [{"condition": cond, **r} for r in run["results"]]
    summary = summarise_eval(results)
    print_eval_table(summary, protocol)
    _print_isolation(results)
    del model, engine  # the comparison loads each model in turn
    release_free_heap()
    comparison = compare_models(cfg, dataset, trained, [r for r in results if r["condition"] == "no_rehearsal"])
    if comparison:
        print_comparison_table(comparison["summary"], protocol)
    user = f"the evaluated policy itself, {USER_MAX_NEW_TOKENS} tokens per reply"
    extra = {"max_steps": MAX_STEPS, "user_model": user} if protocol == TAU2_ORCHESTRATOR else \
        {"max_turns": cfg.eval.max_turns}
    return {"summary": summary, "results": results, "comparison": comparison,
            "protocol": describe(protocol, trials=1, seed=cfg.train.seed, **extra)}


def summarise_eval(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{"<condition>|<domain>" and "<condition>|all": `tau2.summarize_results` + "pass^1" + "n"}, per
    condition its domains in order and then "all"."""
    from envace_core.evaluation.tau2 import summarize_results

    groups: dict[str, list[dict[str, Any]]] = {}
    for cond in dict.fromkeys(r["condition"] for r in results):
        rs = [r for r in results if r["condition"] == cond]
        for dom in sorted({r["domain"] for r in rs}):
            groups[f"{cond}|{dom}"] = [r for r in rs if r["domain"] == dom]
        groups[f"{cond}|all"] = rs
    out = {}
    for key, rs in groups.items():
        s = summarize_results(rs, trials=1)
        out[key] = {"pass^1": s["pass_hat_k"].get(1), "n": s["n_tasks"], **s}
    return out


def _print_isolation(results: list[dict[str, Any]]) -> None:
    rehearsed = [r for r in results if r["agent_stats"].get("rehearsals")]
    if not rehearsed:
        return
    checked = [r["isolation"] for r in rehearsed if r.get("isolation")]
    calls = sum(i["real_calls_during_rehearsal"] for i in checked)
    same = all(i["db_hash_unchanged"] for i in checked)
    print(f"[evaluate] isolation: {sum(r['agent_stats']['rehearsals'] for r in rehearsed)} rehearsals over "
          f"{len(rehearsed)} tasks made {calls} real tool calls; real DB hash unchanged: {same}"
          + ("" if len(checked) == len(rehearsed) else " (tau2_orchestrator: the agent has no environment handle)")
          + f"; {sum(r['agent_stats'].get('rejected', 0) for r in rehearsed)} rehearsals rejected by the verifier")
