"""Evaluation episodes run several at a time (`evaluate_policy(concurrency=)`, ``eval.concurrency``):
the records equal those of one episode after another (float32 tiny model), in task order, cached as they
end and skipped on a rerun; an error stays its task's; a user simulator on an engine of its own keeps
episodes one by one."""

from __future__ import annotations

import json

import pytest

from envace_core.config import load_config
from envace_core.engines.merging import MergingEngine
from envace_core.envs.tau2.tasks import load_tasks
from envace_core.evaluation.tau2 import evaluate_policy, run_tau2
from envace_core.evaluation.tau2_agents import SimulatedUser
from envace_core.models import resolve_model_ref
from envace_core.training.policy import load_engine


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                               "eval": {"max_turns": 2}, "rollout": {"max_new_tokens_act": 8}})
    engine, _ = load_engine(cfg, resolve_model_ref(str(tiny_model_dir), cfg.store.registry))
    tasks = load_tasks("airline", "test", 3) + load_tasks("retail", "test", 2)
    return cfg, engine, tasks


def _plain(records):
    return json.loads(json.dumps(records, sort_keys=True, default=str))


@pytest.mark.parametrize("mode,n", [("none", 0), ("parallel", 2)])
def test_concurrent_episodes_give_the_records_of_one_after_another(setup, mode, n):
    cfg, engine, tasks = setup
    one = evaluate_policy(cfg, engine, tasks, "opening_request", mode=mode, n=n, seed=3, concurrency=1)
    calls = []
    real_map = MergingEngine.map

    def spy(self, fn, items, workers=None, on_result=None):
        calls.append((len(items), workers))
        return real_map(self, fn, items, workers=workers, on_result=on_result)

    MergingEngine.map = spy
    try:
        many = evaluate_policy(cfg, engine, tasks, "opening_request", mode=mode, n=n, seed=3, concurrency=3)
    finally:
        MergingEngine.map = real_map
    assert calls == [(5, 3)]  # the merged path ran, 3 episodes at a time
    assert [r["task_id"] for r in many["results"]] == [t.id for t in tasks]
    assert _plain(many["results"]) == _plain(one["results"])


def test_concurrent_episodes_are_cached_as_they_end_and_a_rerun_skips_them(setup, tmp_path):
    cfg, engine, tasks = setup
    cache = tmp_path / "cache.jsonl"
    first = evaluate_policy(cfg, engine, tasks, "opening_request", seed=1, cache_path=cache, concurrency=4)
    lines = [json.loads(x) for x in cache.read_text().splitlines()]
    assert sorted(r["task_id"] for r in lines) == sorted(t.id for t in tasks) and first["skipped"] == 0
    again = evaluate_policy(cfg, engine, tasks, "opening_request", seed=1, cache_path=cache, concurrency=4)
    assert again["skipped"] == len(tasks) and _plain(again["results"]) == _plain(first["results"])


def test_a_failing_episode_is_recorded_alone_or_raised(setup):
    cfg, engine, tasks = setup
    from envace_core.evaluation.tau2 import policy_agent

    merging = MergingEngine(engine)
    bad = tasks[1].domain, tasks[1].id

    def agent_for(domain, seed):
        return policy_agent(cfg, merging, domain=domain, seed=seed)

    def env(task):
        from envace_core.envs.tau2.environment import Tau2Environment

        if (task.domain, task.id) == bad:
            raise RuntimeError("environment down for this task")
        return Tau2Environment(task.domain)

    res = run_tau2(tasks, agent_for, "opening_request", seed=0, environment=env, merging=merging, concurrency=3)
    errors = {r["task_id"]: r["error"] for r in res["results"]}
    assert "environment down" in errors[tasks[1].id]
    assert all(e is None for tid, e in errors.items() if tid != tasks[1].id)
    with pytest.raises(RuntimeError, match="environment down"):
        run_tau2(tasks, agent_for, "opening_request", seed=0, environment=env, merging=merging, concurrency=3,
                 raise_errors=True)


def test_a_user_simulator_on_its_own_engine_keeps_episodes_one_by_one(setup, monkeypatch):
    cfg, engine, tasks = setup
    monkeypatch.setattr(MergingEngine, "map", lambda *a, **k: pytest.fail("episodes were merged"))
    other = SimulatedUser(engine=object())
    res = evaluate_policy(cfg, engine, tasks[:2], "opening_request", seed=0, user=other, concurrency=4)
    assert len(res["results"]) == 2


def test_concurrency_below_one_is_refused(setup):
    cfg, engine, tasks = setup
    from envace_core import EnvaceError

    with pytest.raises(EnvaceError, match="concurrency must be >= 1"):
        run_tau2(tasks, lambda d, s: None, "opening_request", concurrency=0)
    with pytest.raises(Exception, match="concurrency"):
        load_config("test", {"eval": {"concurrency": 0}})
