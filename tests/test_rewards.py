"""Rewards: replay (tau2's own evaluator on a private replay), actions match, fidelity F1."""

from __future__ import annotations

import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core import EnvaceError
from envace_core.config import ConfigError, load_config
from envace_core.envs.base import RewardResult
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.tasks import load_tasks
from envace_core.training.rewards import (
    REWARDS,
    actions_reward,
    fidelity,
    flatten_json,
    get_reward_fn,
    register_reward,
    replay_reward,
    reward_fn_from_config,
    row_rewards,
    score_trajectory,
)
from envace_core.training.rows import rows_from_group
from envace_core.types import Generation, Observation, Role, Step, ToolCall, Trajectory


def O(x, error=False):
    return Observation(content=x if isinstance(x, str) else json.dumps(x), error=error)


# -------------------------------------------------------------------------------------- fidelity


def test_fidelity_identical_disjoint_and_error_class():
    doc = {"user_id": "u1", "orders": ["#W1", "#W2"], "address": {"zip": "10001"}}
    assert fidelity(O(doc), O(doc)) == 1.0
    assert fidelity(O({"a": 1}), O({"b": 2})) == 0.0
    assert fidelity(O("Error: not found", error=True), O(doc)) == 0.0
    assert fidelity(O(doc), O("Error: not found", error=True)) == 0.0
    assert fidelity(O("Error: x", error=True), O("Error: y", error=True)) == 1.0
    assert fidelity(None, O(doc)) == 0.0


def test_fidelity_partial_overlap_is_pair_f1():
    imagined = {"a": 1, "b": 2, "c": 3}
    real = {"a": 1, "b": 5}
    # I = {(/a,1),(/b,2),(/c,3)}, R = {(/a,1),(/b,5)}: |I∩R| = 1 -> 2*1/(3+2)
    assert fidelity(O(imagined), O(real)) == pytest.approx(0.4)
    nested_i = {"user": {"id": "u1", "tags": ["x", "y"]}, "n": 2.0}
    nested_r = {"user": {"id": "u1", "tags": ["x", "z"]}, "n": 2}
    # pairs: /user/id, /user/tags/0, /user/tags/1, /n ; 3 of 4 shared (2.0 == 2)
    assert fidelity(O(nested_i), O(nested_r)) == pytest.approx(2 * 3 / 8)
    assert flatten_json({"a": [], "b": {}}) == {("/a", "[]"), ("/b", "{}")}


def test_fidelity_plain_text_and_empty():
    assert fidelity(O("Transfer successful"), O("Transfer successful")) == 1.0
    assert fidelity(O("Transfer done"), O("Transfer successful")) == 0.0
    assert fidelity(O(""), O("  ")) == 1.0
    assert fidelity(O("not json"), O({"a": 1})) == 0.0
    assert 0.0 <= fidelity(O([1, 2, 3]), O([1, 2])) <= 1.0


# --------------------------------------------------------------------------------- replay reward


@pytest.fixture(scope="module")
def retail5():
    return next(t for t in load_tasks("retail", "test") if t.id == "retail/5")


def test_replay_reward_sets_real_observations_fidelity_and_reward(retail5):
    # Real observations of the gold calls, to build "imagined" ones that are partly right.
    env = Tau2Environment("retail")
    env.reset(retail5)
    real = [env.step(a) for a in retail5.gold_actions]
    steps = []
    for i, (a, r) in enumerate(zip(retail5.gold_actions, real)):
        imagined = r if i == 0 else O("Error: order not found", error=True)
        steps.append(Step(action=a, observation=imagined))
    steps.append(Step(message="I have returned the water bottle for you."))
    traj = Trajectory(task_id=retail5.id, steps=steps, termination="agent_message")
    res = replay_reward(retail5, traj)
    assert res is not None and res.sub_rewards["DB"] == 1.0
    assert traj.reward == res.reward and traj.sub_rewards == res.sub_rewards
    assert traj.reward_info["reward_fn"] == "replay"
    assert [s.real_observation for s in traj.steps[:-1]] == real
    assert traj.steps[0].fidelity == 1.0
    assert all(s.fidelity == 0.0 for s in traj.steps[1:-1])
    assert traj.steps[-1].real_observation is None and traj.steps[-1].fidelity is None


def test_replay_reward_dropped_write_and_parse_error_still_scored(retail5):
    steps = [Step(action=a) for a in retail5.gold_actions[:-1]]
    traj = Trajectory(task_id=retail5.id, steps=steps, termination="parse_error")
    res = replay_reward(retail5, traj)
    assert res is not None and res.sub_rewards["DB"] == 0.0 and traj.reward == 0.0
    assert traj.reward_info["termination"] == "parse_error"


