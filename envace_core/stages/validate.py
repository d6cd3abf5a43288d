"""The `validate` stage: rehearsal quality on held-out real transitions, per tool, with a gate."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

import pandas as pd

if TYPE_CHECKING:
    from envace_core.training.rollout import RolloutParams
from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.evaluation.stats import mean_or_none
from envace_core.stages.dataset import load_dataset
from envace_core.store.uri import open_store
from envace_core.training.policy import load_policy, policy_engine
from envace_core.types import Task, ToolCall


# -------------------------------------------------------------------------------------- validate
def held_out_transitions(tasks: list[Task], limit: int, errors: bool = False,
                         keep: Callable[[ToolCall, Any], bool] | None = None) -> list[tuple[Task, list, ToolCall, Any]]:
    """The first `limit` real (task, history, call, observation) transitions of held-out `tasks`:
    their gold actions replayed in the real environment (`training.transitions.real_transitions`,
    canonical rendering), with `errors` each gold call preceded by the deterministic wrong call whose
    real result is an error (its call id gets ``-<probe kind>``, so row ids stay unique). `keep`
    (call, observation) -> bool, when given, skips the transitions it rejects (they do not count
    toward `limit`)."""
    from envace_core.training.transitions import iter_real_transitions

    by_id = {t.id: t for t in tasks}
    out = []
    for tr in iter_real_transitions(tasks, errors=errors, forbid_splits=()):  # lazy: stops after `limit`
        call = tr.call.model_copy(update={"id": f"{tr.call.id}-{tr.probe}"}) if tr.probe else tr.call
        if keep is not None and not keep(call, tr.observation):
            continue
        out.append((by_id[tr.task_id], tr.history, call, tr.observation))
        if len(out) >= limit:
            break
    return out


def fits_budget(params: RolloutParams, tokenizer) -> Callable[[ToolCall, Any], bool]:
    """(call, observation) -> whether the real observation's text, plus the eos, fits REHEARSE's
    budget for the call's tool (`RolloutParams.rehearse_budget`, tokens of `tokenizer`): only then can
    an output within the budget equal it (a longer one is cut with the marker, which is not JSON, so
    every metric but error-vs-success would score 0 whatever the rehearser knows)."""
    from envace_core.roles.bounds import n_tokens

    return lambda call, obs: n_tokens(tokenizer, obs.content) + 1 <= params.rehearse_budget(call.name)


def rehearse_rows(cfg: RunConfig, engine: Any, trans: list[tuple[Task, list, ToolCall, Any]],
                  params: RolloutParams | None = None) -> list[dict[str, Any]]:
    """REHEARSE's greedy prediction ô of each real transition (h, a, o) (`held_out_transitions`),
    one row per transition: {"id": "<task id>#<call id>", "tool", "kind" ("success" / "error": o's),
    "json_valid", "parse_error" (1 - json_valid: the strict REHEARSE parser rejected ô, empty
    included), "fidelity" (F(ô, o), `rewards.fidelity`; 0 when ô does not parse), "error_match",
    "key_f1", "value_f1", "echo_share", "echo_f1", "imagined_f1" (`evaluation.fidelity.score_pair`;
    the last three None where undefined)}, all in [0, 1]. Prompts and budgets are the training
    rollouts' (`params`, default `training.policy.rollout_params(cfg)`): the task's context
    (`task_context`, added/hidden tools applied), the grounding examples of other tasks when
    `params.grounding` is set, and the tool's REHEARSE budget (`RolloutParams.rehearse_budget`: the
    per-tool budget, else rollout.max_new_tokens_rehearse); one batched `engine.generate` call, each
    row ending at its own budget."""
    from envace_core.engines.base import SamplingParams, with_prompt_budgets
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.evaluation.fidelity import score_pair
    from envace_core.roles.errors import ParseError
    from envace_core.roles.rehearse import parse_rehearse, rehearse_prompt_ids
    from envace_core.training.rewards import fidelity

    from envace_core.roles.json_prefix import NotJsonStop
    from envace_core.training.policy import rollout_params

    p = params or rollout_params(cfg)
    tok = engine.tokenizer
    prompts = [rehearse_prompt_ids(tok, task_context(t, cfg.data.policy_max_chars), h, c,
                                   p.grounding_examples(t.id, c, tok),
                                   max_observation_tokens=p.max_observation_tokens)
               for t, h, c, _ in trans]
    budgets = [p.rehearse_budget(c.name) for _, _, c, _ in trans]
    texts: dict[int, str] = {}
    if trans:
        # one call, each transition at its tool's budget (`SamplingParams.prompt_max_new_tokens`); decoding
        # stops once the output can no longer parse (same verdict, fewer tokens)
        sp = with_prompt_budgets(SamplingParams(temperature=0.0, role="rehearse", stop_when=NotJsonStop(tok)),
                                 budgets)
        for i, outs in enumerate(engine.generate(prompts, sp)):
            texts[i] = tok.decode(outs[0].token_ids, skip_special_tokens=True)
    rows = []
    for i, (task, _, call, real) in enumerate(trans):
        text = texts[i]
        score = score_pair(real, text, call).to_dict()
        try:
            fid = fidelity(parse_rehearse(text, call.name), real)
        except ParseError:
            fid = 0.0
        rows.append({"id": f"{task.id}#{call.id}", **score, "parse_error": 1.0 - score["json_valid"],
                     "fidelity": fid})
    return rows


def rehearsal_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The validate report of `rehearse_rows`: {"transitions", "json_validity", "parse_error_rate",
    "fidelity", "error_prediction_accuracy", "key_f1", "value_f1", "echo_share", "echo_f1",
    "imagined_f1"} (means; None when nothing was measured), "per_tool" and "per_kind": {name:
    {metric: {"mean", "ci_low", "ci_high", "n"}}} (`evaluation.fidelity.aggregate`, 95 % bootstrap)."""
    from envace_core.evaluation.fidelity import PairScore, aggregate

    agg = aggregate([PairScore(**{f: r[f] for f in PairScore.__dataclass_fields__}) for r in rows])
    mean = {m: v["mean"] for m, v in agg["all"].items()}
    return {"transitions": len(rows), "json_validity": mean["json_valid"],
            "parse_error_rate": mean_or_none([r["parse_error"] for r in rows]),
            "fidelity": mean_or_none([r["fidelity"] for r in rows]),
            "error_prediction_accuracy": mean["error_match"],
            **{m: mean[m] for m in ("key_f1", "value_f1", "echo_share", "echo_f1", "imagined_f1")},
            "per_tool": agg["per_tool"], "per_kind": agg["per_kind"]}


