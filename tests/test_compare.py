"""Base vs warm start vs trained (envace_core/stages/compare.py), the held-out synthesized split that
feeds it (synth.synthesize_for_curate, curate, the dataset gate) and the warm-start id's independence
of the test and held-out tasks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.stages.compare import regressions, summarize


def test_paired_differences_use_the_tasks_scored_under_both_models():
    success = {"heldout": {"base": {"a": 0.0, "b": 0.0, "c": 1.0},
                           "warm_start": {"a": 1.0, "b": 0.0, "c": 1.0},
                           "trained": {"a": 1.0, "b": 1.0}}}  # c unscored for trained: not a 0
    s = summarize(success, {"heldout": 3})["heldout"]
    assert s["n_tasks"] == 3
    assert s["models"]["trained"]["mean"] == 1.0 and s["models"]["trained"]["n"] == 2
    assert s["models"]["base"]["mean"] == pytest.approx(1 / 3)
    tb = s["paired"]["trained - base"]
    assert tb["n"] == 2 and tb["mean"] == 1.0 and tb["ci95"] == [1.0, 1.0]  # a and b only
    tw = s["paired"]["trained - warm_start"]
    assert tw["n"] == 2 and tw["mean"] == 0.5 and tw["ci95"][0] <= 0.0 <= 0.5 <= tw["ci95"][1]
    wb = s["paired"]["warm_start - base"]
    assert wb["n"] == 3 and wb["mean"] == pytest.approx(1 / 3)


def test_a_trained_policy_below_its_base_is_named_with_its_ci():
    worse = {"test": {"base": {"a": 1.0, "b": 1.0, "c": 0.0}, "warm_start": {"a": 0.0, "b": 0.0, "c": 0.0},
                      "trained": {"a": 0.0, "b": 0.0, "c": 0.0}},
             "heldout": {"base": {"x": 1.0, "y": 1.0}, "trained": {"x": 0.0, "y": 0.0}}}
    lines = regressions(summarize(worse, {"test": 3, "heldout": 2}))
    assert len(lines) == 2  # trained − warm start is 0 on test: not a regression
    assert lines[0].startswith("test: trained - base = -0.667") and "includes 0" in lines[0]
    assert lines[1].startswith("heldout: trained - base = -1.000 [-1.000, -1.000]") and "below 0" in lines[1]
    better = {"test": {"base": {"a": 0.0}, "trained": {"a": 1.0}}}
    assert regressions(summarize(better, {"test": 1})) == [] and regressions(None) == []


def test_held_out_synthesized_tasks_are_disjoint_and_leave_the_train_tasks_unchanged():
    from envace_core.envs.tau2.synth import HELDOUT_SPLIT, level_of, synthesize_for_curate
    from envace_core.envs.tau2.tasks import load_tasks

    test = {"retail": load_tasks("retail", "test")}
    data = SimpleNamespace(domains=["retail"], synthetic_tasks_per_domain=3, synthetic_heldout_per_domain=0,
                           synthetic_levels=[1, 2, 3], synthetic_seed=0, train_split="train")
    alone, none = synthesize_for_curate(data, test)
    data.synthetic_heldout_per_domain = 3
    train, held = synthesize_for_curate(data, test)
    assert none == [] and [t.id for t in train] == [t.id for t in alone]  # h does not change the train tasks
    assert len(held) == 3 and not {t.id for t in held} & {t.id for t in train}
    assert {t.split for t in held} == {HELDOUT_SPLIT} and {t.split for t in train} == {"train"}
    assert sorted(level_of(t) for t in held) == [1, 2, 3]  # one per level, as the train ones


def test_gate_allows_the_held_out_split_only_when_named():
    import pandas as pd

    from envace_core.stages.gates import dataset_gate

    rows = [{"id": f"airline/{i}", "domain": "airline", "split": s, "first_user_message": "hi",
             "user_scenario": None, "gold_actions": "[]", "source": "{}"}
            for i, s in enumerate(["train", "test", "heldout"])]
    df = pd.DataFrame(rows)
    assert dataset_gate(df, ["airline/1"], extra_splits=["heldout"]).success
    bad = dataset_gate(df, ["airline/1"])
    assert not bad.success and not bad.checks["split is 'train' or 'test'"]


def test_the_warm_start_id_depends_on_the_train_tasks_only(tiny_model_dir, tmp_path):
    from envace_core.config import load_config
    from envace_core.stages.curate import curate
    from envace_core.stages.warm_start import warm_start_id

    def ds(**data):
        cfg = load_config("test", {"model": {"ref": str(tiny_model_dir)}, "train": {"sft_warmup_steps": 1},
                                   "data": data, "store": {"root": str(tmp_path / "store")}})
        return cfg, curate(cfg)

    cfg, a = ds(max_test_tasks_per_domain=1)
    _, b = ds(max_test_tasks_per_domain=2)  # another test set
    _, c = ds(max_train_tasks_per_domain=2)  # another train set
    assert a["version"] != b["version"] and a["train_version"] == b["train_version"]
    ids = [warm_start_id(cfg, d, "sha") for d in (a, b, c)]
    assert ids[0] == ids[1] != ids[2]


def test_evaluate_stage_compares_base_warm_start_and_trained_on_test_and_held_out_tasks(tiny_model_dir, tmp_path):
    from envace_core.config import load_config
    from envace_core.stages.curate import curate
    from envace_core.stages.evaluate import evaluate
    from envace_core.stages.warm_start import warm_start

    over = {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
            "data": {"synthetic_tasks_per_domain": 1, "synthetic_heldout_per_domain": 1, "synthetic_levels": [1]},
            "train": {"sft_warmup_steps": 1, "sft_roles": ["act"], "sft_batch_rows": 1},
            "rollout": {"max_new_tokens_act": 4}, "rehearsal": {"mode": "none"},
            "eval": {"compare": ["base", "warm_start"]},
            "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}}
    cfg = load_config("test", over)
    ds = curate(cfg)
    assert ds["n_heldout"] == 1
    warm = warm_start(cfg, ds, say=lambda s: None)
    trained = {"adapter_dir": warm["adapter_uri"], "warm_start": {**warm}}
    out = evaluate(cfg, ds, trained)
    comp = out["comparison"]
    assert set(comp["summary"]) == {"test", "heldout"}
    for name, s in comp["summary"].items():
        assert set(s["models"]) == {"base", "warm_start", "trained"} and s["n_tasks"] == 1
        assert set(s["paired"]) == {"trained - base", "trained - warm_start", "warm_start - base"}
    # the trained policy's test records are the evaluate stage's own no-rehearsal run, not a re-run
    assert {(r["model"], r["task_set"]) for r in comp["results"]} == {
        ("base", "test"), ("base", "heldout"), ("warm_start", "test"), ("warm_start", "heldout"),
        ("trained", "heldout")}
    held = [r for r in comp["results"] if r["task_set"] == "heldout"]
    assert all("synth-L1" in r["task_id"] for r in held)
    json.dumps(out, default=str)  # the Flyte task serialises it
