"""benchmarks/rehearsal_effect.py: argument errors, CIs and paired differences, the same-item assertion,
the full-scale estimate, a tiny-model run end to end, and `--trained` as a local LoRA adapter folder."""

from __future__ import annotations

import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from tests.benchmark_loader import load_benchmark

re_ = load_benchmark("rehearsal_effect")


def test_conditions_models_benches_and_user():
    assert re_.parse_conditions("parallel:4, none,sequential:2") == ["none", "parallel:4", "sequential:2"]
    assert re_.parse_conditions(re_.DEFAULT_CONDITIONS)[0] == "none"
    for bad, msg in (("parallel:2", "must include none"), ("none,parallel:2,parallel:2", "twice"),
                     ("none,parallel:0", "parallel:0"), ("none,sideways:3", "sideways:3")):
        with pytest.raises(re_.BenchmarkError, match=msg):
            re_.parse_conditions(bad)
    assert re_.parse_models(re_.DEFAULT_MODELS, "registry:p@v1") == [
        ("base", "bundled:smollm2-135m-instruct"), ("trained", "registry:p@v1")]
    assert re_.parse_models("/m/a", None) == [("/m/a", "/m/a")]
    for models, trained, msg in (("a=x,a=y", None, "unique"), ("=x", None, "LABEL=REF"), ("", None, "no model"),
                                 ("trained=x", "y", "unique")):
        with pytest.raises(re_.BenchmarkError, match=msg):
            re_.parse_models(models, trained)
    assert re_.parse_benches(re_.DEFAULT_BENCHES) == ["tau2:airline", "tau2:retail", "bfcl:multi_turn_base"]
    with pytest.raises(re_.BenchmarkError, match="single-turn BFCL never rehearses") as e:
        re_.parse_benches("tau2:airline,bfcl:simple")
    assert "VitaBench" not in str(e.value)
    with pytest.raises(re_.BenchmarkError, match=r"vita:/.*VitaBench is not scored by this script") as e:
        re_.parse_benches("vita:/tmp")
    assert "single-turn" not in str(e.value)
    with pytest.raises(re_.BenchmarkError, match="unknown tau2 domain"):
        re_.parse_benches("tau2:mars")
    assert re_.parse_user("policy") == {} and re_.parse_user(None) == {}
    assert re_.parse_user("http://127.0.0.1:8000/v1") == {"user_url": "http://127.0.0.1:8000/v1"}
    assert re_.parse_user("bundled:smollm2-135m-instruct") == {"user_model": "bundled:smollm2-135m-instruct"}


def test_bad_arguments_stop_before_any_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(re_, "run", lambda *a, **k: pytest.fail("ran despite bad arguments"))
    for argv, msg in ((["--limit", "0"], "--limit"), (["--conditions", "parallel:2"], "include none"),
                      (["--n-boot", "10"], "--n-boot"), (["--benches", "bfcl:irrelevance"], "single-turn"),
                      (["--results-md", "/proc/x/RESULTS.md"], "--results-md"),
                      (["--benches", "bfcl:multi_turn_base", "--user", "http://127.0.0.1:9/v1"],
                       "--user http://127.0.0.1:9/v1: no selected bench uses a user simulator"),
                      (["--protocol", "opening_request", "--max-steps", "10"],
                       "--max-steps 10: --protocol opening_request runs no orchestrator"),
                      (["--benches", "bfcl:multi_turn_base", "--protocol", "opening_request"],
                       "--protocol opening_request: no selected bench uses it (it says how tau2 runs)"),
                      (["--benches", "bfcl:multi_turn_base", "--max-steps", "5"],
                       "--max-steps 5: no selected bench uses it (it counts tau2 steps")):
        assert re_.main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def broken_adapter(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "adapter_config.json").write_text("[1, 2]")
    return d


