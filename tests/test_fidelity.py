"""Rehearsal fidelity metrics (`evaluation.fidelity`) on hand-made (real, imagined, call) pairs: each
metric moves the way it must when one thing is wrong, and the per-tool / per-kind aggregation with
bootstrap intervals."""

from __future__ import annotations

import json

import pytest

from envace_core.evaluation.fidelity import (
    METRICS,
    aggregate,
    bootstrap_mean_ci,
    canonical_leaf,
    f1,
    key_paths,
    leaf_values,
    real_value,
    score_pair,
)
from envace_core.types import Observation, ToolCall

CALL = ToolCall(name="get_reservation_details", arguments={"reservation_id": "PEP4E0"})
REAL = {"reservation_id": "PEP4E0", "user_id": "sophia_taylor_9065", "cabin": "economy",
        "flights": [{"flight_number": "HAT176", "price": 51}, {"flight_number": "HAT097", "price": 84}]}


def _real(value=REAL, error=False):
    return Observation(content=json.dumps(value, separators=(",", ":")), error=error)


def _score(imagined, real=None, call=CALL):
    text = imagined if isinstance(imagined, str) else json.dumps(imagined)
    return score_pair(real or _real(), text, call)


def test_the_exact_result_scores_one_everywhere():
    s = _score(REAL)
    assert (s.json_valid, s.error_match, s.key_f1, s.value_f1, s.echo_f1, s.imagined_f1) == (1, 1, 1, 1, 1, 1)
    assert s.kind == "success" and s.tool == "get_reservation_details"


def test_key_paths_collapse_list_positions_and_mark_a_scalar_root():
    assert key_paths({"a": {"b": [{"c": 1}, {"d": 2}]}}) == {"a", "a.b", "a.b[]", "a.b[].c", "a.b[].d"}
    assert key_paths("mei_kovacs_8020") == {"$"} and key_paths([1, 2]) == {"[]"}


def test_a_missing_key_lowers_key_f1_and_value_f1():
    partial = {k: v for k, v in REAL.items() if k != "user_id"}
    s = _score(partial)
    # paths: reservation_id, user_id, cabin, flights, flights[], flights[].flight_number, flights[].price = 7
    assert s.key_f1 == pytest.approx(2 * 6 / (6 + 7))
    assert s.value_f1 == pytest.approx(2 * 6 / (6 + 7)) and s.json_valid == 1 and s.error_match == 1


def test_a_wrong_value_lowers_value_f1_but_not_key_f1():
    s = _score({**REAL, "cabin": "business"})
    assert s.key_f1 == 1.0 and s.value_f1 == pytest.approx(2 * 6 / 14)
    assert s.echo_f1 == 1.0 and s.imagined_f1 == pytest.approx(2 * 5 / 12)  # the wrong leaf is imagined


def test_canonicalisation_numbers_as_floats_strings_stripped_case_kept():
    assert canonical_leaf(51) == canonical_leaf(51.0) != canonical_leaf("51")
    assert canonical_leaf(True) != canonical_leaf(1)
    assert canonical_leaf("  economy \n") == canonical_leaf("economy")
    assert canonical_leaf("PEP4E0") != canonical_leaf("pep4e0")  # tau2 ids are case-sensitive
    s = _score({**REAL, "flights": [{"flight_number": "HAT176", "price": 51.0},
                                    {"flight_number": " HAT097", "price": 84}]})
    assert s.value_f1 == 1.0


def test_list_order_does_not_matter_but_multiplicity_does():
    swapped = {**REAL, "flights": REAL["flights"][::-1]}
    assert _score(swapped).value_f1 == 1.0
    doubled = {**REAL, "flights": REAL["flights"] + REAL["flights"][:1]}
    assert _score(doubled).value_f1 < 1.0 and _score(doubled).key_f1 == 1.0
    assert f1(leaf_values([1, 1]), leaf_values([1])) == pytest.approx(2 / 3)


def test_echo_counts_as_echo_and_the_rest_as_imagined():
    s = _score({"reservation_id": "PEP4E0"})
    assert s.echo_share == pytest.approx(1 / 7)  # 1 of REAL's 7 leaves repeats the call's argument
    assert s.echo_f1 == 1.0 and s.imagined_f1 == 0.0
    wrong_echo = _score({**REAL, "reservation_id": "XYZ123"})
    assert wrong_echo.echo_f1 == 0.0 and wrong_echo.imagined_f1 < 1.0  # "XYZ123" is an imagined leaf
    no_args = score_pair(_real(), json.dumps(REAL), ToolCall(name="list_all_airports", arguments={}))
    assert no_args.echo_share == 0.0 and no_args.echo_f1 is None and no_args.imagined_f1 == 1.0


