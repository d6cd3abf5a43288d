"""A training iteration (`training.loop.train_iteration`, the tiny model's trainer) that meets what real models
and tools produce: a tool call in another family's format, an empty output, endless JSON cut by the token
budget, and a tool whose results are far too long. The iteration completes; the bad outputs are penalised
(train.format_penalty), the trajectory whose prompt no longer fits is masked; all are counted in the
iteration's metrics; the loss is finite."""

from __future__ import annotations

import json
import math

from envace_core.config import load_config
from envace_core.engines.base import Completion
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.models import load_model, load_tokenizer
from envace_core.roles.act import act_prompt_ids
from envace_core.training import loop
from envace_core.training.checkpoint import RunState
from envace_core.training.distributed import World
from envace_core.training.policy import rollout_params
from envace_core.training.trainer import PolicyTrainer
from envace_core.types import Observation


def _call(user_id: str) -> str:
    return "<tool_call>" + json.dumps({"name": "get_user_details", "arguments": {"user_id": user_id}}) + "</tool_call>"


HUGE = json.dumps({"reservations": [{"id": f"R{i:05d}", "flights": ["HAT001", "HAT002"], "paid": 100 + i}
                                    for i in range(3000)]})  # ~200 KB
# per trajectory g of the group: its ACT replies, turn by turn (the last one repeats)
SCRIPT = [
    ['<|python_tag|>{"name": "get_user_details", "parameters": {"user_id": "mia_li_3668"}}'],  # foreign format
    [""],  # empty output
    ['<tool_call>{"name": "get_user_details", "arguments": {"user_id": ' + "[" * 5000],  # endless JSON
    [_call("huge_once"), "All done."],  # one over-long result: cut, the trajectory goes on
    [_call("huge_again")],  # over-long results until the prompt no longer fits: prompt_too_long
]
CALLERS = {"huge_once": 3, "huge_again": 4}  # the trajectories that get past their first turn


class BadOutputsEngine:
    """Scripted outputs with an engine's limits: completions cut at max_new_tokens ("length"), and a
    context window whose overflow raises ValueError as `HFEngine` does. Trajectory g is recognised by
    its first call's user id in the prompt (the first turn samples the group from one prompt)."""

    context_tokens = 8192

    def __init__(self, tokenizer):
        self.tokenizer, self.stats = tokenizer, {"generated_tokens": 0}

    def _completion(self, text, max_new):
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids, reason = (ids, "stop") if len(ids) <= max_new else (ids[:max_new], "length")
        self.stats["generated_tokens"] += len(ids)
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason=reason)

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            if len(p) > self.context_tokens - params.max_new_tokens:
                raise ValueError(f"prompt has {len(p)} tokens")
            text = self.tokenizer.decode(p)
            turn = text.count("<|im_start|>assistant") - 1
            if turn == 0:
                out.append([self._completion(SCRIPT[j % len(SCRIPT)][0], params.max_new_tokens)
                            for j in range(params.n)])
                continue
            g = next(g for user_id, g in CALLERS.items() if user_id in text)
            out.append([self._completion(SCRIPT[g][min(turn, len(SCRIPT[g]) - 1)], params.max_new_tokens)])
        return out


class _Store:
    def __init__(self):
        self.written = {}

    def write_bytes(self, key, data):
        self.written[key] = data


def test_an_iteration_with_bad_outputs_completes_penalises_masks_and_counts_them(tiny_model_dir, monkeypatch):
    def step(self, call):  # the tool: an over-long result for the "huge" users
        return Observation(content=HUGE if call.arguments.get("user_id", "").startswith("huge") else '{"ok": true}')

    monkeypatch.setattr(Tau2Environment, "step", step)
    tok = load_tokenizer(tiny_model_dir)
    task = next(t for t in load_tasks("airline", "train") if t.gold_actions)
    base = {"rollout": {"source": "real", "group_size": len(SCRIPT), "tasks_per_iteration": 1, "max_turns": 4,
                        "max_new_tokens_act": 48, "max_observation_tokens": 128},
            "train": {"iterations": 2, "checkpoint_every": 2, "format_penalty": -0.5, "trained_roles": ["act"]},
            # gold-action match, no replay: tau2's evaluator would (rightly) reject the fake tool's results
            "reward": {"name": "actions", "replay_fidelity": False}}
    cfg0 = load_config("test", base)
    first = len(act_prompt_ids(tok, task_context(task, cfg0.data.policy_max_chars), [], max_observation_tokens=128))
    # room for two cut results, not three: the "huge_again" trajectory runs out of prompt on its 4th turn
    base["rollout"]["max_prompt_tokens"] = first + 400
    cfg = load_config("test", base)
    trainer = PolicyTrainer(load_model(tiny_model_dir), tok, cfg.train, compute_dtype="float32")
    seen = []
    update = trainer.update
    monkeypatch.setattr(trainer, "update", lambda rows: seen.append(rows) or update(rows))
    run = loop.TrainingRun(cfg, [task], trainer, BadOutputsEngine(tok), rollout_params(cfg), World(), _Store(), "bad")

    rec = loop.train_iteration(run, RunState())  # no exception out of the rollout

    trajs = [json.loads(line) for line in run.store.written["runs/bad/rollouts/iteration-0001.jsonl"].splitlines()]
    assert [t["termination"] for t in trajs] == ["parse_error"] * 3 + ["agent_message", "prompt_too_long"]
    errors = [t["generations"][0]["parse_error"].split(":")[0] for t in trajs[:3]]
    assert errors == ["ForeignToolCallFormat", "EmptyOutput", "MalformedToolCall"]
    assert trajs[2]["generations"][0]["finish_reason"] == "length"  # the endless JSON was cut by the budget
    assert [t["reward"] for t in trajs[:3]] == [-0.5] * 3  # penalised as configured
    assert trajs[3]["reward"] is not None and trajs[4]["reward"] is None  # scored; masked
    assert "…[tool result truncated: " in tok.decode(trajs[3]["generations"][1]["prompt_ids"])
    assert trajs[4]["reward_info"]["prompt_too_long"]["limit"] == first + 400
    # counted in the iteration's metrics
    assert rec["termination/parse_error"] == 3 and rec["termination/prompt_too_long"] == 1
    assert rec["termination/agent_message"] == 1 and rec["masked_trajectories"] == 1
    assert rec["rows/masked"] == len(trajs[4]["generations"]) == 3
    assert rec["parse_error_rate/act"] == 3 / sum(len(t["generations"]) for t in trajs)
    # the update saw the penalised rows, not the masked ones, and its loss is finite
    (rows,) = seen
    assert sorted(r.reward for r in rows if r.reward < 0) == [-0.5] * 3
    assert len(rows) == sum(len(t["generations"]) for t in trajs[:4]) and all(r.valid for r in rows)
    assert math.isfinite(rec["train/loss"])
