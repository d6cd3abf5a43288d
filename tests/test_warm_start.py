"""The warm_start stage (envace_core/stages/warm_start.py): trained once per warm-start id and reused
from the artifact store, never taken from a killed write, and the starting point of training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
import envace_core.training.sft as sft_mod
from envace_core.config import load_config
from envace_core.stages.curate import curate
from envace_core.stages.warm_start import (
    WARM_START_KEY,
    warm_start,
    warm_start_id,
    warm_start_settings,
)


def _cfg(model_dir, root: Path, train: dict | None = None, **sections):
    return load_config("test", {
        "model": {"ref": str(model_dir), "compute_dtype": "float32"},
        "data": {"max_train_tasks_per_domain": 2},  # tau2 airline train: the first has no gold, the second 2 calls
        "train": {"sft_warmup_steps": 1, "sft_batch_rows": 1, "sft_max_rehearse_examples": 2, **(train or {})},
        "store": {"root": str(root / "store"), "registry": str(root / "registry")}, **sections})


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    cfg = _cfg(tiny_model_dir, root)
    return root, cfg, curate(cfg)


@pytest.fixture
def sft_steps(monkeypatch):
    """The step counts of every `sft.sft_warmup` call made during the test."""
    calls: list[int] = []
    real = sft_mod.sft_warmup
    monkeypatch.setattr(sft_mod, "sft_warmup", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    return calls


def test_warm_start_trains_once_and_a_rerun_reuses_the_stored_adapter(setup, tiny_model_dir, sft_steps):
    root, cfg, ds = setup
    first = warm_start(cfg, ds, say=lambda _: None)
    assert sft_steps == [1]  # both roles together: one shared policy, one warm-up
    adapter = Path(first["adapter_uri"])
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert first["examples"]["act"] > 0 and first["examples"]["rehearse"] == 2
    assert len(first["losses"]["policy"]) == 1 and first["key"] == WARM_START_KEY.format(
        warm_start_id=first["warm_start_id"])
    again = warm_start(cfg, ds, say=lambda _: None)
    assert sft_steps == [1] and again == first  # reused from the store: no SFT step, the same record

    # what decides the weights changes the id; what only shapes GRPO does not (conditions share it)
    sha = first["base_model"]["sha256"]
    assert warm_start_id(cfg, ds, sha) == first["warm_start_id"]
    for other in (_cfg(tiny_model_dir, root, {"sft_learning_rate": 5e-4}),
                  _cfg(tiny_model_dir, root, {"sft_roles": ["act"]}),
                  _cfg(tiny_model_dir, root, {"seed": 1}),
                  _cfg(tiny_model_dir, root, {"sft_act_repeats": 2}),
                  _cfg(tiny_model_dir, root, {"sft_act_recovery": True}),
                  _cfg(tiny_model_dir, root, {"sft_act_memory": True}),
                  _cfg(tiny_model_dir, root, {"sft_answer_repeats": 3})):
        assert warm_start_id(other, ds, sha) != first["warm_start_id"]
    # sft_act_repeats at its default leaves the id as it was before the setting existed; where it
    # changes nothing (one role, per-role adapters) it is left out of the id too, with a warning
    assert not {"train.sft_act_repeats", "train.sft_act_recovery", "train.sft_answer_repeats", "train.sft_act_memory",
                "rehearsal.memory_content"} & set(first["settings"])
    # with ACT memory examples the memory's rendering decides the prompts, so it decides the id too
    mem = _cfg(tiny_model_dir, root, {"sft_act_memory": True})
    assert warm_start_id(mem, ds, sha) != warm_start_id(mem.model_copy(update={"rehearsal": mem.rehearsal.model_copy(
        update={"memory_content": "calls"})}), ds, sha)
    # so do the rehearsal kinds its memories are drawn from, and only where they differ from all three
    wrong = _cfg(tiny_model_dir, root, {"sft_act_memory": True, "sft_act_memory_kinds": ["wrong_call"]})
    assert warm_start_settings(wrong, ds)["train.sft_act_memory_kinds"] == ["wrong_call"]
    assert warm_start_id(wrong, ds, sha) != warm_start_id(mem, ds, sha)
    every = _cfg(tiny_model_dir, root, {"sft_act_memory": True,
                                        "sft_act_memory_kinds": ["wrong_call", "faithful", "imagined_error"]})
    assert warm_start_id(every, ds, sha) == warm_start_id(mem, ds, sha)
    from envace_core.config_checks import UnusedSettingWarning
    for extra in ({"sft_roles": ["act"]}, {"policy_per_role": True}):
        with pytest.warns(UnusedSettingWarning, match="sft_act_repeats=2 has no effect"):
            unused = _cfg(tiny_model_dir, root, {**extra, "sft_act_repeats": 2})
        assert warm_start_id(unused, ds, sha) == warm_start_id(_cfg(tiny_model_dir, root, extra), ds, sha)
    assert warm_start_id(cfg, ds, "another base model") != first["warm_start_id"]
    grpo_only = _cfg(tiny_model_dir, root, {"iterations": 3, "shared_baseline": True},
                     rollout={"source": "real"}, reward={"fidelity_lambda": 0.5})
    assert warm_start_id(grpo_only, ds, sha) == first["warm_start_id"]


def test_training_starts_from_the_warm_start_weights(setup, tiny_model_dir, monkeypatch):
    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    import envace_core.stages.train as train_stage
    from envace_core import EnvaceError
    from envace_core.training.loop import training_run_id

    root, cfg, ds = setup
    warm = warm_start(cfg, ds, say=lambda _: None)
    seen: dict = {}
    real = train_stage.train_iteration

    def spy(run, state):
        if state.iteration == 0:
            seen.update({k: v.detach().clone() for k, v in get_peft_model_state_dict(run.trainer.model).items()})
        return real(run, state)

    monkeypatch.setattr(train_stage, "train_iteration", spy)
    out = train_stage.rollout_and_train(cfg, ds, warm)
    saved = load_file(str(Path(warm["adapter_uri"]) / "adapter_model.safetensors"))
    assert seen.keys() == saved.keys() and all(torch.equal(seen[k], saved[k]) for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # SFT moved it off the fresh 0
    assert out["run_id"] == training_run_id(cfg, ds, warm) != training_run_id(cfg, ds)
    assert out["warm_start"]["warm_start_id"] == warm["warm_start_id"]
    assert out["warm_start"]["examples"] == warm["examples"]
    other = _cfg(tiny_model_dir, root, {"sft_learning_rate": 5e-4})
    with pytest.raises(EnvaceError, match="train.sft_learning_rate"):  # another config's warm start
        train_stage.rollout_and_train(other, ds, warm)


def test_a_store_copied_elsewhere_reuses_its_own_adapter(setup, tiny_model_dir, sft_steps, tmp_path):
    """A warm start recorded in a store that was then copied to another path (and the original removed) is
    reused from the copy: its adapter_uri names the copy's adapter, not the path it was written at."""
    import shutil

    root, cfg, ds = setup
    first = warm_start(cfg, ds, say=lambda _: None)
    trained = len(sft_steps)
    shutil.copytree(root / "store", tmp_path / "store", symlinks=True)
    moved = _cfg(tiny_model_dir, tmp_path)
    again = warm_start(moved, ds, say=lambda _: None)
    assert len(sft_steps) == trained and again["warm_start_id"] == first["warm_start_id"]  # reused, not retrained
    adapter = Path(again["adapter_uri"])
    assert adapter.resolve().is_relative_to((tmp_path / "store").resolve())
    assert (adapter / "adapter_model.safetensors").read_bytes() == \
        (Path(first["adapter_uri"]) / "adapter_model.safetensors").read_bytes()


