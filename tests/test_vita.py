"""VitaBench adapter: loading the shared task files, gold hygiene, the generated read-only environment,
the judge's window / reward arithmetic and the avg@k / pass@k / pass^k metrics."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from envace_core import EnvaceError
from envace_core.envs.vita import (
    VitaEnvironment,
    load_vitabench,
    vita_context,
    vita_tools,
)
from envace_core.evaluation.vita import (
    aggregate_rubric_verdicts,
    avg_at_k,
    judge_reward,
    pass_at_k,
    pass_hat_k,
    rubric_states,
    rubric_windows,
    vita_metrics,
    vita_rubrics,
)
from envace_core.types import ToolCall

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "vitabench"
if not DATA.exists():  # the checkout may sit elsewhere; the README names ../shared
    DATA = Path("/work/shared/data/vitabench")


@pytest.fixture(scope="module")
def tasks():
    if not DATA.exists():
        pytest.skip("shared VitaBench data not present")
    return load_vitabench(DATA)


def test_loads_both_shared_files(tasks):
    assert len(tasks) == 200 and len({t.id for t in tasks}) == 200
    assert {t.domain for t in tasks} == {"delivery", "instore"}  # 3 spellings in instore/tasks_en.json
    assert tasks[0].id == "vitabench/delivery/10711001" and tasks[0].split == "test"
    assert len(load_vitabench(DATA / "delivery" / "tasks_en.json")) == 100
    assert all(t.source["evaluation_criteria"] for t in tasks)  # kept for scoring only


def _gold_strings(task):
    ec = task.source["evaluation_criteria"]
    out = list(vita_rubrics(task))
    for st in ec["expected_states"]:
        for o in (st.get("required_orders") or []) + (st.get("optional_orders") or []):
            out += [str(o[k]) for k in ("order_id", "reservation_id") if o.get(k)]
    return out


def test_no_evaluation_criteria_reaches_what_a_prompt_sees(tasks):
    for t in tasks:
        seen = json.dumps(vita_context(t).model_dump(), ensure_ascii=False) + t.user_scenario
        for word in ("evaluation_criteria", "expected_states", "overall_rubrics", "state_rubrics", "required_orders"):
            assert word not in seen, (t.id, word)
        for g in _gold_strings(t):
            # a rubric may repeat the user's own goal verbatim (instore/10826289: "private room"); only text that
            # is not already in the instructions would be a leak
            if g not in t.source["instructions"]:
                assert g not in seen, (t.id, g)
    # with sentinels planted in the gold, none shows up anywhere a prompt or a tool result can see
    t = tasks[0].model_copy(deep=True)
    t.source["evaluation_criteria"]["overall_rubrics"].append("GOLD_SENTINEL_RUBRIC")
    t.source["evaluation_criteria"]["expected_states"][0]["required_orders"][0]["note"] = "GOLD_SENTINEL_NOTE"
    env = VitaEnvironment()
    env.reset(t)
    outs = [env.step(ToolCall(name=s.name, arguments={"query": ""} if s.name.startswith("search_") else {})).content
            for s in env.tools() if not s.name.startswith("get_") or not s.parameters.get("required")]
    blob = json.dumps(vita_context(t).model_dump()) + t.first_user_message + t.user_scenario + env.policy() + "".join(outs)
    assert "GOLD_SENTINEL" not in blob
    assert "GOLD_SENTINEL_RUBRIC" in vita_rubrics(t)


def test_generated_tools_return_the_task_db_and_instances_are_isolated(tasks):
    t = tasks[0]
    names = [s.name for s in vita_tools(t)]
    assert names == ["get_time", "get_user_id", "get_orders", "search_orders", "get_weather", "get_location",
                     "get_user_historical_behaviors", "get_stores", "search_stores"]
    assert {s.name for s in vita_tools(tasks[150])} >= {"get_shops", "search_shops", "get_reservations", "get_books"}
    sid, store = next(iter(t.source["environment"]["stores"].items()))
    a, b = VitaEnvironment(), VitaEnvironment()
    a.reset(t)
    b.reset(t)
    obs = a.step(ToolCall(name="get_stores", arguments={"id": sid}))
    assert not obs.error and json.loads(obs.content) == store
    word = store["name"].split()[0]
    hits = json.loads(a.step(ToolCall(name="search_stores", arguments={"query": word.upper(), "limit": 1})).content)
    assert len(hits) == 1 and word in hits[0]["name"]
    assert json.loads(a.step(ToolCall(name="get_time", arguments={})).content) == t.source["environment"]["time"]
    # errors are observations, not exceptions
    assert a.step(ToolCall(name="get_stores", arguments={"id": "nope"})).error
    assert a.step(ToolCall(name="get_stores", arguments={})).error
    assert a.step(ToolCall(name="place_order", arguments={})).error
    assert (a.calls_made, b.calls_made) == (6, 0)
    # isolation: a's private copy changes; b, the task and a fresh instance do not
    before = b.snapshot()
    original = copy.deepcopy(t.source["environment"])
    a._db["stores"][sid]["name"] = "CHANGED"
    assert a.snapshot() != before and b.snapshot() == before
    assert json.loads(b.step(ToolCall(name="get_stores", arguments={"id": sid})).content)["name"] == store["name"]
    assert t.source["environment"] == original
    a.reset(t)
    assert a.snapshot() == before
    with pytest.raises(EnvaceError, match="reset"):
        VitaEnvironment().step(ToolCall(name="get_time"))
    with pytest.raises(EnvaceError, match="domain"):
        VitaEnvironment("delivery").reset(tasks[150])


def test_score_explains_the_rubric_judge(tasks):
    env = VitaEnvironment()
    env.reset(tasks[0])
    with pytest.raises(EnvaceError, match=r"LLM rubric judge.*windows of 10.*overlapping by 2.*every rubric"):
        env.score(tasks[0], [], "")


def test_rubric_windows_match_the_official_slicing():
    m = list(range(19))
    assert rubric_windows(m) == [m[0:10], m[8:18], m[16:19]]
    assert rubric_windows(list(range(10))) == [list(range(10))]
    assert rubric_windows(list(range(11))) == [list(range(10)), [8, 9, 10]]
    assert rubric_windows(list(range(18))) == [list(range(10)), list(range(8, 18))]
    assert rubric_windows([]) == [[]]
    assert [len(w) for w in rubric_windows(list(range(26)))] == [10, 10, 10]  # 16 + 10 reaches the end
    assert [len(w) for w in rubric_windows(list(range(27)))] == [10, 10, 10, 3]
    with pytest.raises(EnvaceError):
        rubric_windows(m, size=4, overlap=4)


def test_rubric_verdicts_last_one_stands_and_all_must_hold():
    assert rubric_states([[True, False], {1: True}]) == [True, True]
    assert aggregate_rubric_verdicts([[True, False], {1: True}]) == 1.0
    assert rubric_states([[True, True], {0: False}]) == [False, True]  # a later window can revoke
    assert aggregate_rubric_verdicts([[True, True], {0: False}]) == 0.0
    assert aggregate_rubric_verdicts([{0: True}], n_rubrics=2) == 0.0  # rubric 1 never judged: unmet
    assert aggregate_rubric_verdicts([[True]], terminated_early=True) == 0.0
    assert aggregate_rubric_verdicts([], n_rubrics=0) == 1.0
    for bad in ([[True], [True, False]], [{5: True}], [[1]]):
        with pytest.raises(EnvaceError):
            rubric_states(bad, None if not isinstance(bad[0], dict) else 2)


def test_judge_reward_runs_the_window_loop(tasks):
    t = tasks[0]
    n = len(vita_rubrics(t))
    msgs = [{"role": "user", "content": str(i)} for i in range(19)]
    calls = []

    def judge(window, rubrics, states):
        calls.append((len(window), list(states)))
        return {len(calls) - 1: True} if len(calls) < 3 else [True] * len(rubrics)

    r = judge_reward(t, msgs, judge)
    assert r["num_windows"] == 3 and [c[0] for c in calls] == [10, 10, 3]
    assert calls[1][1][0] is True  # the judge sees the states so far
    assert r["reward"] == 1.0 and r["rubric_score"] == 1.0 and len(r["rubric_states"]) == n
    assert judge_reward(t, msgs, lambda w, rb, s: [False] * len(rb))["reward"] == 0.0
    assert judge_reward(t, msgs, judge, terminated_early=True)["reward"] == 0.0


def test_pass_metrics_on_hand_numbers():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_hat_k(5, 2, 2) == pytest.approx(0.1)  # C(2,2)/C(5,2) = 1/10
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_hat_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(3, 1, 3) == 1.0  # n - c < k
    assert pass_hat_k(4, 3, 4) == 0.0 and pass_hat_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 0, 2) == 0.0
    assert avg_at_k([1.0, 0.0, 0.5], 2) == pytest.approx(0.5)
    for f in (pass_at_k, pass_hat_k):
        for n, c, k in ((2, 1, 3), (2, 3, 1), (2, 1, 0)):
            with pytest.raises(EnvaceError):
                f(n, c, k)
    with pytest.raises(EnvaceError):
        avg_at_k([1.0], 2)
    m = vita_metrics({"a": [1.0, 1.0, 0.0, 0.0], "b": [1.0, 1.0, 1.0, 0.5]})
    assert m["n_tasks"] == 2 and sorted(m["pass^k"]) == [1, 2, 3, 4]
    assert m["pass^k"][1] == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert m["pass^k"][2] == pytest.approx((1 / 6 + 3 / 6) / 2)  # C(2,2)/C(4,2), C(3,2)/C(4,2)
    assert m["pass@k"][2] == pytest.approx(((1 - 1 / 6) + 1.0) / 2)  # a: 1 - C(2,2)/C(4,2); b: n-c=1<2
    assert m["avg@k"][1] == pytest.approx((0.5 + 0.875) / 2) and m["avg_reward"] == pytest.approx(5.5 / 8)


def test_loader_errors_name_file_and_field(tmp_path, tasks):
    rec = copy.deepcopy(tasks[0].source)
    del rec["environment"]
    p = tmp_path / "t.json"
    p.write_text(json.dumps([rec]))
    with pytest.raises(EnvaceError, match=r"t\.json: task 0 \(id '10711001'\): missing field 'environment'"):
        load_vitabench(p)
    p.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(EnvaceError, match="JSON list"):
        load_vitabench(p)
    p.write_text(json.dumps([tasks[0].source, tasks[0].source]))
    with pytest.raises(EnvaceError, match="already loaded"):
        load_vitabench(p)
    with pytest.raises(EnvaceError, match="no VitaBench task files"):
        load_vitabench(tmp_path / ".." / tmp_path.name, pattern="nothing.json")