def validation_params(cfg: RunConfig, dataset: dict[str, Any]) -> RolloutParams:
    """The training rollouts' REHEARSE settings (`training.policy.rollout_params`), with, when
    rollout.grounding_k > 0, the grounding index over the real transitions of the dataset's train
    tasks (`loop.real_train_transitions`, `loop.grounded_params`): REHEARSE is validated on the
    prompts it is trained and deployed with. Held-out transitions are test-split ones, so the index
    (train split only) never holds the validated task."""
    from envace_core.training.loop import grounded_params, real_train_transitions
    from envace_core.training.policy import rollout_params

    p = rollout_params(cfg)
    if cfg.rollout.grounding_k <= 0:
        return p
    return grounded_params(cfg, p, real_train_transitions(cfg, load_dataset(dataset, "train")))


def validation_transitions(cfg: RunConfig, dataset: dict[str, Any], tokenizer,
                           params: RolloutParams) -> list[tuple[Task, list, ToolCall, Any]]:
    """The held-out transitions `validate` measures: up to validate.max_transitions
    (`held_out_transitions`, wrong-call errors included) of the dataset's test tasks first, then of
    the rest of the test split (some tasks, e.g. telecom's, have no agent-side gold call; all of the
    test split is held out from training); with validate.fit_budget only those whose real result fits
    REHEARSE's budget (`fits_budget` under `params`, tokens of `tokenizer`).

    Raises EnvaceError when there is none."""
    from envace_core.envs.tau2.tasks import load_tasks

    held_out = load_dataset(dataset, "test")
    seen = {t.id for t in held_out}
    held_out += [t for d in cfg.data.domains for t in load_tasks(d, cfg.data.test_split) if t.id not in seen]
    keep = fits_budget(params, tokenizer) if cfg.validate_.fit_budget else None
    trans = held_out_transitions(held_out, cfg.validate_.max_transitions, errors=True, keep=keep)
    if not trans:
        raise EnvaceError(f"no held-out transitions: the {cfg.data.test_split!r} split of "
                          f"{cfg.data.domains} has no agent-side gold tool call"
                          + (" whose real result fits REHEARSE's budget (validate.fit_budget)" if keep else "")
                          + " to validate REHEARSE on")
    return trans


def validate(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Rehearsal quality on held-out real transitions, then the registration gate.

    For each held-out transition (h, a, o) from the test split's gold actions (with validate.fit_budget,
    only those whose real o fits REHEARSE's budget for its tool: `fits_budget`), REHEARSE predicts ô
    from (h, a); we report JSON validity (ô parses), its complement the parse-error rate (the strict
    REHEARSE parser rejected ô, empty included), mean fidelity F(ô, o) (invalid ô counts 0) and
    error-prediction accuracy (ô is an error iff o is), key-structure and leaf-value F1 and the
    echo / imagined split (`evaluation.fidelity`), overall, per tool and per kind with 95 % bootstrap
    intervals (`rehearsal_metrics`). The per-transition rows then pass the great-expectations
    rehearsal gate (`gates.rehearsal_gate`, thresholds `gates.gate_thresholds`);
    its full results are saved to `validation/<run_id>/gate.json` (also when it fails). A failing gate
    raises `gates.GateFailed` (a GateError) listing the failed expectations, so nothing downstream
    (registration) runs. Returns {"metrics", "gate": {expectation: passed}, "gate_key"}.
    """
    from envace_core.stages.gates import gate_thresholds, rehearsal_gate

    model, tok, _ = load_policy(cfg, trained["adapter_dir"])
    engine = policy_engine(cfg, model, tok)
    params = validation_params(cfg, dataset)
    rows = rehearse_rows(cfg, engine, validation_transitions(cfg, dataset, tok, params), params)
    metrics = rehearsal_metrics(rows)
    gate = rehearsal_gate(pd.DataFrame(rows), cfg.validate_)
    gate_key = f"validation/{trained.get('run_id') or 'dataset-' + dataset['version']}/gate.json"
    open_store(cfg.store.root).write_json(gate_key, {**gate.to_dict(), "metrics": metrics})
    verdict = "PASS" if gate.success else "FAIL " + str(gate.failed)
    if not gate_thresholds(cfg.validate_)["active"]:
        verdict += " (all thresholds are permissive in this profile: the gate only checks the data)"
    overall = {k: v for k, v in metrics.items() if k not in ("per_tool", "per_kind")}
    print(f"[validate] {json.dumps(overall)}; gate: {verdict} ({gate.seconds:.2f}s)")
    for tool, m in metrics["per_tool"].items():
        print(f"[validate]   {tool}: n={m['json_valid']['n']} " + " ".join(
            f"{k}={m[k]['mean']:.3f}" for k in ("json_valid", "error_match", "key_f1", "value_f1")))
    gate.raise_if_failed(artifact=gate_key)
    return {"metrics": metrics, "gate": gate.checks, "gate_key": gate_key}
