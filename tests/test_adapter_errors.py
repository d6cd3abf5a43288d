"""Broken LoRA adapter folders and odd `--model` paths give one clear `EnvaceError` line (not peft /
safetensors / huggingface_hub tracebacks); malformed eval cache lines are skipped and recomputed; the eval
report says where no rehearsal ran and shows truncated turns and rehearsals per BFCL category."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from envace_core.cli import main
from envace_core.models import (
    AdapterError,
    ModelRefError,
    check_adapter_dir,
    resolve_model_ref,
)


@pytest.fixture(scope="module")
def good_adapter(tiny_model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from envace_core.models import load_model

    d = tmp_path_factory.mktemp("adapters") / "good"
    get_peft_model(load_model(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(d)
    return d


@pytest.fixture
def adapter(good_adapter, tmp_path):
    d = tmp_path / "adapter"
    shutil.copytree(good_adapter, d)
    return d


def _over(tiny_model_dir, tmp_path) -> str:
    return json.dumps({"model": {"compute_dtype": "float32", "ref": str(tiny_model_dir)},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})


def _wrong_shape(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    w = d / "adapter_model.safetensors"
    sd = load_file(str(w))
    k = next(k for k in sd if "lora_A" in k)
    sd[k] = sd[k].new_zeros(sd[k].shape[0], sd[k].shape[1] + 3)  # in_features the base does not have
    save_file(sd, str(w))


BREAKAGES = {
    "not_json": (lambda d: (d / "adapter_config.json").write_text("{not json"), "is not JSON"),
    "a_list": (lambda d: (d / "adapter_config.json").write_text("[1, 2]"), "is not a JSON object"),
    "random_weights": (lambda d: (d / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4), "unreadable"),
    "no_weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "weights missing"),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_damaged_adapter_is_named_before_any_model_loads(name, adapter, tiny_model_dir, tmp_path, capsys,
                                                         monkeypatch):
    from envace_core import models

    breaks, phrase = BREAKAGES[name]
    breaks(adapter)
    with pytest.raises(AdapterError, match=phrase) as e:
        resolve_model_ref(str(adapter), str(tmp_path / "reg"), base_ref=str(tiny_model_dir))
    assert str(adapter) in str(e.value)
    monkeypatch.setattr(models, "load_model", lambda *a: pytest.fail("loaded a model for a broken adapter"))
    argv = ["--profile", "test", "--overrides", _over(tiny_model_dir, tmp_path), "eval", "--model", str(adapter),
            "--bench", "bfcl:simple", "--limit", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("envace: error: ") and phrase in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and "Repo id" not in err


def test_adapter_of_another_shape_names_the_base(adapter, tiny_model_dir, tmp_path, capsys):
    from envace_core.config import load_config
    from envace_core.training.policy import load_policy

    _wrong_shape(adapter)
    check_adapter_dir(adapter)  # readable: the mismatch only shows against the base
    cfg = load_config("test", {"model": {"compute_dtype": "float32", "ref": str(tiny_model_dir)}})
    with pytest.raises(AdapterError, match="do not fit the base model") as e:
        load_policy(cfg, str(adapter))
    assert str(adapter) in str(e.value) and str(tiny_model_dir) in str(e.value)
    argv = ["--profile", "test", "--overrides", _over(tiny_model_dir, tmp_path), "eval", "--model", str(adapter),
            "--bench", "bfcl:simple", "--limit", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' weight-loading bar
    assert last.startswith("envace: error: LoRA adapter") and "do not fit the base model" in last
    assert "size mismatch for" in last and "lora_A" in last


def test_rehearse_adapter_folder_missing_or_without_config(tmp_path, tiny_model_dir, capsys):
    over = _over(tiny_model_dir, tmp_path)
    for folder, phrase in ((tmp_path / "does_not_exist", "does not exist"), (tmp_path, "has no adapter_config.json")):
        assert main(["--profile", "test", "--overrides", over, "rehearse", "--task", "airline/3",
                     "--adapter", str(folder)]) == 2
        err = capsys.readouterr().err
        assert phrase in err and str(folder) in err and "re-run the train stage" not in err
        assert len(err.strip().splitlines()) == 1


def test_model_path_neither_model_nor_adapter(tmp_path, good_adapter):
    with pytest.raises(ModelRefError, match="no such file or folder.*LoRA adapter folder"):
        resolve_model_ref(str(tmp_path / "nope"), str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelRefError, match="neither a model folder .* nor a LoRA adapter folder"):
        resolve_model_ref(str(tmp_path / "empty"), str(tmp_path))
    shutil.copytree(good_adapter, tmp_path / "per_role" / "act")
    with pytest.raises(AdapterError, match="has act/ but rehearse/ .* is missing"):
        resolve_model_ref(str(tmp_path / "per_role"), str(tmp_path))
    with pytest.raises(AdapterError, match="rehearse/ .* is missing"):
        check_adapter_dir(tmp_path / "per_role")
    shutil.copytree(good_adapter, tmp_path / "per_role" / "rehearse")
    assert check_adapter_dir(tmp_path / "per_role") == [tmp_path / "per_role" / r for r in ("act", "rehearse")]


# ------------------------------------------------------------------------------------------ caches
def test_bfcl_multi_turn_cache_skips_wrong_shapes_and_recomputes(tmp_path, monkeypatch):
    import envace_core.evaluation.bfcl_run as bfcl_run_mod
    from envace_core.config import load_config
    from envace_core.evaluation.bfcl_results import (
        EntryResult,
    )
    from envace_core.evaluation.harness import _bfcl_multi_turn, _Ctx
    from envace_core.evaluation.options import EvalOptions

    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / "bfcl_multi_turn_base.jsonl"
    good = EntryResult(id="multi_turn_base_1", valid=True, outcome="correct")
    path.write_text(json.dumps({"id": "multi_turn_base_0", "outcome": 7}) + "\n" + good.model_dump_json() + "\n"
                    + '[1, 2]\n{"id": "multi_turn_base_2", "val')  # wrong shapes, then a half-written line
    ran: list[str] = []

    def fake_run(engine, todo, params, batch_size, rehearsal, on_entry):
        for e in todo:
            ran.append(e.id)
            on_entry(EntryResult(id=e.id, valid=False, outcome="wrong"))

    monkeypatch.setattr(bfcl_run_mod, 'run_multi_turn', fake_run)
    monkeypatch.setattr(bfcl_run_mod, 'sampling_params', lambda *a: None)
    opts = EvalOptions(model="m", benches="bfcl:multi_turn_base", out=str(tmp_path), limit=3)
    ctx = _Ctx(opts, load_config("test"), "none", 0, None, None, None, None, cache)
    with pytest.warns(RuntimeWarning, match=str(path)) as w:
        res = _bfcl_multi_turn(ctx, "multi_turn_base")
    assert len([x for x in w if issubclass(x.category, RuntimeWarning)]) == 1
    assert ran == ["multi_turn_base_0", "multi_turn_base_2"]  # the good line is kept, the rest redone
    assert [e.id for e in res.entries] == ["multi_turn_base_0", "multi_turn_base_1", "multi_turn_base_2"]
    assert res.correct == 1 and ctx.work["bfcl:multi_turn_base"] == {"ran": 2, "cached": 1}


def test_tau2_cache_skips_wrong_shapes(tmp_path):
    from envace_core.evaluation.tau2 import _load_cache

    good = {"domain": "airline", "task_id": "1", "trial": 0, "reward": 1.0, "reward_breakdown": {"DB": 1.0},
            "termination_reason": "user_stop", "agent_stats": {}}
    bad = [{"domain": "airline", "task_id": "2", "trial": "zero", "reward": 1.0, "reward_breakdown": {},
            "termination_reason": "x"},
           {**good, "task_id": "3", "reward": "high"}, {**good, "task_id": "4", "reward_breakdown": [1]},
           {"task_id": "5"}, 7]
    path = tmp_path / "tau2_airline.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [good, *bad]) + '\n{"domain": "airl')
    with pytest.warns(RuntimeWarning, match=f"{path}: skipped 6 malformed"):
        got = _load_cache(path)
    assert got == {("airline", "1", 0): good}


# ------------------------------------------------------------------------------------------ report
def _results(mode: str) -> dict:
    def cat(name, entries, truncated):
        return {"category": name, "n": len(entries), "accuracy": 0.5, "correct": 1, "wrong": 1, "no_call": 0,
                "decode_errors": 0, "truncated": truncated, "decode_reasons": {}, "entries": entries}

    mt = [{"id": "multi_turn_base_0", "valid": True, "rehearsal": {"rehearsals": 4}},
          {"id": "multi_turn_base_1", "valid": False, "rehearsal": {"rehearsals": 2}}]
    st = [{"id": "simple_0", "valid": True, "rehearsal": None}, {"id": "simple_1", "valid": False}]
    report = {"categories": {"simple_python": cat("simple_python", st, 0),
                             "multi_turn_base": cat("multi_turn_base", mt, 3)},
              "overall": 0.1, "overall_evaluated": 0.5, "groups": {}, "groups_evaluated": {},
              "weighting": "bfcl", "complete": False}
    return {"model": {"label": "m", "n_params": 1000, "registry_version": None},
            "settings": {"rehearsal": {"mode": mode, "n": 2, "applies_to": "x"}, "trials": 1, "split": "test",
                         "limit": 2, "max_steps": 4, "seed": 0},
            "user_simulator": "u", "work": {}, "seconds": {"total": 1.0, "load": 0.5},
            "benches": [{"bench": "bfcl", "name": "bfcl", "report": report}]}


def test_report_says_where_no_rehearsal_ran_and_shows_truncation_and_rehearsals():
    from envace_core.evaluation.report import markdown

    md = markdown(_results("parallel"), [])
    assert "- no rehearsal ran for bfcl:simple_python in this run" in md
    assert "multi_turn_base in this run" not in md
    assert "| truncated turns | rehearsals |" in md
    assert "| multi_turn_base | 2 | 0.500 | 1 | 1 | 0 | 0 | 3 | 6 |" in md
    assert "| simple_python | 2 | 0.500 | 1 | 1 | 0 | 0 | 0 | — |" in md
    assert "no rehearsal ran" not in markdown(_results("none"), [])


def test_bfcl_single_turn_cache_of_the_wrong_shape_is_recomputed(tmp_path, monkeypatch):
    import envace_core.evaluation.bfcl_run as bfcl_run_mod
    from envace_core.config import load_config
    from envace_core.evaluation.bfcl_results import (
        BfclReport,
        CategoryResult,
    )
    from envace_core.evaluation.harness import _Ctx, run_bfcl_benches
    from envace_core.evaluation.options import EvalOptions

    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / "bfcl_simple_python_limit-1.json"
    path.write_text(json.dumps({"category": "simple_python", "n": "one"}))
    calls = []

    def fake_eval(engine, cats, limit, **kw):
        calls.append(cats)
        return BfclReport(categories={"simple_python": CategoryResult(category="simple_python", n=1,
                                                                                correct=1, accuracy=1.0)})

    monkeypatch.setattr(bfcl_run_mod, 'evaluate_bfcl', fake_eval)
    opts = EvalOptions(model="m", benches="bfcl:simple", out=str(tmp_path), limit=1)
    ctx = _Ctx(opts, load_config("test"), "none", 0, None, None, None, None, cache)
    with pytest.warns(RuntimeWarning, match=str(path)):
        rep = run_bfcl_benches(ctx, ["simple_python"])
    assert calls == [["simple_python"]] and rep["report"]["categories"]["simple_python"]["accuracy"] == 1.0
    assert CategoryResult.model_validate_json(path.read_text()).n == 1  # the cache now holds a good one


# ------------------------------------------------------------------------- train.init_adapter preflight
def _truncate(d: Path) -> None:
    w = d / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])


def _set_config(d: Path, **fields) -> None:
    p = d / "adapter_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **fields}))


INIT_BREAKAGES = {  # breakage -> (file the error names, phrase)
    "truncated": (_truncate, "adapter_model.safetensors", "are truncated"),
    "header_only": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10\x00"), "adapter_model.safetensors",
                    "truncated or not safetensors"),
    "rank_is_text": (lambda d: _set_config(d, r="sixteen"), "adapter_config.json", "LoRA rank r is 'sixteen'"),
    "alpha_negative": (lambda d: _set_config(d, lora_alpha=-1), "adapter_config.json", "lora_alpha is -1"),
    "targets_garbage": (lambda d: _set_config(d, target_modules=7), "adapter_config.json", "target_modules is 7"),
    "peft_type_garbage": (lambda d: _set_config(d, peft_type=[1]), "adapter_config.json", "peft_type is [1]"),
    "binary_config": (lambda d: (d / "adapter_config.json").write_bytes(b"\xff\xfe\x00garbage"),
                      "adapter_config.json", "is not JSON"),
    "rank_mismatch": (lambda d: _set_config(d, r=4), "adapter_model.safetensors", "has rank 2"),
}


def _init_cfg(adapter, tmp_path, tiny_model_dir, **train):
    from envace_core.config import load_config

    return load_config("test", {"model": {"ref": str(tiny_model_dir)},
                                "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")},
                                "train": {"init_adapter": str(adapter), "lora_r": 2, "lora_alpha": 8,
                                          "lora_target_modules": ["q_proj", "v_proj"], **train}})


def test_preflight_accepts_a_good_init_adapter(adapter, tmp_path, tiny_model_dir):
    from envace_core.stages.preflight import preflight

    preflight(_init_cfg(adapter, tmp_path, tiny_model_dir))


@pytest.mark.parametrize("name", sorted(INIT_BREAKAGES))
def test_preflight_names_a_damaged_init_adapter_in_one_line(name, adapter, tmp_path, tiny_model_dir, capsys):
    from envace_core.stages.preflight import preflight

    breaks, file, phrase = INIT_BREAKAGES[name]
    breaks(adapter)
    with pytest.raises(AdapterError, match=re.escape(phrase)) as e:
        preflight(_init_cfg(adapter, tmp_path, tiny_model_dir))
    assert str(adapter / file) in str(e.value) and "train.init_adapter=" in str(e.value)
    assert "Use the parent's LoRA settings" not in str(e.value)  # the training-time hint does not apply
    over = json.dumps({"model": {"ref": str(tiny_model_dir)}, "store": {"root": str(tmp_path / "store"),
                       "registry": str(tmp_path / "registry")},
                       "train": {"init_adapter": str(adapter), "lora_r": 2, "lora_alpha": 8}})
    assert main(["--profile", "test", "--overrides", over, "config", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("envace: error: ") and phrase in err and len(err.strip().splitlines()) == 1


def test_preflight_checks_the_init_adapter_against_train_settings(adapter, good_adapter, tmp_path, tiny_model_dir):
    from envace_core.stages.preflight import preflight

    with pytest.raises(AdapterError, match=r"\(r, lora_alpha, target_modules\) = \(2, 8, .*lora_r.*\(4, 8"):
        preflight(_init_cfg(adapter, tmp_path, tiny_model_dir, lora_r=4))
    with pytest.raises(AdapterError, match="one shared adapter, but train.policy_per_role=true"):
        preflight(_init_cfg(adapter, tmp_path, tiny_model_dir, policy_per_role=True))
    per_role = tmp_path / "per_role"
    for r in ("act", "rehearse"):
        shutil.copytree(good_adapter, per_role / r)
    preflight(_init_cfg(per_role, tmp_path, tiny_model_dir, policy_per_role=True))
    with pytest.raises(AdapterError, match="per-role act/ and rehearse/ adapters, but train.policy_per_role=false"):
        preflight(_init_cfg(per_role, tmp_path, tiny_model_dir))
    _truncate(per_role / "rehearse")
    with pytest.raises(AdapterError, match="rehearse/adapter_model.safetensors are truncated"):
        preflight(_init_cfg(per_role, tmp_path, tiny_model_dir, policy_per_role=True))