def test_bad_model_refs_profile_and_steps_stop_before_any_model_loads(capsys, monkeypatch, tmp_path,
                                                                      tiny_model_dir, broken_adapter):
    from envace_core import models

    monkeypatch.setattr(re_, "run", lambda *a, **k: pytest.fail("ran despite bad arguments"))
    monkeypatch.setattr(models, "load_model", lambda *a: pytest.fail("loaded a model despite bad arguments"))
    tiny = ["--models", f"tiny={tiny_model_dir}"]
    for argv, msg in ((["--models", f"base={tmp_path / 'does_not_exist'}"], "model base ("),
                      (["--models", "foo"], "no such file or folder"),
                      ([*tiny, "--trained", str(broken_adapter)], "is not a JSON object"),
                      ([*tiny, "--trained", "registry:nope@v1"], "model trained (registry:nope@v1)"),
                      ([*tiny, "--user", str(tmp_path / "nouser")], "--user ("),
                      (["--models", "base=bundled:llama-9000"], "unknown bundled model"),
                      (["--models", "base=bundled:smollm2-135m-instruct,"], "has an empty item (a stray comma)"),
                      ([*tiny, "--conditions", "none,,parallel:2"], "--conditions 'none,,parallel:2' has an empty item"),
                      (["--profile", "nope"], "unknown profile 'nope'"),
                      (["--max-steps", "0"], "--max-steps must be >= 2")):
        assert re_.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1 and ": error: " in err, (argv, err)
        assert "Traceback" not in err


def test_cached_cells_keep_their_earlier_timing(tmp_path):
    earlier_report = {"models": {"base": {"ref": "/m/a"}}, "cells": [
        {"model": "base", "bench": "b", "condition": "none", "items": {"1": 1.0, "2": 0.0}, "per_episode_s": 3.0},
        {"model": "base", "bench": "b", "condition": "parallel:2", "items": {"1": 1.0}, "per_episode_s": None}]}
    (tmp_path / "rehearsal_effect.json").write_text(json.dumps(earlier_report))
    earlier = re_.previous_timings(tmp_path / "rehearsal_effect.json")
    assert earlier == {("/m/a", "b", "none", ("1", "2")): 3.0}
    cached = {"work": {"b": {"ran": 0, "cached": 2}}, "seconds": {"b": 0.01}}
    t = re_.cell_timing(cached, "b", "/m/a", "none", {"2": 1.0, "1": 1.0}, earlier)
    assert t == {"ran": 0, "cached": 2, "per_episode_s": 3.0, "timed": "earlier run"}
    for ref, cond, items in (("/m/other", "none", {"1": 1, "2": 1}), ("/m/a", "parallel:2", {"1": 1, "2": 1}),
                             ("/m/a", "none", {"1": 1})):  # another model, condition or item set: not timed
        assert re_.cell_timing(cached, "b", ref, cond, items, earlier)["per_episode_s"] is None
    fresh = {"work": {"b": {"ran": 2, "cached": 0}}, "seconds": {"b": 5.0}}
    assert re_.cell_timing(fresh, "b", "/m/a", "none", {"1": 1, "2": 1}, earlier)["per_episode_s"] == 2.5
    (tmp_path / "rehearsal_effect.json").write_text("{cut")
    assert re_.previous_timings(tmp_path / "rehearsal_effect.json") == {}
    assert re_.previous_timings(tmp_path / "none.json") == {}


def test_success_ci_and_paired_difference():
    by = {"none": {"a": 0.0, "b": 0.0, "c": 1.0, "d": 1.0},
          "parallel:2": {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0},
          "sequential:2": {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}}
    e = re_.effect(by, "m/b", n_boot=2000, seed=0)
    assert e["none"]["success"]["mean"] == 0.5 and e["none"]["diff_vs_none"]["ci95"] == [0.0, 0.0]
    p = e["parallel:2"]
    assert p["success"]["mean"] == 0.75 and p["success"]["n"] == 4
    assert p["diff_vs_none"]["mean"] == 0.25 and p["diff_vs_none"]["ci95"][0] == 0.0
    assert 0.5 <= p["diff_vs_none"]["ci95"][1] <= 0.75  # diffs [1, 0, 0, 0]: resampled means in [0, 1]
    s = e["sequential:2"]["diff_vs_none"]
    assert s["mean"] == -0.5 and s["ci95"][0] < -0.5 < s["ci95"][1] <= 0.0
    # the interval is over items, paired: a constant shift gives a zero-width difference interval
    shifted = re_.effect({"none": {"a": 0.0, "b": 1.0}, "x": {"a": 0.5, "b": 1.5}}, "m/b")
    assert shifted["x"]["diff_vs_none"]["ci95"] == [0.5, 0.5] and shifted["x"]["success"]["ci95"] != [1.0, 1.0]