def test_error_vs_success_mismatch_and_errors_in_both_forms():
    tau2_err = Observation(content="Error: Reservation XYZ123 not found", error=True)
    w_err = Observation(content='{"error":"Reservation XYZ123 not found"}', error=True)
    assert real_value(tau2_err) == real_value(w_err) == {"error": "Reservation XYZ123 not found"}
    both = score_pair(w_err, '{"error": "Reservation XYZ123 not found"}', CALL)
    assert both.kind == "error" and (both.error_match, both.key_f1, both.value_f1) == (1, 1, 1)
    other_text = score_pair(w_err, '{"error": "not found"}', CALL)
    assert other_text.error_match == 1 and other_text.key_f1 == 1 and other_text.value_f1 == 0
    imagined_success = score_pair(w_err, json.dumps(REAL), CALL)
    assert imagined_success.error_match == 0.0 and imagined_success.key_f1 == 0.0
    imagined_error = _score({"error": "Reservation PEP4E0 not found"})
    assert imagined_error.error_match == 0.0 and imagined_error.kind == "success"


def test_invalid_or_missing_output_scores_zero():
    for text in ("the reservation is PEP4E0", '{"reservation_id": "PEP4E0"', "", None):
        s = score_pair(_real(), text, CALL)
        assert (s.json_valid, s.error_match, s.key_f1, s.value_f1, s.echo_f1, s.imagined_f1) == (0,) * 6
    fenced = score_pair(_real(), "```json\n" + json.dumps(REAL) + "\n```", CALL)
    assert fenced.json_valid == 1 and fenced.value_f1 == 1


def test_a_plain_string_result_is_a_scalar():
    real = Observation(content='"mei_kovacs_8020"')
    call = ToolCall(name="find_user_id_by_name_zip", arguments={"first_name": "Mei", "zip": "28236"})
    assert score_pair(real, '"mei_kovacs_8020"', call).value_f1 == 1.0
    wrong = score_pair(real, '"mei_kovacs_1234"', call)
    assert wrong.key_f1 == 1.0 and wrong.value_f1 == 0.0 and wrong.echo_share == 0.0
    assert score_pair(real, '{"user_id": "mei_kovacs_8020"}', call).key_f1 == 0.0


def test_bootstrap_interval_is_seeded_contains_the_mean_and_empty_is_none():
    xs = [0.0] * 30 + [1.0] * 70
    a, b = bootstrap_mean_ci(xs, seed=3), bootstrap_mean_ci(xs, seed=3)
    assert a == b and a["n"] == 100 and a["mean"] == pytest.approx(0.7)
    assert 0.55 < a["ci_low"] < 0.7 < a["ci_high"] < 0.85
    assert bootstrap_mean_ci([1.0] * 5)["ci_low"] == 1.0
    assert bootstrap_mean_ci([]) == {"mean": None, "ci_low": None, "ci_high": None, "n": 0}


def test_aggregate_per_tool_and_kind():
    err = Observation(content='{"error":"Reservation X not found"}', error=True)
    other = ToolCall(name="get_user_details", arguments={"user_id": "u1"})
    scores = [_score(REAL), _score({**REAL, "cabin": "business"}), score_pair(err, '{"cabin": "economy"}', CALL),
              score_pair(_real({"user_id": "u1"}), '{"user_id": "u1"}', other), score_pair(_real(), "x", CALL)]
    agg = aggregate(scores, n_boot=200)
    assert set(agg) == {"all", "per_tool", "per_kind"} and set(agg["all"]) == set(METRICS)
    assert agg["all"]["json_valid"]["mean"] == pytest.approx(0.8) and agg["all"]["json_valid"]["n"] == 5
    assert agg["per_kind"]["error"]["error_match"] == {"mean": 0.0, "ci_low": 0.0, "ci_high": 0.0, "n": 1}
    assert agg["per_kind"]["success"]["error_match"]["mean"] == pytest.approx(3 / 4)
    assert agg["per_tool"]["get_user_details"]["value_f1"]["mean"] == 1.0
    assert agg["per_tool"]["get_reservation_details"]["json_valid"]["n"] == 4
    # echo_f1 is undefined for the error transition (no echo leaf on either side): it is left out
    assert agg["per_tool"]["get_reservation_details"]["echo_f1"]["n"] == 3


def test_imagined_results_are_compared_in_the_canonical_rendering_and_a_cut_one_matches_nothing():
    from envace_core.envs.tau2.observations import real_observation

    product = {"name": "Lamp", "product_id": "681", "variants": {"838": {"item_id": "838", "price": 137.94}}}
    real = real_observation("get_product_details", json.dumps(product), False)  # the view drops variants.838.item_id
    call = ToolCall(name="get_product_details", arguments={"product_id": "681"})
    assert "item_id" not in real.content
    assert score_pair(real, json.dumps(product), call).value_f1 == 1.0  # the same view on the imagined side
    cut = score_pair(real, '{"name":"Lamp","product_id":"681"…[tool result truncated: 9 of 30 tokens shown]', call)
    assert cut.json_valid == 1.0 and cut.error_match == 1.0 and cut.key_f1 == 0.0 and cut.value_f1 == 0.0
