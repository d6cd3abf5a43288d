"""The imagination-consistent reward (`rewards.consistent_reward`, `training.transpose`): ACT is scored
against the task's gold transposed into the world REHEARSE showed it, and cannot game it."""

import json

import pytest

from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.training.rewards import consistent_reward, replay_observations, score_trajectory
from envace_core.training.transpose import canonical, gold_reference, locate, transpose_and_check
from envace_core.types import Observation, Step, Task, ToolCall, Trajectory

REAL = {  # the real database's answers
    ("get_user_details", "u_kim"): {"name": "Kim", "reservations": ["R1AAA", "R2BBB"]},
    ("get_reservation_details", "R2BBB"): {"reservation_id": "R2BBB", "origin": "SFO",
                                           "payment_history": [{"payment_id": "cc_9", "amount": 100}]},
}


class FakeEnv(ToolEnvironment):
    def __init__(self, domain):
        self.domain = domain

    def tools(self):
        return []

    def policy(self):
        return ""

    def reset(self, task):
        pass

    def step(self, call):
        value = REAL.get((call.name, next(iter(call.arguments.values()), None)))
        if call.name == "cancel_reservation":
            value = {"status": "cancelled"}
        return Observation(content=json.dumps(value), error=False) if value else \
            Observation(content='{"error":"not found"}', error=True)

    def snapshot(self):
        return ""

    def score(self, task, steps, final_message):
        raise AssertionError("an imagined trajectory is never scored by the real evaluator")


TASK = Task(
    id="airline/t1", domain="airline", split="train",
    first_user_message="Hi, I'm u_kim. Cancel my second reservation and tell me where it departs from.",
    gold_actions=[ToolCall(name="get_user_details", arguments={"user_id": "u_kim"}),
                  ToolCall(name="get_reservation_details", arguments={"reservation_id": "R2BBB"}),
                  ToolCall(name="cancel_reservation", arguments={"reservation_id": "R2BBB"})],
    source={"evaluation_criteria": {"communicate_info": ["SFO"]}})


def imagined(*steps):
    out = []
    for s in steps:
        if isinstance(s, str):
            out.append(Step(message=s))
        else:
            name, args, obs = s
            out.append(Step(action=ToolCall(name=name, arguments=args),
                            observation=Observation(content=json.dumps(obs))))
    return Trajectory(task_id=TASK.id, imagined=True, steps=out, termination="agent_message")


# REHEARSE imagined other records than the real ones: other ids, another origin
LOOKUP = ("get_user_details", {"user_id": "u_kim"}, {"name": "Kim", "reservations": ["X7QQQ", "Y8ZZZ"]})
DETAILS = ("get_reservation_details", {"reservation_id": "Y8ZZZ"},
           {"reservation_id": "Y8ZZZ", "origin": "LAX", "payment_history": []})
CANCEL = ("cancel_reservation", {"reservation_id": "Y8ZZZ"}, {"status": "cancelled"})


def score(traj):
    return consistent_reward(TASK, traj, env_factory=FakeEnv)


def test_acting_correctly_in_the_rehearsed_world_gets_full_credit():
    traj = imagined(LOOKUP, DETAILS, CANCEL, "Done: reservation Y8ZZZ (from LAX) is cancelled.")
    res = score(traj)
    assert res.reward == 1.0 and res.sub_rewards == {"ACTION": 1.0, "COMMUNICATE": 1.0}
    assert traj.reward == 1.0 and traj.reward_info["n_scorable"] == 4


def test_stating_the_real_value_it_was_never_shown_fails_the_communicate_item():
    res = score(imagined(LOOKUP, DETAILS, CANCEL, "Cancelled. It departed from SFO."))
    assert res.reward == pytest.approx(3 / 4) and res.sub_rewards["COMMUNICATE"] == 0.0


def test_a_value_found_in_no_observation_earns_nothing():
    res = score(imagined(LOOKUP, DETAILS, CANCEL, "Cancelled. It departed from JFK."))
    assert res.sub_rewards["COMMUNICATE"] == 0.0
    res = score(imagined(LOOKUP, ("get_reservation_details", {"reservation_id": "Q1WWW"}, DETAILS[2]),
                         ("cancel_reservation", {"reservation_id": "Q1WWW"}, {}), "Cancelled; LAX."))
    # an id it was never shown: both calls on it fail, and the stray write zeroes the trajectory
    assert res.reward == 0.0 and traj_items(res)["action"] == ["pass", "fail", "fail"]


