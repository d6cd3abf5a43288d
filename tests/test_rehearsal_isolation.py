"""Private Rehearsal never touches the real environment (METHOD.md §4), and commits exactly once."""

import json

import pytest

from envace_core.engines.hf import HFEngine
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.models import load_model, load_tokenizer
from envace_core.rehearsal.agent import RehearsalAgent
from envace_core.training.rollout import RolloutParams
from tests.scripted import ScriptedEngine

P = RolloutParams(max_turns=2, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0)


class CountingEnv(Tau2Environment):
    """The real tau2 environment with every entry point counted."""

    def __init__(self, domain):
        super().__init__(domain)
        self.entries = 0

    def step(self, call):
        self.entries += 1
        return super().step(call)


def _write_task():
    """An airline test task whose gold actions contain a write, and that write as ACT text."""
    for task in load_tasks("airline", "test"):
        writes = [a for a in task.gold_actions if not a.name.startswith(("get_", "search_", "list_"))]
        if writes:
            call = writes[0]
            return task, '<tool_call>' + json.dumps({"name": call.name, "arguments": call.arguments}) + '</tool_call>'
    raise AssertionError("no airline test task with a write")


def test_rehearsing_a_write_makes_no_real_call_and_keeps_the_db_hash(tiny_model_dir):
    task, write_text = _write_task()
    engine = ScriptedEngine(load_tokenizer(tiny_model_dir), [write_text, "Done, anything else?"])
    env = CountingEnv("airline")
    env.reset(task)
    before = env.snapshot()
    agent = RehearsalAgent(engine, "parallel", 3, 64, act=P, rehearse=P, seed=0)
    rehearsals, memory = agent.rehearse(task_context(task, 300))
    assert len(rehearsals) == 3 and all(t.tool_calls() for t in rehearsals)  # the write was rehearsed
    assert "rehearse" in engine.calls and "Rehearsal" in memory
    assert env.entries == 0 and env.calls_made == 0
    assert env.snapshot() == before
    res = agent.run(task_context(task, 300), env)
    assert res.isolation == {"real_calls_during_rehearsal": 0, "db_hash_unchanged": True}
    assert env.entries == 1 and env.snapshot() != before  # the committed execution wrote, once


def test_rehearsal_with_a_real_model_touches_nothing(tiny_model_dir):
    engine = HFEngine(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), compute_dtype="float32")
    task = load_tasks("airline", "test", limit=1)[0]
    env = CountingEnv("airline")
    env.reset(task)
    before = env.snapshot()
    res = RehearsalAgent(engine, "parallel", 2, 64, act=P, rehearse=P, seed=0).run(task_context(task, 300), env)
    assert res.isolation["real_calls_during_rehearsal"] == 0 and res.isolation["db_hash_unchanged"]
    assert env.entries == len(res.committed.tool_calls())
    assert len(res.rehearsals) == 2 and before


def test_unknown_mode_is_rejected(tiny_model_dir):
    with pytest.raises(Exception, match="unknown rehearsal mode"):
        RehearsalAgent(ScriptedEngine(load_tokenizer(tiny_model_dir), ["hi"]), "telepathy", 2, 64, act=P, rehearse=P)