def test_a_killed_warm_start_write_is_not_reused(setup, tiny_model_dir, sft_steps):
    from envace_core.models import base_model_lineage

    root, _, ds = setup
    cfg = _cfg(tiny_model_dir, root, {"seed": 7})  # its own id
    warm_id = warm_start_id(cfg, ds, base_model_lineage(cfg.model.ref)["sha256"])
    key_dir = root / "store" / WARM_START_KEY.format(warm_start_id=warm_id)
    # a kill during put_dir's copy leaves a hidden version folder without CHECKSUMS.json ...
    leftover = key_dir.parent / f".{key_dir.name}.v-0000dead"
    (leftover / "adapter").mkdir(parents=True)
    (leftover / "adapter" / "adapter_config.json").write_text("{")
    # ... and a writer that is not atomic leaves the key itself half-written, meta first
    (key_dir / "adapter").mkdir(parents=True)
    (key_dir / "warm_start.json").write_text(json.dumps({"warm_start_id": warm_id, "adapter_uri": "x"}))
    said: list[str] = []
    got = warm_start(cfg, ds, say=said.append)
    assert sft_steps == [1] and got["warm_start_id"] == warm_id  # trained, not taken from the leftovers
    assert any("holds a write that never finished (no CHECKSUMS.json): training the warm start again" in line
               for line in said)
    assert not leftover.exists() and key_dir.is_symlink()  # cleaned up; the key is now a committed version
    assert json.loads((Path(got["adapter_uri"]) / "adapter_config.json").read_text())["r"] == cfg.train.lora_r
    assert warm_start(cfg, ds, say=lambda _: None) == got and sft_steps == [1]  # now complete: reused


