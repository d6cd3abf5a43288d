"""Self-unfolded rollouts: structure, replay scoring, and token-in/token-out training rows."""

import json

import pytest

from envace_core.config import load_config
from envace_core.engines.hf import HFEngine
from envace_core.envs.tau2 import load_tasks, task_context
from envace_core.models import load_model, load_tokenizer
from envace_core.rollout import RolloutParams, rehearsal_rollouts
from envace_core.stages import score
from envace_core.trainer import PolicyTrainer, TrainingRow
from envace_core.types import Role
from tests.scripted import ScriptedEngine


def _gold_text(call):
    return "<tool_call>" + json.dumps({"name": call.name, "arguments": call.arguments}) + "</tool_call>"


def test_self_unfolded_rollout_alternates_roles_and_is_replay_scored(tiny_model_dir):
    task = next(t for t in load_tasks("airline", "test") if len(t.gold_actions) == 1)
    gold = task.gold_actions[0]
    engine = ScriptedEngine(load_tokenizer(tiny_model_dir), [_gold_text(gold), "All done."],
                            rehearse_text='{"status": "ok"}')
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    trajs = rehearsal_rollouts(engine, task_context(task, 300), 2, p, seed=0)
    t = trajs[0]
    assert [g.role for g in t.generations] == [Role.ACT, Role.REHEARSE, Role.ACT]
    assert t.termination == "agent_message" and t.steps[0].action.name == gold.name
    assert t.steps[0].observation.content == '{"status": "ok"}'
    score(task, t)
    assert t.steps[0].real_observation is not None  # replayed for real, privately
    assert t.steps[0].fidelity is not None and 0.0 <= t.steps[0].fidelity <= 1.0
    assert t.sub_rewards.get("DB") == 1.0  # the gold write, replayed, reproduces the gold DB


def test_turn_limit_and_parse_error_end_with_the_tau2_rule(tiny_model_dir):
    task = load_tasks("airline", "test", limit=1)[0]
    tok = load_tokenizer(tiny_model_dir)
    p = RolloutParams(max_turns=1, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    call = _gold_text(task.gold_actions[0]) if task.gold_actions else '<tool_call>{"name": "get_user_details", "arguments": {"user_id": "x"}}</tool_call>'
    t = rehearsal_rollouts(ScriptedEngine(tok, [call]), task_context(task, 300), 1, p)[0]
    assert t.termination == "max_turns"
    assert score(task, t).reward == 0.0  # cut off by the turn limit: not a clean stop
    bad = rehearsal_rollouts(ScriptedEngine(tok, ['<tool_call>{"name": </tool_call>']),
                             task_context(task, 300), 1, p)[0]
    assert bad.termination == "parse_error" and bad.generations[0].parse_error.startswith("MalformedToolCall")
    assert score(task, bad, format_penalty=-0.5).reward == -0.5


def test_trained_token_ids_are_exactly_the_generated_ones(tiny_model_dir):
    """Rows carry the engine's ids unchanged, and the trainer's log-probs of them match rollout's."""
    tok = load_tokenizer(tiny_model_dir)
    cfg = load_config("test", {"train": {"micro_batch_rows": 3}})
    trainer = PolicyTrainer(load_model(tiny_model_dir), tok, cfg.train, compute_dtype="float32")
    engine = HFEngine(trainer.model, tok, compute_dtype="float32")
    task = load_tasks("airline", "train", limit=1)[0]
    p = RolloutParams(max_turns=2, max_new_tokens_act=6, max_new_tokens_rehearse=6, temperature=1.0)
    trajs = rehearsal_rollouts(engine, task_context(task, 300), 3, p, seed=1)
    gens = [g for t in trajs for g in t.generations]
    rows = [TrainingRow.from_generation(g, 1.0) for g in gens]
    for g, r in zip(gens, rows):
        assert r.prompt_ids == g.prompt_ids and r.completion_ids == g.completion_ids
        assert r.old_logprobs == g.logprobs
    for g, lp in zip(gens, trainer.completion_logprobs(rows)):
        assert lp == pytest.approx(g.logprobs, abs=1e-4)
