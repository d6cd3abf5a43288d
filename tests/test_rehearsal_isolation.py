"""Private Rehearsal never touches the real environment (METHOD.md §4), and commits exactly once."""

import pytest

from envace_core.engines.hf import HFEngine
from envace_core.envs.tau2 import Tau2Environment, load_tasks, task_context
from envace_core.models import load_model, load_tokenizer
from envace_core.rehearsal import RehearsalAgent
from envace_core.rollout import RolloutParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), compute_dtype="float32")


class CountingEnv(Tau2Environment):
    """The real tau2 environment with every entry point counted."""

    def __init__(self, domain):
        super().__init__(domain)
        self.entries = 0

    def step(self, call):
        self.entries += 1
        return super().step(call)


def test_rehearsal_makes_no_real_call_and_keeps_the_db_hash(engine):
    task = load_tasks("airline", "test", limit=1)[0]
    env = CountingEnv("airline")
    env.reset(task)
    before = env.snapshot()
    p = RolloutParams(max_turns=2, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0)
    agent = RehearsalAgent(engine, "parallel", 3, 64, act=p, rehearse=p, seed=0)
    rehearsals, memory = agent.rehearse(task_context(task, 300))
    assert len(rehearsals) == 3
    assert env.entries == 0 and env.calls_made == 0
    assert env.snapshot() == before
    res = agent.run(task_context(task, 300), env)
    assert res.isolation == {"real_calls_during_rehearsal": 0, "db_hash_unchanged": True}
    assert env.entries == len(res.committed.tool_calls())


def test_unknown_mode_is_rejected(engine):
    p = RolloutParams(max_turns=1, max_new_tokens_act=4, max_new_tokens_rehearse=4, temperature=1.0)
    with pytest.raises(Exception, match="unknown rehearsal mode"):
        RehearsalAgent(engine, "telepathy", 2, 64, act=p, rehearse=p)