def test_warm_start_in_an_s3_store_is_reused_and_trained_from_on_a_fresh_machine(s3_server, tiny_model_dir,
                                                                                tmp_path, monkeypatch, sft_steps):
    """The cluster's layout: dataset, warm start and checkpoints in S3; the next pod has no local copy."""
    import shutil

    from envace_core.stages.train import rollout_and_train

    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tiny_model_dir, tmp_path, store={"root": f"{s3_server.root}/envace",
                                                "registry": str(tmp_path / "registry")})
    ds = curate(cfg)
    warm = warm_start(cfg, ds, say=lambda _: None)
    assert warm["adapter_uri"] == f"{s3_server.root}/envace/{warm['key']}/adapter" and sft_steps == [1]
    shutil.rmtree(tmp_path / "cache")  # another pod: nothing local
    assert warm_start(cfg, ds, say=lambda _: None) == warm and sft_steps == [1]
    out = rollout_and_train(cfg, ds, warm)
    assert out["warm_start"]["adapter_uri"] == warm["adapter_uri"] and len(out["history"]) == 1


def test_the_stage_warms_rehearse_on_the_real_errors_of_wrong_calls(setup, tiny_model_dir, monkeypatch):
    """With train.sft_error_transitions the REHEARSE examples the stage builds (`train_warm_start`:
    real_train_transitions -> warm_examples) hold the wrong calls and their real error results as
    targets; without it, none. `warm_up` is replaced: only the examples are looked at."""
    import envace_core.stages.warm_start as stage
    from envace_core.stages.dataset import load_dataset
    from envace_core.training.loop import real_train_transitions

    root, _, ds = setup
    built: dict[bool, dict] = {}
    monkeypatch.setattr(stage, "warm_up", lambda cfg, trainer, by_role, say=print:
                        built.setdefault(cfg.train.sft_error_transitions, by_role) and {})

    def key(task_id, call):
        return task_id, call.name, json.dumps(call.arguments, sort_keys=True)

    cfgs = {errors: _cfg(tiny_model_dir, root, {"sft_max_rehearse_examples": None, "sft_error_transitions": errors},
                         rollout={"max_new_tokens_rehearse": 256})  # targets whole, not the cut marker alone
            for errors in (True, False)}
    for cfg in cfgs.values():
        stage.train_warm_start(cfg, ds, say=lambda _: None)
    wrong = {key(t.task_id, t.call): t for t in real_train_transitions(cfgs[True], load_dataset(ds, "train"))
             if t.probe}
    assert wrong and all(t.kind == "error" for t in wrong.values())
    rehearse = built[True]["rehearse"]
    errs = [e for e in rehearse if key(e.task_id, e.gold) in wrong]
    assert {key(e.task_id, e.gold) for e in errs} == set(wrong)  # every wrong call is taught
    for e in errs:
        real = wrong[key(e.task_id, e.gold)].observation
        assert e.role == "rehearse" and e.text == real.content and json.loads(e.text).get("error")
    assert len(rehearse) > len(errs)  # the gold calls' results are there as well
    plain = built[False]["rehearse"]
    assert plain and not [e for e in plain if key(e.task_id, e.gold) in wrong]
    assert len(plain) == len(rehearse) - len(errs)