def test_replay_reward_masks_on_scoring_failure(retail5):
    class Broken(Tau2Environment):
        def score(self, task, steps, final_message):
            raise RuntimeError("scorer exploded")

    traj = Trajectory(task_id=retail5.id, steps=[Step(action=retail5.gold_actions[0])], reward=0.5)
    assert replay_reward(retail5, traj, env_factory=Broken) is None
    assert traj.reward is None and "scorer exploded" in traj.reward_info["error"]
    assert traj.steps[0].real_observation is not None


def test_replay_uses_a_private_environment(retail5):
    made = []

    def factory(domain):
        env = Tau2Environment(domain)
        made.append(env)
        return env

    other = Tau2Environment("retail")
    other.reset(retail5)
    h = other.snapshot()
    traj = Trajectory(task_id=retail5.id, steps=[Step(action=a) for a in retail5.gold_actions])
    replay_reward(retail5, traj, env_factory=factory)
    assert len(made) == 1 and made[0].calls_made == len(retail5.gold_actions)
    assert other.snapshot() == h and other.calls_made == 0


# -------------------------------------------------------------------------------- actions reward


def test_actions_reward_rule(retail5):
    gold = retail5.gold_actions
    n = len(gold)
    full = Trajectory(task_id=retail5.id, steps=[Step(action=a) for a in reversed(gold)])
    r = actions_reward(retail5, full)
    assert r.reward == 1.0 and r.sub_rewards == {"ACTION": 1.0} and full.reward == 1.0
    missing = Trajectory(task_id=retail5.id, steps=[Step(action=a) for a in gold[:-1]])
    r = actions_reward(retail5, missing)
    assert r.reward == pytest.approx((n - 1) / n) and r.sub_rewards["ACTION"] == 0.0
    wrong = gold[-1].model_copy(update={"arguments": {**gold[-1].arguments, "order_id": "#W0"}})
    r = actions_reward(retail5, Trajectory(task_id=retail5.id,
                                           steps=[Step(action=a) for a in gold[:-1] + [wrong]]))
    assert r.reward == pytest.approx((n - 1) / n) and r.info["unmatched_gold"] == [gold[-1].id]
    # One call satisfies at most one gold action.
    dup = retail5.model_copy(update={"gold_actions": [gold[0], gold[0]]})
    r = actions_reward(dup, Trajectory(task_id=dup.id, steps=[Step(action=gold[0])]))
    assert r.reward == 0.5
    empty = retail5.model_copy(update={"gold_actions": []})
    assert actions_reward(empty, Trajectory(task_id=empty.id)).reward == 1.0


def test_reward_registry():
    assert get_reward_fn("replay") is replay_reward and get_reward_fn("actions") is actions_reward
    assert set(REWARDS) == {"replay", "actions", "judge", "consistent"}
    with pytest.raises(EnvaceError, match="reward.name.*actions"):
        get_reward_fn("judge-gpt")
    with pytest.raises(EnvaceError, match="needs \\['judge'\\]"):
        get_reward_fn("judge")  # the judge's engine is a resource that must be bound


def test_a_new_reward_is_one_function_and_selectable_by_config(retail5, monkeypatch):
    monkeypatch.setattr("envace_core.training.rewards.REWARDS", dict(REWARDS))

    @register_reward("n_calls")
    def n_calls(task, trajectory, scale=1.0):
        r = RewardResult(reward=scale * len(trajectory.tool_calls()), info={"reward_fn": "n_calls"})
        trajectory.reward, trajectory.reward_info = r.reward, dict(r.info)
        return r

    cfg = load_config("test", "reward.name=n_calls")
    fn = reward_fn_from_config(cfg)
    traj = Trajectory(task_id=retail5.id, steps=[Step(action=a) for a in retail5.gold_actions]
                      + [Step(message="Done.")], termination="agent_message")
    score_trajectory(retail5, traj, fn)
    assert traj.reward == len(retail5.gold_actions)
    assert all(s.real_observation is not None for s in traj.steps[:-1])  # fidelity/replay filled anyway
    with pytest.raises(EnvaceError, match="already registered"):
        register_reward("replay")(n_calls)
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        load_config("test", "reward.name=nope")


# ------------------------------------------------------------------- termination and row rewards


def test_score_trajectory_termination_rule_and_masking(retail5):
    gold = [Step(action=a) for a in retail5.gold_actions]
    clean = Trajectory(task_id=retail5.id, steps=gold + [Step(message="Done.")], termination="user_stop")
    assert score_trajectory(retail5, clean, actions_reward).reward == 1.0  # user stop is clean
    cut = Trajectory(task_id=retail5.id, steps=list(gold), termination="max_turns")
    assert score_trajectory(retail5, cut, actions_reward).reward == 0.0
    assert cut.reward_info["actions_reward"] == 1.0
    bad = Trajectory(task_id=retail5.id, steps=list(gold), termination="parse_error")
    assert score_trajectory(retail5, bad, actions_reward, format_penalty=-0.5).reward == -0.5

    def failing(task, trajectory):
        trajectory.reward, trajectory.reward_info = None, {"reward_fn": "failing", "error": "x"}

    masked = Trajectory(task_id=retail5.id, steps=list(gold), termination="max_turns")
    assert score_trajectory(retail5, masked, failing).reward is None  # masked, never 0


