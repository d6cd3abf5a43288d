"""Real transitions for the REHEARSE warm start (envace_core/training/transitions.py): gold calls and wrong
calls replayed for real, the real prefix as history, deterministic, and never a test-split task."""

from __future__ import annotations

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.envs.tau2.tasks import load_tasks
from envace_core.training.transitions import TestSplitError, real_transitions, wrong_calls
from envace_core.types import ToolCall


@pytest.fixture(scope="module")
def train_tasks():
    return [t for t in load_tasks("airline", "train") if t.gold_actions][:2]


@pytest.fixture(scope="module")
def transitions(train_tasks):
    return real_transitions(train_tasks, seed=0)


def test_gold_and_error_transitions_with_real_prefixes(train_tasks, transitions):
    gold = [t for t in transitions if not t.probe]
    assert [(t.task_id, t.call.name) for t in gold] == [(task.id, g.name) for task in train_tasks
                                                        for g in task.gold_actions]
    errors = [t for t in transitions if t.probe]
    assert errors and all(t.kind == "error" and t.observation.error for t in errors)
    assert all(t.observation.content.startswith('{"error":') for t in errors)
    for task in train_tasks:
        mine = [t for t in gold if t.task_id == task.id]
        for k, t in enumerate(mine):  # history = user message + the real (call, result) pairs before it
            assert len(t.history) == 1 + 2 * k and t.history[0].content == task.first_user_message
            if k:
                assert t.history[-2].tool_call == mine[k - 1].call
                assert t.history[-1].content == mine[k - 1].observation.content
        for e in (t for t in errors if t.task_id == task.id):  # a wrong call sits at its gold call's history
            nxt = next(g for g in mine if len(g.history) == len(e.history))
            assert e.history == nxt.history and e.call != nxt.call and e.tool == nxt.tool


def test_deterministic_and_seeded(train_tasks, transitions):
    again = real_transitions(train_tasks[:1], seed=0)
    assert [(t.call, t.observation) for t in again] == \
        [(t.call, t.observation) for t in transitions if t.task_id == train_tasks[0].id]
    assert real_transitions(train_tasks[:1], errors=False, seed=0) == [t for t in again if not t.probe]


def test_wrong_calls_cover_ids_missing_and_invalid_values():
    import random

    schema = {"properties": {"reservation_id": {"type": "string"}, "cabin": {"enum": ["economy", "business"]}},
              "required": ["reservation_id", "cabin"]}
    kinds = dict(wrong_calls(ToolCall(name="x", arguments={"reservation_id": "ABC123", "cabin": "economy"}),
                             schema, random.Random(0)))
    assert set(kinds) == {"wrong_id", "missing_argument", "invalid_value"}
    assert kinds["wrong_id"].arguments["reservation_id"] != "ABC123"
    assert kinds["wrong_id"].arguments["reservation_id"][:3] == "ABC"
    assert len(kinds["missing_argument"].arguments) == 1
    assert kinds["invalid_value"].arguments["cabin"] not in ("economy", "business")


def test_test_split_tasks_are_refused():
    test_task = load_tasks("airline", "test", limit=1)[0]
    with pytest.raises(TestSplitError, match="test"):
        real_transitions([test_task])
    assert real_transitions([test_task], forbid_splits=(), errors=False, max_turns=1)  # held-out measurement