def test_a_final_act_phase_starts_from_the_stored_mixed_warm_start(setup, tiny_model_dir, sft_steps):
    """train.sft_act_final_steps = n: the mixed warm start is stored under its own id (the same config
    with n = 0) and reused by any n; the n ACT-only steps start from its adapter and change it."""
    from safetensors.torch import load_file

    from envace_core.config_checks import UnusedSettingWarning
    from envace_core.stages.warm_start import mixed_phase_config

    root, _, ds = setup
    two = _cfg(tiny_model_dir, root, {"seed": 3, "sft_act_final_steps": 1})
    got = warm_start(two, ds, say=lambda _: None)
    mixed = got["mixed_warm_start"]
    sha = got["base_model"]["sha256"]
    assert sft_steps == [1, 1] and got["steps"] == 2  # the mixed phase, then the ACT-only one
    assert mixed["warm_start_id"] == warm_start_id(mixed_phase_config(two), ds, sha) != got["warm_start_id"]
    assert got["settings"]["train.sft_act_final_steps"] == 1 and len(got["losses"]["act_final"]) == 1
    assert got["examples"]["act"] > 0 and got["examples"]["rehearse"] == 2
    before = load_file(str(Path(mixed["adapter_uri"]) / "adapter_model.safetensors"))
    after = load_file(str(Path(got["adapter_uri"]) / "adapter_model.safetensors"))
    assert before.keys() == after.keys() and any(not (before[k] == after[k]).all() for k in before)
    assert warm_start(two, ds, say=lambda _: None) == got and sft_steps == [1, 1]  # reused, both phases
    more = warm_start(_cfg(tiny_model_dir, root, {"seed": 3, "sft_act_final_steps": 2}), ds, say=lambda _: None)
    assert sft_steps == [1, 1, 2] and more["mixed_warm_start"]["warm_start_id"] == mixed["warm_start_id"]
    # with one role or per-role adapters it changes nothing: a warning, and the id of the config without it
    for extra in ({"sft_roles": ["act"]}, {"policy_per_role": True}):
        with pytest.warns(UnusedSettingWarning, match="sft_act_final_steps=4 has no effect"):
            unused = _cfg(tiny_model_dir, root, {**extra, "sft_act_final_steps": 4})
        assert warm_start_id(unused, ds, sha) == warm_start_id(_cfg(tiny_model_dir, root, extra), ds, sha)
    with pytest.warns(UnusedSettingWarning, match="sft_act_recovery=true has no effect"):
        _cfg(tiny_model_dir, root, {"sft_roles": ["rehearse"], "sft_act_recovery": True})
    with pytest.warns(UnusedSettingWarning, match="sft_act_memory=true has no effect"):
        _cfg(tiny_model_dir, root, {"sft_roles": ["rehearse"], "sft_act_memory": True})
    with pytest.warns(UnusedSettingWarning, match="sft_answer_repeats=2 has no effect"):
        unused = _cfg(tiny_model_dir, root, {"sft_roles": ["rehearse"], "sft_answer_repeats": 2})
    assert warm_start_id(unused, ds, sha) == warm_start_id(_cfg(tiny_model_dir, root, {"sft_roles": ["rehearse"]}), ds, sha)


