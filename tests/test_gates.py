"""great-expectations data gates: the curated-dataset suite, the rehearsal-quality suite, and their
wiring into `stages.curate` / `stages.validate` (a failing gate raises and nothing is registered)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from envace_core.stages.gates import (
    DataLeakError,
    DataLeakGateFailed,
    GateError,
    GateFailed,
    dataset_gate,
    rehearsal_gate,
    render_gate_html,
)


@pytest.fixture(scope="module")
def curated():
    """The real airline train+test tasks as `stages.curate` records them, and all test ids."""
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.stages.dataset import task_record

    train, test = load_tasks("airline", "train"), load_tasks("airline", "test")
    return pd.DataFrame([task_record(t) for t in train + test]), {t.id for t in test}


def _gate(df, test_ids, min_rows=2, max_rows=1000):
    return dataset_gate(df, test_ids, min_rows, max_rows, domains=["airline"])


def _failed_on(result, description):
    assert not result.success and result.checks[description] is False, result.failed
    line = next(f for f in result.failed if f.startswith(description + ":"))
    return line


def test_dataset_gate_passes_on_real_curated_tasks(curated):
    df, test_ids = curated
    r = _gate(df, test_ids)
    assert r.success and r.failed == [] and all(r.checks.values()), r.failed
    assert r.results["success"] is True and r.results["statistics"]["unsuccessful_expectations"] == 0
    json.dumps(r.results, allow_nan=False)  # strict JSON: saved as an artifact
    assert r.raise_if_failed() is r
    assert {"no test-split task in the training split", "id is unique", "id is never null",
            "gold actions are valid calls of valid tool schemas"} <= set(r.checks)


@pytest.mark.parametrize("mutate, description, expect_type", [
    (lambda df, te: df.__setitem__("id", df["id"].where(df.index != 0, None)),
     "id is never null", "expect_column_values_to_not_be_null"),
    (lambda df, te: df.__setitem__("id", df["id"].where(df.index != 1, df["id"][0])),
     "id is unique", "expect_column_values_to_be_unique"),
    (lambda df, te: df.__setitem__("gold_actions", df["gold_actions"].where(df.index != 2, "[{not json")),
     "gold_actions parse as a JSON list of tool calls", "expect_column_values_to_be_in_set"),
    (lambda df, te: df.__setitem__("gold_actions", df["gold_actions"].where(
        df.index != 3, json.dumps([{"name": "no_such_tool", "arguments": {}}]))),
     "gold actions are valid calls of valid tool schemas", "expect_column_values_to_be_in_set"),
    (lambda df, te: df.__setitem__("gold_actions", df["gold_actions"].where(
        df.index != 4, json.dumps([{"name": "get_user_details", "arguments": {"user_id": 7}}]))),
     "gold actions are valid calls of valid tool schemas", "expect_column_values_to_be_in_set"),
    (lambda df, te: df.__setitem__("split", df["split"].where(df.index != 5, "validation")),
     "split is 'train' or 'test'", "expect_column_values_to_be_in_set"),
])
def test_dataset_gate_fails_naming_the_expectation(curated, mutate, description, expect_type):
    df, test_ids = curated
    bad = df.copy()
    mutate(bad, test_ids)
    r = _gate(bad, test_ids)
    line = _failed_on(r, description)
    assert expect_type in line
    with pytest.raises(GateFailed, match=expect_type) as e:
        r.raise_if_failed()
    assert isinstance(e.value, GateError) and e.value.result is r


def test_dataset_gate_catches_a_test_task_in_train(curated):
    df, test_ids = curated
    bad = df.copy()
    leaked = min(test_ids)
    first_train = bad.index[bad["split"] == "train"][0]
    bad.loc[first_train, "id"] = leaked  # also a duplicate id now
    r = _gate(bad, test_ids)
    line = _failed_on(r, "no test-split task in the training split")
    assert "expect_column_values_to_not_be_in_set" in line and leaked in line
    with pytest.raises(DataLeakGateFailed) as e:
        r.raise_if_failed()
    assert isinstance(e.value, DataLeakError) and isinstance(e.value, GateError)


def test_dataset_gate_bounds_the_size_and_needs_both_splits(curated):
    df, test_ids = curated
    n = len(df)
    assert f"observed {n}" in _failed_on(_gate(df, test_ids, max_rows=n - 1), f"2 <= tasks <= {n - 1}")
    assert _failed_on(_gate(df, test_ids, min_rows=n + 1, max_rows=None), f"{n + 1} <= tasks <= inf")
    assert _gate(df, test_ids, min_rows=n, max_rows=n).success
    only_train = df[df["split"] == "train"]
    assert "test" in _failed_on(_gate(only_train, test_ids), "both splits are non-empty")


def test_dataset_gate_reports_a_missing_column(curated):
    df, test_ids = curated
    r = _gate(df.drop(columns=["gold_actions"]), test_ids)
    assert "column missing" in _failed_on(r, "column 'gold_actions' exists")


def _rows(n, fid, valid, parse_err, err_acc=1.0, key=1.0, value=1.0):
    """n transitions with exactly the given mean fidelity / JSON validity / parse-error rate /
    error-vs-success accuracy, and key / value F1."""
    k_valid, k_err, k_acc = round(valid * n), round(parse_err * n), round(err_acc * n)
    return [{"fidelity": fid, "json_valid": float(i < k_valid), "parse_error": float(i < k_err),
             "error_match": float(i < k_acc), "key_f1": key, "value_f1": value} for i in range(n)]


TH = {"min_fidelity": 0.5, "min_json_validity": 0.8, "max_parse_error_rate": 0.2,
      "min_error_accuracy": 0.9, "min_key_f1": 0.5, "min_value_f1": 0.25}


@pytest.mark.parametrize("rows, failing", [
    (_rows(10, 0.5, 0.8, 0.2, 0.9, 0.5, 0.25), set()),  # exactly at every threshold: passes
    (_rows(10, 0.9, 1.0, 0.0), set()),
    (_rows(10, 0.49, 0.8, 0.2), {"fidelity >= 0.500"}),
    (_rows(10, 0.5, 0.7, 0.2), {"json_validity >= 0.800"}),
    (_rows(10, 0.5, 0.8, 0.3), {"parse_error_rate <= 0.200"}),
    (_rows(10, 0.5, 0.8, 0.2, err_acc=0.8), {"error_accuracy >= 0.900"}),
    (_rows(10, 0.5, 0.8, 0.2, key=0.49), {"key_f1 >= 0.500"}),
    (_rows(10, 0.5, 0.8, 0.2, value=0.24), {"value_f1 >= 0.250"}),
    (_rows(10, 0.1, 0.0, 1.0), {"fidelity >= 0.500", "json_validity >= 0.800", "parse_error_rate <= 0.200"}),
    ([], {"at least one held-out transition"}),
])
def test_rehearsal_gate_around_each_threshold(rows, failing):
    r = rehearsal_gate(pd.DataFrame(rows) if rows else rows, TH)
    assert {k for k, ok in r.checks.items() if not ok} >= failing
    if not failing:
        assert r.success and r.failed == [], r.failed
        return
    assert not r.success
    for desc in failing:
        line = next(f for f in r.failed if f.startswith(desc))
        assert "expect_" in line
    html = render_gate_html(r)
    assert "FAILED" in html and all(d.replace(">", "&gt;").replace("<", "&lt;") in html for d in failing)
    with pytest.raises(GateError, match="rehearsal gate failed"):
        r.raise_if_failed()


def test_rehearsal_gate_rejects_out_of_range_fidelity_and_takes_a_config():
    from envace_core.config import ValidateConfig

    rows = _rows(4, 0.5, 1.0, 0.0)
    rows[0]["fidelity"] = 1.5
    r = rehearsal_gate(rows, ValidateConfig())
    assert "1 of 4 rows unexpected" in _failed_on(r, "fidelity in [0, 1]")
    no_f1 = [{k: v for k, v in row.items() if k != "key_f1"} for row in _rows(4, 0.5, 1.0, 0.0)]
    assert "4 of 4 rows unexpected" in _failed_on(rehearsal_gate(no_f1, ValidateConfig()), "key_f1 is never null")
    assert "PASSED" in render_gate_html(rehearsal_gate(_rows(4, 0.5, 1.0, 0.0), ValidateConfig()))


def _cfg(tiny_model_dir, tmp_path, **validate):
    from envace_core.config import load_config

    return load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                                "store": {"root": str(tmp_path / "store"),
                                          "registry": str(tmp_path / "registry")},
                                "validate": validate})


def test_curate_runs_the_gate_and_writes_nothing_when_it_fails(tmp_path):
    from envace_core.config import load_config
    from envace_core.stages.curate import curate
    from envace_core.store.uri import open_store

    store = {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}
    ds = curate(load_config("test", {"store": store}))
    assert ds["gate"] and all(ds["gate"].values())
    saved = open_store(store["root"]).read_json(ds["gate_key"])
    assert saved["success"] is True and saved["results"]["results"]

    store2 = {"root": str(tmp_path / "store2"), "registry": str(tmp_path / "registry")}
    with pytest.raises(GateFailed, match="expect_table_row_count_to_be_between"):
        curate(load_config("test", {"store": store2, "data": {"min_dataset_rows": 3}}))
    assert not (tmp_path / "store2").exists() or not any((tmp_path / "store2").rglob("*.parquet"))


def test_validate_raises_on_unmet_thresholds_and_nothing_is_registered(tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    """The random tiny model cannot reach fidelity 1: validate raises and the Flyte run stops."""
    monkeypatch.chdir(tmp_path)
    import envace_core.stages.validate as validate_mod
    from envace_core.stages.curate import curate
    from envace_core.store.registry import Registry
    from envace_core.store.uri import open_store

    cfg = _cfg(tiny_model_dir, tmp_path, min_fidelity=1.0, min_json_validity=1.0,
               max_parse_error_rate=0.0)
    ds = curate(cfg)
    with pytest.raises(GateError) as e:
        validate_mod.validate(cfg, ds, {"adapter_dir": None, "run_id": "no-train"})
    msg = str(e.value)
    assert "fidelity >= 1.000" in msg and "expect_column_mean_to_be_between" in msg
    saved = open_store(cfg.store.root).read_json("validation/no-train/gate.json")
    assert saved["success"] is False and saved["checks"]["fidelity >= 1.000"] is False

    passing = validate_mod.validate(_cfg(tiny_model_dir, tmp_path), ds, {"adapter_dir": None, "run_id": "ok"})
    assert all(passing["gate"].values()) and passing["gate_key"] == "validation/ok/gate.json"
    m = passing["metrics"]
    assert set(m) >= {"fidelity", "json_validity", "parse_error_rate", "error_prediction_accuracy",
                      "key_f1", "value_f1", "per_tool", "per_kind"}
    assert sum(t["json_valid"]["n"] for t in m["per_tool"].values()) == m["transitions"]
    assert set(m["per_kind"]) <= {"success", "error"} and m["per_kind"]

    from workflows.train import train

    overrides = json.dumps({"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                            "store": {"root": str(tmp_path / "wf-store"),
                                      "registry": str(tmp_path / "wf-registry")},
                            "validate": {"min_fidelity": 1.0}})
    with pytest.raises(Exception, match="fidelity >= 1.000"):
        train(profile="test", overrides=overrides)
    assert Registry(tmp_path / "wf-registry").list() == []


def test_validate_rehearses_with_the_rollouts_budgets_and_grounding(bundled_tokenizer_dir):
    """validate's REHEARSE prompts and budgets are the rollouts': each call of a tool gets that tool's
    budget (others the flat one), and with rollout.grounding_k the prompts hold real results of the
    train tasks (the validated ones are test-split tasks)."""
    from transformers import AutoTokenizer

    from envace_core.config import load_config
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.stages.validate import held_out_transitions, rehearse_rows
    from envace_core.training.loop import grounded_params, real_train_transitions
    from envace_core.training.policy import rollout_params

    cfg = load_config("test", {"rollout": {"grounding_k": 2, "max_new_tokens_rehearse": 8,
                                           "max_new_tokens_rehearse_per_tool": {"get_reservation_details": 40}}})
    params = grounded_params(cfg, rollout_params(cfg), real_train_transitions(cfg, load_tasks("airline", "train")[:6]))
    trans = held_out_transitions(load_tasks("airline", "test")[:6], 6, errors=True)
    assert {c.name for _, _, c, _ in trans} >= {"get_reservation_details"}

    class Recorder:  # the real tokenizer and prompts; records what it was asked
        def __init__(self, tok):
            self.tokenizer, self.asked = tok, []

        def generate(self, prompts, params):
            from envace_core.engines.base import Completion

            from envace_core.engines.base import prompt_budgets

            self.asked += [(self.tokenizer.decode(p), b) for p, b in zip(prompts, prompt_budgets(params, len(prompts)))]
            ids = self.tokenizer.encode('{"error": "x"}', add_special_tokens=False) + [self.tokenizer.eos_token_id]
            return [[Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")] for _ in prompts]

    eng = Recorder(AutoTokenizer.from_pretrained(bundled_tokenizer_dir))
    rows = rehearse_rows(cfg, eng, trans, params)  # validate's: `validation_params`
    assert len(rows) == len(trans) == len(eng.asked)
    want = sorted(40 if c.name == "get_reservation_details" else 8 for _, _, c, _ in trans)
    assert sorted(b for _, b in eng.asked) == want
    assert any("# Examples from other conversations" in t for t, _ in eng.asked), \
        "grounding_k = 2 but no REHEARSE prompt shows a real example"
    plain = rehearse_rows(cfg, Recorder(eng.tokenizer), trans)  # default: the profile's params, no index
    assert len(plain) == len(trans)


def test_fit_budget_keeps_only_transitions_whose_real_result_fits_and_fills_the_limit(bundled_tokenizer_dir):
    """validate.fit_budget skips held-out transitions whose real result (+ eos) exceeds its tool's
    REHEARSE budget, and still returns validate.max_transitions of the ones that fit; without it the
    first transitions are taken whatever their length."""
    from transformers import AutoTokenizer

    from envace_core.config import load_config
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.roles.bounds import n_tokens
    from envace_core.stages.validate import fits_budget, held_out_transitions
    from envace_core.training.policy import rollout_params

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir)
    cfg = load_config("test", {"rollout": {"max_new_tokens_rehearse": 48,
                                           "max_new_tokens_rehearse_per_tool": {"get_user_details": 2000}}})
    params = rollout_params(cfg)
    tasks = load_tasks("airline", "test")[:10]
    every = held_out_transitions(tasks, 60, errors=True)
    fit = [n_tokens(tok, o.content) + 1 <= params.rehearse_budget(c.name) for _, _, c, o in every]
    assert any(fit) and not all(fit), "the fixture needs transitions on both sides of the budget"
    kept = held_out_transitions(tasks, 5, errors=True, keep=fits_budget(params, tok))
    assert len(kept) == 5
    assert [c.id for _, _, c, _ in kept] == [c.id for (_, _, c, _), f in zip(every, fit) if f][:5]
    assert any(c.name == "get_user_details" and not o.error for _, _, c, o in kept)  # its own, larger budget
    assert all(n_tokens(tok, o.content) + 1 <= params.rehearse_budget(c.name) for _, _, c, o in kept)


def test_cpu_smoke_gate_takes_the_warm_starts_lower_bounds_and_stops_a_base_level_rehearser():
    """benchmarks/gate_calibration.py's thresholds are the warm start's 95 % lower bounds rounded down to
    0.05; with the cpu-smoke profile's thresholds, rows at the warm start's measured level pass the
    rehearsal gate and rows of a rehearser that fell to the base model's level (nothing parses) fail."""
    from envace_core.config import load_config
    from envace_core.stages.gates import GateFailed, gate_thresholds, rehearsal_gate
    from tests.benchmark_loader import load_benchmark

    gc = load_benchmark("gate_calibration")
    warm = {"json_valid": {"mean": 0.46, "ci_low": 0.2501}, "error_match": {"mean": 0.38, "ci_low": 0.2083},
            "key_f1": {"mean": 0.38, "ci_low": 0.199}, "value_f1": {"mean": 0.0, "ci_low": 0.0}}
    th = gc.proposed_thresholds(warm)
    assert th == pytest.approx({"min_json_validity": 0.25, "min_error_accuracy": 0.2, "min_key_f1": 0.15,
                                "min_value_f1": 0.0})

    v = load_config("cpu-smoke").validate_
    assert v.fit_budget and gate_thresholds(v)["active"]
    # the profile's floors are that rule applied to the main job's policy on validate's 24 transitions
    # (RESULTS.md, "Rehearsal gate", 2026-12-02 second derivation): 10/24 outputs parse (95 % bootstrap
    # lower bound 0.21), 5/24 match error-vs-success (lower bound 0.08; key F1 floored the same)
    from envace_core.evaluation.stats import mean_ci

    def low(k: int, n: int = 24) -> dict:
        return {"ci_low": mean_ci([1.0] * k + [0.0] * (n - k))["ci95"][0]}

    measured = gc.proposed_thresholds({"json_valid": low(10), "error_match": low(5), "key_f1": low(5)})
    assert (v.min_json_validity, v.min_error_accuracy, v.min_key_f1, v.max_parse_error_rate) == pytest.approx(
        (measured["min_json_validity"], measured["min_error_accuracy"], measured["min_key_f1"],
         1 - measured["min_json_validity"]))

    def rows(n_valid: int, n_match: int, n: int = 24) -> list[dict]:
        # n_valid outputs parse, the first n_match of them match error-vs-success and the key structure
        # (value F1 0: the warm start's)
        return [{"fidelity": 0.0, "json_valid": float(i < n_valid), "parse_error": float(i >= n_valid),
                 "error_match": float(i < n_match), "key_f1": float(i < n_match), "value_f1": 0.0}
                for i in range(n)]

    assert rehearsal_gate(rows(10, 5), v).success  # the measured level
    regressed = rehearsal_gate(rows(0, 0), v)
    assert not regressed.success and len(regressed.failed) >= 3
    with pytest.raises(GateFailed):
        regressed.raise_if_failed()
