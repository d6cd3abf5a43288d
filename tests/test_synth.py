"""Synthesized training tasks (envace_core/envs/tau2/synth.py, synth_candidates.py): verified by gold
replay through the harness, graded, deduplicated, deterministic, gate-clean, and disjoint from the
whole tau2 test split."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

import pandas as pd
import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.rules import policy_rule_checks
from envace_core.envs.tau2 import synth
from envace_core.envs.tau2.synth import (
    LEVELS,
    SYNTH_MARKER,
    SynthesisError,
    candidates,
    gold_answer,
    level_quotas,
    synthesize,
)
from envace_core.envs.tau2.synth_candidates import (
    AIRLINE_NOW,
    airline_cancel_reason,
    flight_status,
    is_unflown,
)
from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.stages.curate import curate
from envace_core.stages.dataset import load_dataset
from envace_core.training.rewards import replay_reward
from envace_core.types import Step, Trajectory

DOMAINS = ("airline", "retail")
N = 3  # per domain: 1 per level (each validation replays in ~3 fresh tau2 environments)


@pytest.fixture(scope="module")
def tests_split():
    return {d: load_tasks(d, "test") for d in DOMAINS}


@pytest.fixture(scope="module")
def dbs():
    from tau2.registry import registry

    return {d: registry.get_env_constructor(d)().tools.db for d in DOMAINS}


@pytest.fixture(scope="module")
def synthesized(tests_split):
    return {d: synthesize(d, N, seed=0, test_tasks=tests_split[d]) for d in DOMAINS}


@functools.cache
def _write_tools(domain: str) -> frozenset[str]:
    from tau2.environment.toolkit import ToolType
    from tau2.registry import registry

    tools = registry.get_env_constructor(domain)().tools
    return frozenset(t for t in tools.get_tools() if tools.tool_type(t) == ToolType.WRITE)


def _is_write(domain: str, name: str) -> bool:
    return name in _write_tools(domain)


def _gold_traj(task, final: str) -> Trajectory:
    return Trajectory(task_id=task.id, imagined=False,
                      steps=[Step(action=a) for a in task.gold_actions] + [Step(message=final)])


# -------------------------------------------------------------------- overlap with the test split
def _owners(domain: str, db, args: dict) -> set[str]:
    """Users an action's arguments point at (written independently of synth.test_users)."""
    owned = db.reservations if domain == "airline" else db.orders
    out = set()
    for k, v in args.items():
        if k == "user_id":
            out.add(v)
        elif k in ("reservation_id", "order_id") and v in owned:
            out.add(owned[v].user_id)
        elif k == "email":
            out |= {uid for uid, u in db.users.items() if u.email == v}
    if {"first_name", "last_name", "zip"} <= set(args) and "passengers" not in args:
        out |= {uid for uid, u in db.users.items() if (u.name.first_name, u.name.last_name, u.address.zip)
                == (args["first_name"], args["last_name"], args["zip"])}
    return out


def _test_footprint(domain, db, test):
    """(users, their reservation/order ids, gold writes) of the whole test split."""
    users = set()
    for t in test:
        found = set().union(*(_owners(domain, db, a.arguments) for a in t.gold_actions)) if t.gold_actions else set()
        found |= {uid for uid in db.users if uid in t.user_scenario}
        assert found, f"no user resolved for test task {t.id}: the overlap check would be vacuous"
        users |= found
    owned = db.reservations if domain == "airline" else db.orders
    entities = {k for k, v in owned.items() if v.user_id in users}
    writes = {(a.name, json.dumps(a.arguments, sort_keys=True)) for t in test for a in t.gold_actions
              if _is_write(domain, a.name)}
    return users, entities, writes