def test_conditions_must_score_the_same_items():
    with pytest.raises(re_.BenchmarkError, match=r"base/tau2:airline: condition parallel:2 .*missing \['b'\], extra \['c'\]"):
        re_.effect({"none": {"a": 1.0, "b": 0.0}, "parallel:2": {"a": 1.0, "c": 0.0}}, "base/tau2:airline")
    assert re_.check_same_items({"none": {"b": 1.0, "a": 0.0}, "p": {"a": 0.0, "b": 0.0}}, "x") == ["a", "b"]


def test_item_outcomes_and_rehearsal_counts_from_a_run_eval_result():
    res = {"benches": [
        {"bench": "tau2", "name": "airline", "results": [
            {"task_id": "airline/1", "reward": 1.0, "success": 1.0, "agent_stats": {"rehearsals": 2}},
            {"task_id": "airline/2", "reward": 0.0, "success": 0.0, "agent_stats": {"rehearsals": 2}},
            {"task_id": "airline/3", "reward": None, "success": None,  # judged only by NL assertions: left out
             "agent_stats": {}}]},
        {"bench": "bfcl", "name": "bfcl", "report": {"categories": {"multi_turn_base": {"entries": [
            {"id": "multi_turn_base_0", "valid": True, "rehearsal": {"rehearsals": 6}},
            {"id": "multi_turn_base_1", "valid": False, "rehearsal": None}]}}}}]}
    assert re_.item_outcomes(res) == {"tau2:airline": {"airline/1": 1.0, "airline/2": 0.0},
                                      "bfcl:multi_turn_base": {"multi_turn_base_0": 1.0, "multi_turn_base_1": 0.0}}
    assert re_.rehearsals_run(res) == {"tau2:airline": 4, "bfcl:multi_turn_base": 6}


def test_full_scale_estimate_borrows_across_models_and_names_gaps():
    cells = [{"model": "base", "bench": "b", "condition": "none", "per_episode_s": 2.0},
             {"model": "trained", "bench": "b", "condition": "none", "per_episode_s": None},  # all cached
             {"model": "base", "bench": "b", "condition": "parallel:2", "per_episode_s": None}]
    est = re_.full_scale_estimate(cells, {"b": 10})
    assert est["unmeasured_cells"] == ["base/b/parallel:2"] and est["timed_seconds"] == 40.0
    assert est["seconds"] is None and est["hours"] is None  # a partial sum would understate
    text = re_.estimate_text(est)
    assert "never timed" in text and "base/b/parallel:2" in text and text.endswith("timed cells alone: 40 s")
    untimed = re_.full_scale_estimate([{**c, "per_episode_s": None} for c in cells], {"b": 10})
    assert untimed["timed_seconds"] == 0 and " h" not in re_.estimate_text(untimed)
    timed = re_.full_scale_estimate(cells[:2], {"b": 3600})
    assert timed["seconds"] == 2 * 2.0 * 3600 and re_.estimate_text(timed) == "4.0 h"
    table = re_.markdown([{"model": "m", "bench": "b", "condition": c, "per_episode_s": 1.5, "rehearsals": 0,
                           "success": {"mean": 0.5, "ci95": [0.0, 1.0], "n": 2},
                           "diff_vs_none": {"mean": 0.0, "ci95": [0.0, 0.0], "n": 2}} for c in ("none", "parallel:2")])
    assert "| m | b | none | 2 | 0.500 [0.000, 1.000] | — | 0 | 1.5 |" in table
    assert "| +0.000 [+0.000, +0.000] |" in table
    earlier = re_.markdown([{"model": "m", "bench": "b", "condition": "none", "per_episode_s": 2.25,
                             "timed": "earlier run", "rehearsals": 0, "success": {"mean": 0.5, "ci95": [0.0, 1.0], "n": 2}}])
    assert "| 2.2 (timed in an earlier run) |" in earlier or "| 2.3 (timed in an earlier run) |" in earlier