def test_the_warm_start_command_prints_the_adapter_alone_and_reuses_it(tiny_model_dir, tmp_path, sft_steps,
                                                                       capsys):
    """`envace warm-start`: progress on stderr, the adapter URI alone on stdout (what a shell passes on to
    train.init_adapter), a second call reuses the stored warm start, --json prints its record."""
    from envace_core.cli import main

    overrides = json.dumps({
        "model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
        "data": {"max_train_tasks_per_domain": 2},
        "train": {"sft_warmup_steps": 1, "sft_batch_rows": 1, "sft_max_rehearse_examples": 2},
        "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})
    assert main(["--profile", "test", "--overrides", overrides, "warm-start"]) == 0
    out, err = capsys.readouterr()
    assert sft_steps == [1] and "[warm_start]" in err
    adapter = Path(out.strip())
    assert out.count("\n") == 1 and (adapter / "adapter_config.json").is_file()
    assert main(["--profile", "test", "--overrides", overrides, "warm-start", "--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert sft_steps == [1] and "reusing" in err and Path(record["adapter_uri"]) == adapter
    assert record["warm_start_id"] in str(adapter)

    assert main(["--profile", "test", "--overrides", overrides.replace('"sft_warmup_steps": 1',
                                                                     '"sft_warmup_steps": 0'), "warm-start"]) == 2
    assert "no warm start to make" in capsys.readouterr().err
    # a bad train.init_adapter fails in the preflight, before curate writes a dataset or a model loads
    empty = tmp_path / "empty_adapter"
    empty.mkdir()
    bad = json.loads(overrides)
    bad["train"]["init_adapter"] = str(empty)
    bad["store"]["root"] = str(tmp_path / "store2")
    assert main(["--profile", "test", "--overrides", json.dumps(bad), "warm-start"]) == 2
    assert "holds no LoRA adapter" in capsys.readouterr().err and not (tmp_path / "store2" / "datasets").exists()
    # a store that cannot be made names the setting to fix
    (tmp_path / "a_file").write_text("")
    bad = json.loads(overrides)
    bad["store"]["root"] = str(tmp_path / "a_file" / "store")
    assert main(["--profile", "test", "--overrides", json.dumps(bad), "warm-start"]) == 2
    assert "store.root=" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["adapter_cut", "checksums_not_json", "record_edited"])
def test_a_damaged_stored_warm_start_is_refused_not_retrained_over(setup, tiny_model_dir, sft_steps, damage):
    """A committed warm start whose files changed afterwards stops the stage with an error naming them; nothing
    is trained and nothing in the store changes (a killed, never-committed write is replaced: the test above)."""
    from envace_core.store.base import StoreError
    from envace_core.store.files import dir_checksums

    root, _, ds = setup
    seed = 11 + ["adapter_cut", "checksums_not_json", "record_edited"].index(damage)
    cfg = _cfg(tiny_model_dir, root, {"seed": seed})  # its own id per case
    first = warm_start(cfg, ds, say=lambda _: None)
    d = Path(first["adapter_uri"]).parent
    target = {"adapter_cut": d / "adapter" / "adapter_model.safetensors", "checksums_not_json": d / "CHECKSUMS.json",
              "record_edited": d / "warm_start.json"}[damage]
    data = target.read_bytes()
    target.write_bytes({"adapter_cut": data[:100], "checksums_not_json": b"{bad",
                        "record_edited": data.replace(b'"steps": 1', b'"steps": 9')}[damage])
    before = dir_checksums(d)
    with pytest.raises(StoreError, match=rf"was changed after it was written \(files that differ from its "
                                         rf"CHECKSUMS.json: [^)]*{target.name}\); .*move .* aside"):
        warm_start(cfg, ds, say=lambda _: None)
    assert sft_steps == [1] and dir_checksums(d) == before  # not retrained, nothing rewritten
