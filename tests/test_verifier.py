"""The verifier filter for imagined trajectories (METHOD.md §4): format checks and tau2 policy rules."""

import json

import pytest

from envace_core import EnvaceError
from envace_core.envs.tau2.rules import (
    airline_booking_limits,
    airline_booking_reads_user,
    airline_reservation_read_before_write,
    policy_rule_checks,
    retail_authenticate_first,
    retail_modify_items_once,
    retail_order_read_before_write,
)
from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.models import load_tokenizer
from envace_core.rehearsal.verifier import (
    FORMAT_CHECKS,
    default_checks,
    grounded_error_check,
    json_response_check,
    schema_check,
    unknown_tool_check,
    verify,
)
from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
from envace_core.types import Observation, Step, ToolCall, Trajectory
from tests.scripted import ScriptedEngine

P = RolloutParams(max_turns=2, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0)


@pytest.fixture(scope="module")
def ctx():
    return task_context(load_tasks("airline", "test", limit=1)[0], 300)


def step(name, args, obs='{"ok": true}', error=False, real=False):
    o = Observation(content=obs, error=error)
    return Step(action=ToolCall(name=name, arguments=args), observation=o, real_observation=o if real else None)


def traj(*steps):
    return Trajectory(task_id="t", steps=list(steps), termination="agent_message")


GOOD = (step("get_reservation_details", {"reservation_id": "ABC123"}, '{"reservation_id": "ABC123"}'),
        step("cancel_reservation", {"reservation_id": "ABC123"}, '{"status": "cancelled"}'))


def test_good_trajectory_is_kept(ctx):
    good = traj(*GOOD)
    kept, rejected = verify([good], ctx, default_checks("airline"))
    assert kept == [good] and rejected == []


@pytest.mark.parametrize("bad, check, reason", [
    (traj(step("teleport", {"to": "Mars"})), unknown_tool_check, "unknown tool at step 0: 'teleport'"),
    (traj(step("get_reservation_details", {"reservation_id": 5})), schema_check, "schema violation at step 0"),
    (traj(step("get_reservation_details", {"reservation": "X"})), schema_check, "has no argument"),
    (traj(step("get_reservation_details", {"reservation_id": "X"}, "sure, found it")), json_response_check,
     "imagined response at step 0 is not JSON"),
])
def test_each_format_violation_is_rejected_with_its_reason(ctx, bad, check, reason):
    good = traj(*GOOD)
    kept, rejected = verify([good, bad], ctx, list(FORMAT_CHECKS))
    assert kept == [good] and [t for t, _ in rejected] == [bad]
    assert any(reason in r for r in rejected[0][1]), rejected[0][1]
    assert check(bad, ctx) and not check(good, ctx)


def test_real_observations_are_not_held_to_json(ctx):
    real = traj(step("get_reservation_details", {"reservation_id": "X"}, "Error: Reservation X not found",
                     error=True, real=True))
    assert json_response_check(real, ctx) == []


def test_failed_act_and_rehearse_outputs_of_real_rollouts_are_caught(tiny_model_dir, ctx):
    """With strict parsing a bad call never becomes a step: the checks read the generation's parse error."""
    tok = load_tokenizer(tiny_model_dir)
    def call(name, args):
        return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"

    unknown = rehearsal_rollouts(ScriptedEngine(tok, [call("teleport", {})]), ctx, 1, P)[0]
    bad_args = rehearsal_rollouts(ScriptedEngine(tok, [call("get_reservation_details", {"reservation_id": 5})]),
                                  ctx, 1, P)[0]
    prose = rehearsal_rollouts(ScriptedEngine(tok, [call("get_reservation_details", {"reservation_id": "X"})],
                                              rehearse_text="It returns the reservation."), ctx, 1, P)[0]
    assert not unknown.steps and not bad_args.steps and unknown.termination == "parse_error"
    assert any("unknown tool in ACT output: UnknownTool" in r for r in unknown_tool_check(unknown, ctx))
    assert any("schema violation in ACT output: InvalidArguments" in r for r in schema_check(bad_args, ctx))
    assert any("rehearsed response is not JSON: InvalidRehearsal" in r for r in json_response_check(prose, ctx))
    kept, rejected = verify([unknown, bad_args, prose], ctx, list(FORMAT_CHECKS))
    assert kept == [] and len(rejected) == 3