def test_tiny_model_run_end_to_end_then_resume(tiny_model_dir, tmp_path, capsys):
    over = json.dumps({"model": {"compute_dtype": "float32"}, "rollout": {"max_new_tokens_act": 4},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})
    md = tmp_path / "RESULTS.md"
    md.write_text("# Measured results\n")
    argv = ["--models", f"tiny={tiny_model_dir}", "--conditions", "none,parallel:2", "--benches",
            "tau2:airline,bfcl:multi_turn_base", "--limit", "1", "--max-steps", "4", "--profile", "test",
            "--overrides", over, "--out", str(tmp_path / "out"), "--results-md", str(md), "--n-boot", "200"]
    assert re_.main(argv) == 0
    rep = json.loads((tmp_path / "out" / "rehearsal_effect.json").read_text())
    cells = {(c["bench"], c["condition"]): c for c in rep["cells"]}
    assert set(cells) == {(b, c) for b in ("tau2:airline", "bfcl:multi_turn_base") for c in ("none", "parallel:2")}
    for (bench, cond), c in cells.items():
        assert c["success"]["n"] == 1 and c["ran"] == 1 and c["per_episode_s"] > 0
        # rehearsal ran exactly where asked (on tau2 only if the agent got a turn: the tiny user may stop first)
        assert (c["rehearsals"] > 0) == (cond != "none") or (bench.startswith("tau2") and c["rehearsals"] == 0)
        assert c["diff_vs_none"]["mean"] == c["success"]["mean"] - cells[(bench, "none")]["success"]["mean"]
    assert rep["user_simulator"].startswith("the evaluated policy itself")
    assert rep["estimate_full_scale"]["items"]["bfcl:multi_turn_base"] == 200 and rep["estimate_full_scale"]["seconds"] > 0
    text = md.read_text()
    assert text.startswith("# Measured results\n") and "## Private Rehearsal effect, " in text
    assert "user simulator: the evaluated policy itself" in text and "| tiny | bfcl:multi_turn_base | parallel:2 | 1 |" in text
    printed = capsys.readouterr().out
    assert "full-scale estimate" in printed and "| model | bench |" in printed

    argv[argv.index(str(md))] = str(tmp_path / "other.md")
    assert re_.main(argv + ["--no-append"]) == 0  # everything from run_eval's cache
    again = json.loads((tmp_path / "out" / "rehearsal_effect.json").read_text())
    assert all(c["ran"] == 0 and c["cached"] == 1 and c["timed"] == "earlier run" for c in again["cells"])
    assert [c["per_episode_s"] for c in again["cells"]] == [c["per_episode_s"] for c in rep["cells"]]
    assert again["estimate_full_scale"]["seconds"] == pytest.approx(rep["estimate_full_scale"]["seconds"])
    assert [c["items"] for c in again["cells"]] == [c["items"] for c in rep["cells"]]
    printed = capsys.readouterr().out
    assert "(timed in an earlier run)" in printed and "cached |" not in printed and "0.0 h" not in printed
    assert not (tmp_path / "other.md").exists()

    (tmp_path / "out" / "rehearsal_effect.json").unlink()  # the timings are gone: say so, no "0.0 h"
    assert re_.main(argv + ["--no-append"]) == 0
    third = json.loads((tmp_path / "out" / "rehearsal_effect.json").read_text())
    assert all(c["per_episode_s"] is None for c in third["cells"]) and third["estimate_full_scale"]["hours"] is None
    printed = capsys.readouterr().out
    assert "never timed" in printed and "tiny/bfcl:multi_turn_base/none" in printed and "0.0 h" not in printed


@pytest.fixture
def adapter_dir(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    from envace_core.models import load_model

    model = get_peft_model(load_model(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_trained_ref_can_be_a_local_lora_adapter_folder(adapter_dir, tiny_model_dir, tmp_path):
    from envace_core.config import load_config
    from envace_core.evaluation.options import EvalOptions, fingerprint
    from envace_core.models import resolve_model_ref
    from envace_core.training.policy import load_engine

    m = resolve_model_ref(str(adapter_dir), str(tmp_path / "reg"), base_ref=str(tiny_model_dir))
    assert m.adapter_dir == str(adapter_dir.resolve()) and m.base_ref == str(tiny_model_dir)
    assert "LoRA adapter over" in m.label
    assert resolve_model_ref(str(tiny_model_dir), str(tmp_path)).adapter_dir is None  # a full model stays one
    cfg = load_config("test", {"model": {"compute_dtype": "float32", "ref": str(tiny_model_dir)}})
    engine, n = load_engine(cfg, m)
    _, n_base = load_engine(cfg, resolve_model_ref(str(tiny_model_dir), str(tmp_path)))
    assert n > n_base and type(engine.model).__name__.startswith("Peft")
    opts = EvalOptions(model=str(adapter_dir), benches="bfcl:multi_turn_base", out=str(tmp_path))
    fp = fingerprint(opts, cfg, m)
    weights = next(adapter_dir.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1]))
    assert fingerprint(opts, cfg, m) != fp  # new adapter weights at the same path: a new cache