@pytest.mark.parametrize("domain", DOMAINS)
def test_no_candidate_overlaps_the_whole_test_split(domain, tests_split, dbs):
    """Every candidate of every level (a superset of what synthesize can emit) avoids the test users,
    their reservations/orders and every test gold write."""
    db, test = dbs[domain], tests_split[domain]
    users, entities, writes = _test_footprint(domain, db, test)
    assert synth.test_users(domain, test, db) == users
    unfiltered = candidates(domain, 1, (), db)  # the exclusion is what keeps test users out
    assert any(set().union(*(_owners(domain, db, a) for _, a in c.actions)) & users for c in unfiltered)
    for level in LEVELS:
        pool = candidates(domain, level, synth.test_users(domain, test, db), db)
        assert len(pool) > 50, (domain, level, len(pool))
        for c in pool:
            touched = set().union(*(_owners(domain, db, a) for _, a in c.actions))
            assert touched and not touched & users, (c.template, touched & users)
            text = c.reason_for_call + " " + c.known_info
            assert not any(e in text for e in entities | users), c.reason_for_call
            assert not {(n, json.dumps(a, sort_keys=True)) for n, a in c.actions} & writes


def test_synthesized_ids_are_fresh_unique_and_marked(synthesized, tests_split):
    test_ids = {t.id for ts in tests_split.values() for t in ts}
    for d, tasks in synthesized.items():
        assert len(tasks) == N
        assert [int(t.id.split("-")[1][1:]) for t in tasks] == [1, 2, 3]
        for t in tasks:
            assert re.fullmatch(rf"{d}/synth-L[123]-[0-9a-f]{{12}}", t.id), t.id
            assert t.id not in test_ids and t.split == "train" and t.domain == d
            assert t.source["description"]["notes"].startswith(f"{SYNTH_MARKER} level=")
            assert t.source["evaluation_criteria"]["reward_basis"] == ["DB", "COMMUNICATE"]
        assert len({t.id for t in tasks}) == N


@pytest.mark.parametrize("domain", DOMAINS)
def test_candidates_are_deduplicated(domain, dbs):
    for level in LEVELS:
        keys = [c.key() for c in candidates(domain, level, (), dbs[domain])]
        assert len(keys) == len(set(keys))


def test_deterministic_given_seed(synthesized, tests_split):
    again = synthesize("retail", N, seed=0, test_tasks=tests_split["retail"])
    assert [t.model_dump() for t in again] == [t.model_dump() for t in synthesized["retail"]]
    other = synthesize("retail", 1, levels=[1], seed=1, test_tasks=tests_split["retail"])
    assert other[0].id != synthesized["retail"][0].id


# ------------------------------------------------------------------------ verified by gold replay
def test_gold_replay_scores_1_and_writes_are_needed(synthesized):
    for d, tasks in synthesized.items():
        base = Tau2Environment(d).snapshot()
        for t in tasks:
            res = replay_reward(t, _gold_traj(t, gold_answer(t)))
            assert res is not None and res.reward == 1.0 and res.sub_rewards["DB"] == 1.0, (t.id, res)
            writes = [i for i, a in enumerate(t.gold_actions) if _is_write(d, a.name)]
            assert bool(writes) == ("-L1-" not in t.id)
            env = Tau2Environment(d)
            env.reset(t)
            for a in t.gold_actions:
                assert not env.step(a).error
            assert (env.snapshot() != base) == bool(writes)
            if writes:  # the write is what earns the reward
                without = Trajectory(task_id=t.id, imagined=False,
                                     steps=[Step(action=a) for a in t.gold_actions[:writes[-1]]])
                assert replay_reward(t, without).sub_rewards["DB"] == 0.0


def test_plain_text_answer_scores_0_on_level_1(synthesized):
    for tasks in synthesized.values():
        for t in (t for t in tasks if "-L1-" in t.id):
            info = t.source["evaluation_criteria"]["communicate_info"]
            assert info and not any(i.lower() in t.first_user_message.lower() for i in info)
            for text in (t.first_user_message, "I have looked it up for you; is there anything else?"):
                res = replay_reward(t, Trajectory(task_id=t.id, imagined=False, steps=[Step(message=text)]))
                assert res.reward == 0.0 and res.sub_rewards == {"DB": 1.0, "COMMUNICATE": 0.0}