def test_airline_rules(ctx):
    write_first = traj(GOOD[1])
    failed_read = traj(step("get_reservation_details", {"reservation_id": "ABC123"}, '{"error": "not found"}',
                            error=True), GOOD[1])
    other_read = traj(step("get_reservation_details", {"reservation_id": "ZZZ999"}), GOOD[1])
    assert airline_reservation_read_before_write(traj(*GOOD), ctx) == []
    for bad in (write_first, failed_read, other_read):
        [reason] = airline_reservation_read_before_write(bad, ctx)
        assert "cancel_reservation" in reason and "get_reservation_details" in reason
    pax = [{"first_name": "A", "last_name": "B", "dob": "2000-01-01"}] * 6
    pay = [{"payment_id": "credit_card_1", "amount": 1}, {"payment_id": "credit_card_2", "amount": 1},
           {"payment_id": "gift_card_1", "amount": 1}]
    book = step("book_reservation", {"user_id": "u1", "passengers": pax, "payment_methods": pay})
    reasons = airline_booking_limits(traj(book), ctx)
    assert any("at most five passengers" in r for r in reasons)
    assert any("credit_card" in r and "2 used" in r for r in reasons) and not any("gift_card" in r for r in reasons)
    assert airline_booking_reads_user(traj(book), ctx)
    assert airline_booking_reads_user(traj(step("get_user_details", {"user_id": "u1"}), book), ctx) == []


def test_retail_rules(ctx):
    auth = step("find_user_id_by_email", {"email": "a@b.c"}, '"u1"')
    read = step("get_order_details", {"order_id": "#W1"})
    modify = step("modify_pending_order_items", {"order_id": "#W1"})
    cancel = step("cancel_pending_order", {"order_id": "#W1", "reason": "no longer needed"})
    assert retail_authenticate_first(traj(read, cancel), ctx)
    assert retail_authenticate_first(traj(step("calculate", {"expression": "1+1"}), auth, read, cancel), ctx) == []
    assert retail_order_read_before_write(traj(auth, cancel), ctx)
    assert retail_order_read_before_write(traj(auth, read, cancel), ctx) == []
    [reason] = retail_modify_items_once(traj(auth, read, modify, cancel), ctx)
    assert "only once" in reason and "cancel_pending_order" in reason


def test_rules_per_domain_and_bad_checks():
    assert len(policy_rule_checks("airline")) == 3 and len(policy_rule_checks("retail")) == 3
    assert policy_rule_checks("telecom") == [] and policy_rule_checks("mock") == []
    with pytest.raises(EnvaceError, match="not callable"):
        verify([], None, ["schema"])


def test_reasons_from_all_checks_are_listed(ctx):
    bad = traj(step("teleport", {}), step("cancel_reservation", {"reservation_id": 1}, "nope"))
    _, [(_, reasons)] = verify([bad], ctx, default_checks("airline"))
    text = json.dumps(reasons)
    assert "unknown tool" in text and "schema violation" in text and "not JSON" in text and "policy" in text