def _gen(role):
    return Generation(role=role, prompt_ids=[1], completion_ids=[2], logprobs=[0.0])


def test_row_rewards_fidelity_bonus_for_rehearse_rows_only():
    a = ToolCall(name="f", arguments={})
    steps = [Step(action=a, observation=O({"x": 1}), real_observation=O({"x": 1}), fidelity=1.0),
             Step(action=a, observation=None, real_observation=O({"x": 2})),  # unparseable rehearsal
             Step(message="done")]
    gens = [_gen(Role.ACT), _gen(Role.REHEARSE), _gen(Role.ACT), _gen(Role.REHEARSE), _gen(Role.ACT),
            _gen(Role.USER)]
    t = Trajectory(task_id="t", steps=steps, generations=gens, reward=0.5)
    assert row_rewards(t) == [0.5] * 6
    assert row_rewards(t, 0.2) == [0.5, pytest.approx(0.7), 0.5, 0.5, 0.5, 0.5]
    unknown = t.model_copy(update={"steps": [Step(action=a, observation=O({}))] * 2})
    assert row_rewards(unknown, 0.2)[1] is None and row_rewards(unknown, 0.2)[0] == 0.5
    t.reward = None
    assert row_rewards(t, 0.2) == [None] * 6
    rows = rows_from_group("g", [t.model_copy(update={"reward": 1.0})], 0.2)
    assert [r.role for r in rows] == [g.role.value for g in gens]
    assert [r.reward for r in rows] == [1.0, pytest.approx(1.2), 1.0, 1.0, 1.0, 1.0]
    masked = rows_from_group("g", [unknown], 0.2)  # F unknown: that REHEARSE row is masked, not 0
    assert [r.valid for r in masked] == [True, False, True, False, True, True] and masked[1].reward is None


def test_tool_call_ids_do_not_need_to_be_unique(retail5):
    steps = [Step(action=ToolCall(name=a.name, arguments=a.arguments, id="same")) for a in retail5.gold_actions]
    traj = Trajectory(task_id=retail5.id, steps=steps)
    assert replay_reward(retail5, traj).sub_rewards["DB"] == 1.0


def test_sub_rewards_agree_with_a_reward_the_termination_rule_overrode(retail5):
    # every gold call made, then the turn limit cut it off: replay alone scores DB 1.0
    gold = [Step(action=a) for a in retail5.gold_actions]
    cut = score_trajectory(retail5, Trajectory(task_id=retail5.id, steps=list(gold), termination="max_turns"))
    assert cut.reward == 0.0 and cut.reward_info["replay_reward"] == 1.0
    assert cut.sub_rewards == {"DB": 0.0, "COMMUNICATE": 0.0}  # not DB: 1.0 beside reward 0
    assert cut.reward_info["replay_sub_rewards"]["DB"] == 1.0  # what the evaluator said is kept
    bad = score_trajectory(retail5, Trajectory(task_id=retail5.id, steps=list(gold), termination="parse_error"),
                           format_penalty=-0.5)
    assert bad.reward == -0.5 and set(bad.sub_rewards.values()) == {0.0}
    clean = score_trajectory(retail5, Trajectory(task_id=retail5.id, steps=gold + [Step(message="Done.")],
                                                 termination="agent_message"))
    assert clean.reward == 1.0 == clean.sub_rewards["DB"] and "replay_sub_rewards" not in clean.reward_info


def test_a_run_ending_in_an_unanswered_tool_call_is_a_named_termination(retail5):
    from envace_core.training.rewards import CLEAN_TERMINATIONS, DANGLING_TOOL_CALL

    gold = [Step(action=a, observation=O("ok")) for a in retail5.gold_actions]
    gold[-1].observation = None  # the last call never got its result back
    for termination in ("agent_message", "user_stop", ""):
        t = score_trajectory(retail5, Trajectory(task_id=retail5.id, steps=[s.model_copy() for s in gold],
                                                 termination=termination))
        assert t.termination == DANGLING_TOOL_CALL == t.reward_info["termination"] and t.reward == 0.0
        assert set(t.sub_rewards.values()) == {0.0} and t.reward_info["replay_reward"] == 1.0
    assert DANGLING_TOOL_CALL not in CLEAN_TERMINATIONS
    # an unparseable REHEARSE output also leaves the call unanswered: the format error is the cause
    t = score_trajectory(retail5, Trajectory(task_id=retail5.id, steps=list(gold), termination="parse_error"),
                         format_penalty=-0.5)
    assert (t.termination, t.reward) == ("parse_error", -0.5)
    answered = [s.model_copy(update={"observation": O("ok")}) for s in gold]  # cut by the turn limit
    assert score_trajectory(retail5, Trajectory(task_id=retail5.id, steps=answered,
                                                termination="max_turns")).termination == "max_turns"