def test_gold_trajectories_follow_the_code_checkable_policy(synthesized):
    for d, tasks in synthesized.items():
        for t in tasks:
            traj = _gold_traj(t, gold_answer(t))
            replay_reward(t, traj)
            for s in traj.steps:
                s.observation = s.real_observation
            assert not [r for c in policy_rule_checks(d) for r in c(traj, task_context(t))], t.id
        write_task = next(t for t in tasks if "-L2-" in t.id)
        skipped_reads = Trajectory(task_id=write_task.id, imagined=False, steps=[
            Step(action=write_task.gold_actions[-1], observation=Tau2Environment(d).step(write_task.gold_actions[-1]))])
        assert [r for c in policy_rule_checks(d) for r in c(skipped_reads, task_context(write_task))]


def test_airline_cancel_policy(dbs):
    db = dbs["airline"]
    res = db.reservations
    flown = next(r for r in res.values() if r.status != "cancelled" and any(
        flight_status(db, f.flight_number, f.date) == "landed" for f in r.flights))
    assert airline_cancel_reason(db, flown) is None
    plain = next(r for r in res.values() if r.cabin != "business" and r.insurance == "no" and r.status is None
                 and datetime.fromisoformat(str(r.created_at)) < AIRLINE_NOW.replace(day=13) and is_unflown(db, r)
                 and all(flight_status(db, f.flight_number, f.date) == "available" for f in r.flights))
    assert airline_cancel_reason(db, plain) is None
    assert airline_cancel_reason(db, plain.model_copy(update={"cabin": "business"})) == "a change of plans"
    assert "health" in airline_cancel_reason(db, plain.model_copy(update={"insurance": "yes"}))
    for c in candidates("airline", 2, (), db) + candidates("airline", 3, (), db):
        if c.template.startswith("cancel"):
            assert airline_cancel_reason(db, res[c.actions[-1][1]["reservation_id"]])


# ------------------------------------------------------------------------------- gate and curate
def test_dataset_gate_accepts_synthesized_tasks_and_still_catches_leaks(synthesized, tests_split):
    from envace_core.stages.dataset import task_record
    from envace_core.stages.gates import dataset_gate

    test = [t for ts in tests_split.values() for t in ts]
    train = [t for ts in synthesized.values() for t in ts] + load_tasks("airline", "train", limit=2)
    df = pd.DataFrame([task_record(t) for t in train + test])
    gate = dataset_gate(df, {t.id for t in test}, domains=list(DOMAINS))
    assert gate.success, gate.failed
    leaked = train[0].model_copy(update={"id": test[0].id})
    df2 = pd.DataFrame([task_record(t) for t in [leaked] + train[1:] + test[1:]])
    assert not dataset_gate(df2, {t.id for t in test}, domains=list(DOMAINS)).success


def test_curate_appends_synthesized_train_tasks(tmp_path, monkeypatch):
    from envace_core.config import load_config

    monkeypatch.chdir(tmp_path)  # no DVC repo here: curate skips DVC tracking
    store = {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}
    ds = curate(load_config("test", {"store": store, "data": {
        "synthetic_tasks_per_domain": 2, "synthetic_levels": [1, 3], "synthetic_seed": 7}}))
    train = load_dataset(ds, "train")
    assert ds["n_train"] == 3 and len(train) == 3
    assert [t.id.split("-")[1] for t in train if "/synth-" in t.id] == ["L1", "L3"]
    assert all(t.id not in {x.id for x in load_dataset(ds, "test")} for t in train)


def test_bad_requests_raise_clear_errors(tests_split):
    from envace_core.config import ConfigError, load_config

    with pytest.raises(SynthesisError, match="retail"):
        synthesize("telecom", 1)
    with pytest.raises(SynthesisError, match="level"):
        candidates("airline", 4)
    with pytest.raises(SynthesisError, match=">= 0"):
        synthesize("airline", -1, test_tasks=tests_split["airline"])
    assert level_quotas(7, [3, 1, 2]) == {1: 3, 2: 2, 3: 2}
    with pytest.raises(ConfigError, match="synthetic_levels"):
        load_config("test", {"data": {"synthetic_levels": [4]}})
    with pytest.raises(ConfigError, match="synthetic_tasks_per_domain"):
        load_config("test", {"data": {"synthetic_tasks_per_domain": -1}})