# ------------------------------------------------------------------------------- grounded errors
def test_imagined_error_on_the_users_own_data_is_rejected():
    """An imagined "not found" for the id and name the user gave is rejected; an error for an id nobody
    gave, an imagined success, a real error and a call with no argument values are not."""
    from envace_core.types import TaskContext

    ctx = TaskContext(task_id="t", domain="airline", policy="", tools=[],
                      first_user_message="Hi, I'm Sofia Ito (zip 94125). Please cancel reservation LVNBYN.")
    err = '{"error": "reservation not found"}'
    grounded = step("get_reservation_details", {"reservation_id": "lvnbyn"}, err, error=True)
    [reason] = grounded_error_check(traj(grounded, Step(message="Done.")), ctx)
    assert reason.startswith("imagined error at step 0 for get_reservation_details") and "not found" in reason
    nested = step("find_user_id_by_name_zip", {"name": {"first": "Sofia", "last": "Ito"}, "zip": 94125,
                                                "exact": True}, err, error=True)
    assert grounded_error_check(traj(nested), ctx)
    invented = step("get_reservation_details", {"reservation_id": "ZZZ999"}, err, error=True)
    success = step("get_reservation_details", {"reservation_id": "LVNBYN"}, '{"status": "active"}')
    real = step("get_reservation_details", {"reservation_id": "LVNBYN"}, "Error: not found", error=True, real=True)
    empty = step("list_all_airports", {}, err, error=True)
    refused = step("get_reservation_details", {"reservation_id": "LVNBYN"}, err, error=True)
    refused.schema_error = "InvalidArguments: ..."  # the tool list refused it: nothing was imagined
    for t in (traj(invented), traj(success), traj(real), traj(empty), traj(refused)):
        assert grounded_error_check(t, ctx) == []
    # whole words and numbers only: a cut id, a number inside another, a real error's echo ground nothing
    for args in ({"reservation_id": "LVNBY"}, {"zip": 9412}, {"amount": 1}):
        assert grounded_error_check(traj(step("get_reservation_details", args, err, error=True)), ctx) == []
    assert grounded_error_check(traj(step("find_user_id_by_name_zip", {"zip": 94125.0}, err, error=True)), ctx)
    assert grounded_error_check(traj(step("find_user_id_by_name_zip", {"first_name": "SOFIA"}, err, error=True)), ctx)
    real_err = step("get_reservation_details", {"reservation_id": "ZZZ999"}, "Error: Reservation ZZZ999 not found",
                    error=True, real=True)
    assert grounded_error_check(traj(real_err, invented), ctx) == []
    # a value shown by a real result of the prefix (re-entry) grounds the call too
    prefix = step("get_user_details", {"user_id": "sofia_ito_7804"}, '{"reservations": ["5U3JYB"]}', real=True)
    later = step("get_reservation_details", {"reservation_id": "5U3JYB"}, err, error=True)
    assert grounded_error_check(traj(later), ctx) == []
    assert "step 1" in grounded_error_check(traj(prefix, later), ctx)[0]
    assert grounded_error_check not in default_checks("airline")
    assert default_checks("airline", grounded_errors=True)[-1] is grounded_error_check
    kept, rejected = verify([traj(success), traj(grounded)], ctx, [grounded_error_check])
    assert kept == [traj(success)] and len(rejected) == 1


def test_grounded_errors_without_the_verifier_warns():
    from envace_core.config import load_config
    from envace_core.config_checks import UnusedSettingWarning

    with pytest.warns(UnusedSettingWarning, match="grounded_errors=true has no effect"):
        load_config("test", "rehearsal.grounded_errors=true,rehearsal.verifier=false")


def test_pruning_without_the_verifier_warns_only_when_asked_for():
    import warnings

    from envace_core.config import load_config
    from envace_core.config_checks import UnusedSettingWarning
    from envace_core.evaluation.tau2 import policy_agent

    with pytest.warns(UnusedSettingWarning, match="prune_rejected=true has no effect"):
        load_config("test", "rehearsal.prune_rejected=true,rehearsal.verifier=false")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedSettingWarning)
        cfg = load_config("test", "rehearsal.verifier=false")  # the default alone is no request
    assert cfg.rehearsal.prune_rejected is True
    engine = type("E", (), {"tokenizer": None})()
    on = policy_agent(load_config("test"), engine, "parallel", 2, domain="airline", seed=0)
    off = policy_agent(load_config("test", "rehearsal.prune_rejected=false"), engine, "parallel", 2,
                       domain="airline", seed=0)
    assert (on.prune_rejected, off.prune_rejected) == (True, False)
    assert policy_agent(cfg, engine, "parallel", 2, domain="airline", seed=0).prune_rejected is False


def test_memory_lines_keep_non_ascii_arguments_as_written():
    from envace_core.rehearsal.agent import summarise

    t = traj(step("find_user_id_by_name_zip", {"first_name": "José", "city": "東京"}, '{"user_id": "jose_1"}'))
    for content in ("episode", "calls"):
        assert '"first_name": "José"' in summarise(t, 1, content=content) and "東京" in summarise(t, 1, content=content)