def traj_items(res):
    out = {}
    for i in res.info["items"]:
        out.setdefault(i["kind"], []).append(i["outcome"])
    return out


def test_skipping_the_required_look_up_scores_zero_even_with_the_real_ids():
    # ACT "remembers" the real id instead of looking it up: everything that depends on the look-up fails
    res = score(imagined(("get_reservation_details", {"reservation_id": "R2BBB"}, REAL[("get_reservation_details", "R2BBB")]),
                         ("cancel_reservation", {"reservation_id": "R2BBB"}, {"status": "cancelled"}),
                         "Cancelled, it was from SFO."))
    assert res.reward == 0.0, res.info["items"]


def test_a_stray_database_write_zeroes_the_trajectory():
    res = score(imagined(LOOKUP, DETAILS, CANCEL, ("cancel_reservation", {"reservation_id": "X7QQQ"}, {}),
                         "Both cancelled; Y8ZZZ was from LAX."))
    assert res.reward == 0.0 and res.info["stray_writes"] == ["cancel_reservation"]


def test_an_imagined_record_of_another_shape_is_unscorable_not_blamed_on_act():
    odd = ("get_user_details", {"user_id": "u_kim"}, {"name": "Kim"})  # no reservations list at all
    traj = imagined(odd, "I could not find any reservation.")
    res = score(traj)
    assert traj_items(res) == {"action": ["pass", "unscorable", "unscorable"], "communicate": ["unscorable"]}
    assert res.reward == 1.0  # the look-up passed; nothing ACT could act on was shown after it


def test_a_wrong_imagined_record_gives_act_credit_but_costs_rehearse_fidelity():
    traj = imagined(LOOKUP, DETAILS, CANCEL, "Cancelled Y8ZZZ, from LAX.")
    assert score(traj).reward == 1.0
    replay_observations(TASK, traj, FakeEnv)
    assert traj.steps[0].fidelity < 1.0 and traj.steps[1].fidelity < 1.0


def test_real_trajectories_keep_the_replay_reward():
    traj = Trajectory(task_id=TASK.id, imagined=False, steps=[Step(message="hi")], termination="agent_message")

    class Scored(FakeEnv):
        def score(self, task, steps, final_message):
            return RewardResult(reward=0.5, sub_rewards={"DB": 0.5}, info={})

    res = consistent_reward(TASK, traj, env_factory=Scored)
    assert res.reward == 0.5 and traj.reward_info["reward_fn"] == "replay"


def test_canonical_and_locate():
    assert canonical("1628") == canonical(1628) == canonical(1628.0) and canonical(" SFO ") == canonical("sfo")
    i, addr = locate("cc_9", [{"a": 1}, REAL[("get_reservation_details", "R2BBB")]])
    assert i == 1 and [a[0] for a in addr] == ["key", "index", "key"]
    assert locate("nowhere", [REAL[("get_user_details", "u_kim")]]) is None


def test_on_a_real_tau2_task_the_real_world_itself_scores_one():
    """With REHEARSE reproducing the real records exactly, the transposed gold is the gold itself."""
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.tasks import load_tasks

    task = next(t for t in load_tasks("airline", "train") if len(t.gold_actions) >= 3)
    ref = gold_reference(task, Tau2Environment)
    env = Tau2Environment(task.domain)
    env.reset(task)
    steps = [Step(action=a, observation=env.step(a)) for a in task.gold_actions]
    steps.append(Step(message=" ".join((task.source.get("evaluation_criteria") or {}).get("communicate_info") or [])))
    traj = Trajectory(task_id=task.id, imagined=True, steps=steps, termination="agent_message")
    checked = transpose_and_check(task, traj, ref)
    assert [i.outcome for i in checked.items if i.kind == "action"] == ["pass"] * len(task.gold_actions)
    scored = score_trajectory(task, traj, consistent_reward)
    assert scored.reward == 1.0, scored.reward_info
