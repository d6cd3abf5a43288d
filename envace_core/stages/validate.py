"""The `validate` stage: rehearsal quality on held-out real transitions, per tool, with a gate."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    pass
from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.evaluation.stats import mean_or_none
from envace_core.stages.dataset import load_dataset
from envace_core.store.uri import open_store
from envace_core.training.policy import load_policy, policy_engine
from envace_core.types import Task, ToolCall


# -------------------------------------------------------------------------------------- validate
def held_out_transitions(tasks: list[Task], limit: int) -> list[tuple[Task, list, ToolCall, Any]]:
    """Real (history, call, observation) transitions from replaying held-out tasks' gold actions."""
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.types import Message

    out = []
    for task in tasks:
        env = Tau2Environment(task.domain)
        env.reset(task)
        history = [Message(role="user", content=task.first_user_message)]
        for call in task.gold_actions:
            call = call.model_copy(update={"id": f"call_{len(history)}"})
            obs = env.step(call)
            out.append((task, list(history), call, obs))
            history += [Message(role="assistant", tool_call=call),
                        Message(role="tool", content=obs.content, error=obs.error)]
            if len(out) >= limit:
                return out
    return out


def rehearse_rows(cfg: RunConfig, engine: Any, trans: list[tuple[Task, list, ToolCall, Any]]) -> list[dict[str, Any]]:
    """REHEARSE's greedy prediction ô of each real transition (h, a, o) (`held_out_transitions`),
    one row per transition: {"id": "<task id>#<call id>", "json_valid", "parse_error", "fidelity"
    (F(ô, o), `rewards.fidelity`; 0 when ô does not parse), "error_match" (ô is an error iff o is)},
    all in {0, 1} except fidelity in [0, 1]. One batched `engine.generate` call; prompts see the
    task's context (`task_context`, added/hidden tools applied)."""
    from envace_core.engines.base import SamplingParams
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.roles.errors import ParseError
    from envace_core.roles.rehearse import parse_rehearse, rehearse_prompt_ids
    from envace_core.training.rewards import fidelity

    tok = engine.tokenizer
    prompts = [rehearse_prompt_ids(tok, task_context(t, cfg.data.policy_max_chars), h, c,
                                   max_observation_tokens=cfg.rollout.max_observation_tokens)
               for t, h, c, _ in trans]
    sp = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens_rehearse, temperature=0.0, role="rehearse")
    rows = []
    for (task, _, call, real), outs in zip(trans, engine.generate(prompts, sp) if prompts else []):
        row = {"id": f"{task.id}#{call.id}", "json_valid": 0.0, "parse_error": 1.0, "fidelity": 0.0,
               "error_match": 0.0}
        try:
            pred = parse_rehearse(tok.decode(outs[0].token_ids, skip_special_tokens=True))
        except ParseError:
            rows.append(row)
            continue
        rows.append({**row, "json_valid": 1.0, "parse_error": 0.0, "fidelity": fidelity(pred, real),
                     "error_match": float(pred.error == real.error)})
    return rows


def validate(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Rehearsal quality on held-out real transitions, then the registration gate.

    For each held-out transition (h, a, o) from the test split's gold actions, REHEARSE predicts ô
    from (h, a); we report JSON validity (ô parses), its complement the parse-error rate (the strict
    REHEARSE parser rejected ô, empty included), mean fidelity F(ô, o) (invalid ô counts 0) and
    error-prediction accuracy (ô is an error iff o is). The per-transition rows then pass the
    great-expectations rehearsal gate (`gates.rehearsal_gate`: fidelity ≥ `validate.min_fidelity`,
    JSON validity ≥ `validate.min_json_validity`, parse-error rate ≤ `validate.max_parse_error_rate`);
    its full results are saved to `validation/<run_id>/gate.json` (also when it fails). A failing gate
    raises `gates.GateFailed` (a GateError) listing the failed expectations, so nothing downstream
    (registration) runs. Returns {"metrics", "gate": {expectation: passed}, "gate_key"}.
    """
    from envace_core.stages.gates import rehearsal_gate

    model, tok, _ = load_policy(cfg, trained["adapter_dir"])
    engine = policy_engine(cfg, model, tok)
    from envace_core.envs.tau2.tasks import load_tasks

    # The evaluation subset first, then the rest of the held-out split: some tasks (e.g. telecom's)
    # have no agent-side gold call, and all of the test split is held out from training.
    held_out = load_dataset(dataset, "test")
    seen = {t.id for t in held_out}
    held_out += [t for d in cfg.data.domains for t in load_tasks(d, cfg.data.test_split) if t.id not in seen]
    trans = held_out_transitions(held_out, cfg.validate_.max_transitions)
    if not trans:
        raise EnvaceError(f"no held-out transitions: the {cfg.data.test_split!r} split of "
                          f"{cfg.data.domains} has no agent-side gold tool call to validate REHEARSE on")
    rows = rehearse_rows(cfg, engine, trans)
    metrics = {"transitions": len(trans), "json_validity": mean_or_none([r["json_valid"] for r in rows]),
               "fidelity": mean_or_none([r["fidelity"] for r in rows]),
               "error_prediction_accuracy": mean_or_none([r["error_match"] for r in rows]),
               "parse_error_rate": mean_or_none([r["parse_error"] for r in rows])}
    gate = rehearsal_gate(pd.DataFrame(rows), cfg.validate_)
    gate_key = f"validation/{trained.get('run_id') or 'dataset-' + dataset['version']}/gate.json"
    open_store(cfg.store.root).write_json(gate_key, {**gate.to_dict(), "metrics": metrics})
    v = cfg.validate_
    disabled = v.min_json_validity == 0 and v.min_fidelity == 0 and v.max_parse_error_rate >= 1
    verdict = "PASS" if gate.success else "FAIL " + str(gate.failed)
    if disabled:
        verdict += " (all thresholds are permissive in this profile: the gate only checks the data)"
    print(f"[validate] {json.dumps(metrics)}; gate: {verdict} ({gate.seconds:.2f}s)")
    gate.raise_if_failed(artifact=gate_key)
    return {"metrics": metrics, "gate": gate.checks, "gate_key": gate_key}
