"""benchmarks/learning.py: curriculum split, CIs, token-budget chunking and the whole run, with the
tiny random model (the numbers mean nothing; the plumbing, budget and report shape are checked)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from tests.benchmark_loader import load_benchmark

lb = load_benchmark("learning", "learning_bench")


class _T:
    def __init__(self, i):
        self.id = f"airline/synth-L1-{i:04d}"


def test_split_is_deterministic_disjoint_and_rejects_empty_sides():
    tasks = [_T(i) for i in range(40)]
    train, held = lb.split_tasks(tasks, 3)
    assert train and held and not {t.id for t in train} & {t.id for t in held}
    assert len(train) + len(held) == 40
    assert [t.id for t in lb.split_tasks(tasks, 3)[1]] == [t.id for t in held]
    with pytest.raises(lb.BenchmarkError, match="held-out"):
        lb.split_tasks(tasks[:1], 10 ** 9 + 7)  # one task cannot fill both sides


def test_confidence_intervals():
    lo, hi = lb.t_interval([0.2, 0.4, 0.6])
    assert lo < 0.4 < hi and hi - lo == pytest.approx(2 * 4.302653 * 0.2 / 3 ** 0.5, rel=1e-4)
    blo, bhi = lb.bootstrap_ci([0.0] * 5 + [1.0] * 5)
    assert 0.0 < blo < 0.5 < bhi < 1.0
    assert lb.bootstrap_ci([1.0, 1.0]) == (1.0, 1.0)
    seeds = lb.summarise({0: {"m": [1.0, 0.0]}, 1: {"m": [1.0, 1.0]}}, "m")
    # items averaged over seeds ([1.0, 0.5]), bootstrap over the 2 items; t over the 2 seed means
    assert seeds["n"] == 2 and seeds["mean"] == 0.75 and seeds["seeds"] == 2
    assert seeds["ci"][0] >= 0.5 and seeds["ci"][1] <= 1.0 and seeds["seed_ci"][0] < 0.5 < 1.0 < seeds["seed_ci"][1]
    one = lb.summarise({0: {"m": [1.0, 0.0, 0.0, 1.0]}}, "m")
    assert one["method"].startswith("bootstrap over items") and one["n"] == 4 and one["seed_ci"] is None
    with pytest.raises(lb.BenchmarkError, match="different numbers of items"):
        lb.summarise({0: {"m": [1.0]}, 1: {"m": [1.0, 0.0]}}, "m")
    d = lb.paired_difference({0: {"m": [1.0, 1.0, 0.0]}}, {0: {"m": [0.0, 1.0, 0.0]}}, "m")
    assert d["n"] == 3 and d["mean"] == pytest.approx(1 / 3) and d["ci"][0] == 0.0 and d["ci"][1] == 1.0
    assert lb.paired_difference({0: {"m": []}}, {0: {"m": [1.0]}}, "m")["mean"] is None


def _preset() -> dict:
    return {"seeds": [0], "levels": [1], "tasks_per_level": 3, "heldout_mod": 2, "domains": ["airline"],
            "token_budget": 20, "max_iterations": 3, "eval_every": 0, "max_transitions": 2,
            "overrides": {"data": {"policy_max_chars": 200},
                          "rollout": {"group_size": 2, "tasks_per_iteration": 1, "max_turns": 1,
                                      "max_new_tokens_act": 8, "max_new_tokens_rehearse": 8},
                          "train": {"lr_scheduler": "constant", "micro_batch_rows": 8,
                                    "sft_warmup_steps": 1, "sft_batch_rows": 1, "sft_learning_rate": 1e-3,
                                    "sft_roles": ["act", "rehearse"], "sft_max_rehearse_examples": 2},
                          "eval": {"max_turns": 1}, "rehearsal": {"mode": "none"}}}


@pytest.fixture
def sft_units(monkeypatch):
    """The step count of every `sft.sft_warmup` call (one per warmed unit: policy or adapter)."""
    import envace_core.training.sft as sft_mod

    calls: list[int] = []
    real = sft_mod.sft_warmup
    monkeypatch.setattr(sft_mod, "sft_warmup", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    return calls


def _overrides(preset: dict, root: Path, model_dir) -> dict:
    """The overrides `lb.run` builds for `root` (store under root/store)."""
    return {**preset["overrides"], "data": {**preset["overrides"]["data"], "domains": preset["domains"]},
            "store": {"root": str(root / "store"), "registry": str(root / "registry")},
            "model": {"ref": str(model_dir)}}


def test_whole_run_with_tiny_model(tmp_path, tiny_model_dir, sft_units):
    from envace_core.training.loop import training_run_id

    preset = _preset()
    # one GRPO condition keeps this under a minute; the others differ only in config overrides
    results = tmp_path / "results" / "learning.json"
    report = lb.run(preset, tmp_path, ["sft", "world_rehearsal"], model_ref=str(tiny_model_dir), results_json=results)
    sft, wr = report["runs"]["sft"][0], report["runs"]["world_rehearsal"][0]
    warm = sft["warm_start"]
    # the warm_start stage ran once: both conditions share its id (they differ only in GRPO settings)
    assert sft_units == [1] and wr["warm_start"] == warm and list(report["warm_starts"]) == [warm["warm_start_id"]]
    assert warm["examples"]["act"] >= 1 and warm["examples"]["rehearse"] == 2 and len(warm["losses"]["policy"]) == 1
    assert sft["adapter_dir"] == warm["adapter_uri"] == str(
        tmp_path / "store" / "warm_starts" / warm["warm_start_id"] / "adapter")
    assert (Path(sft["adapter_dir"]) / "adapter_model.safetensors").is_file()
    # the trained run's id includes the warm start (training_run_id with warm), and it started from it
    cfg = lb.condition_config(_overrides(preset, tmp_path, tiny_model_dir), "world_rehearsal", 0)
    cfg.train.iterations = wr["iterations"]
    run_id = training_run_id(cfg, report["dataset"], warm)
    assert run_id != training_run_id(cfg, report["dataset"])
    assert (tmp_path / "store" / "runs" / run_id / "checkpoint" / "state.json").is_file()
    assert not set(report["held_out_ids"]) & set(report["train_ids"])
    for cond in ("world_rehearsal",):
        r = report["runs"][cond][0]
        toks = [lb.iteration_tokens(h) for h in r["history"]]
        # stops at the first iteration that reaches the budget (or the iteration cap)
        assert r["iterations"] == len(toks) <= 3 and r["overshoot_iterations"] == 0
        assert sum(toks) >= 20 or r["iterations"] == 3
        assert sum(toks[:-1]) < 20
    final = report["runs"]["world_rehearsal"][0]["final"]
    assert len(final["success"]) == report["dataset"]["n_test"] and len(final["fidelity"]) >= 1
    s = report["summary"]["world_rehearsal"]["success"]
    assert s["method"].startswith("bootstrap over items") and s["mean"] == statistics.fmean(final["success"])
    diff = report["summary"]["world_rehearsal"]["success_vs_sft"]
    assert diff["n"] == len(final["success"])
    assert json.loads((tmp_path / "learning.json").read_text())["summary"].keys() == report["summary"].keys()
    assert (tmp_path / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert "| world_rehearsal |" in lb.markdown(report)
    assert report["complete"] is True
    # the committed results file: conditions by the field's names, paired CIs, real-environment steps
    got = json.loads(results.read_text())
    assert set(got) == {"run", "warm_start", "world_rehearsal"} and got["run"]["complete"] is True
    w = got["world_rehearsal"]
    assert w["success"]["mean"] == s["mean"] and w["success"]["ci_low"] <= w["success"]["mean"] <= w["success"]["ci_high"]
    assert w["paired"]["vs_warm_start"]["mean"] == diff["mean"] and w["paired"]["vs_standard_grpo"]["mean"] is None
    assert w["seeds"] == [0] and w["n_tasks"] == report["dataset"]["n_test"]
    # imagined rollouts touch no environment; scoring replays ACT's calls in private copies
    assert w["real_env_steps"]["rollouts"] == 0 and w["real_env_steps"]["reward_replays"] is not None
    assert w["real_env_steps"]["reward_replays"] == sum(h["env_steps/reward"] for h in wr["history"])
    assert got["warm_start"]["real_env_steps"]["rollouts"] == 0 and got["warm_start"]["paired"]["vs_warm_start"] is None
    # re-running the same command resumes: finished (condition, seed) runs are kept, not recomputed
    lines: list[str] = []
    again = lb.run(preset, tmp_path, ["sft", "world_rehearsal"], log=lines.append, model_ref=str(tiny_model_dir))
    assert sum("kept from the previous report" in line for line in lines) == 2 and sft_units == [1]
    assert again["warm_starts"] == report["warm_starts"]
    assert again["summary"]["world_rehearsal"]["success"] == report["summary"]["world_rehearsal"]["success"]
    # fewer conditions into the same folder: the others' finished runs stay in the report
    part = lb.run(preset, tmp_path, ["sft"], log=lines.append, model_ref=str(tiny_model_dir))
    assert list(part["runs"]) == ["sft", "world_rehearsal"] and list(part["runs"]["world_rehearsal"]) == [0]
    assert json.loads((tmp_path / "learning.json").read_text())["runs"].keys() == {"sft", "world_rehearsal"}
    other = tmp_path / "other"
    other.mkdir()
    (other / "learning.json").write_text(json.dumps({"key": {"preset": "another"}, "runs": {}}))
    with pytest.raises(lb.BenchmarkError, match="--merge"):
        lb.run(preset, tmp_path, ["sft"], log=lines.append, model_ref=str(tiny_model_dir), merge=[other])


def test_per_role_warm_start_warms_each_adapter_on_its_own_role(tmp_path, tiny_model_dir, sft_units):
    from safetensors.torch import load_file

    from envace_core.stages.warm_start import warm_start, warm_start_id

    preset = _preset()
    train, held = lb.curriculum(preset["domains"], preset["levels"], preset["tasks_per_level"], 0,
                                preset["heldout_mod"])
    ds = lb.write_dataset(str(tmp_path / "store"), train, held, preset["domains"])
    over = _overrides(preset, tmp_path, tiny_model_dir)
    per_role = lb.condition_config(over, "per_role", 0)
    assert per_role.train.policy_per_role and per_role.train.sft_roles == ["act", "rehearse"]
    warm = warm_start(per_role, ds, say=lambda _: None)
    assert sft_units == [1, 1] and set(warm["losses"]) == {"act", "rehearse"}  # one warm-up per adapter
    assert warm["examples"]["act"] >= 1 and warm["examples"]["rehearse"] == 2
    act, reh = (load_file(str(Path(warm["adapter_uri"]) / r / "adapter_model.safetensors")) for r in ("act", "rehearse"))
    assert act and act.keys() == reh.keys()  # the layout train.init_adapter / start_fresh read: act/ + rehearse/
    # another LoRA layout: its own warm start, never the shared policy's
    shared = lb.condition_config(over, "world_rehearsal", 0)
    assert warm["warm_start_id"] != warm_start_id(shared, ds, warm["base_model"]["sha256"])
    assert lb.condition_config(over, "world_rehearsal", 1).train.seed == 1


@pytest.mark.parametrize("argv, needle", [
    (["--seeds", "100000000000000000000"], "each seed must be in [0, 2**32)"),
    (["--seeds", "-1"], "each seed must be in [0, 2**32)"),
    (["--out", ""], "--out is empty"),
    (["--out", "{tmp}/afile"], "afile is a file, not a folder"),
    (["--results-json", "{out}/learning.json"], "that is the resume report under --out"),
    (["--results-json", "{tmp}"], "a folder; give a file path"),
    (["--results-json", "{tmp}/afile/x.json"], "afile is a file, not a folder"),
    (["--results-md", "{tmp}/afile/r.md"], "--results-md"),
    (["--merge", "{tmp}/listreport"], "is not a learning.py report"),
    (["--conditions", "sft,,world_rehearsal"], "has an empty item (a stray comma)"),
    (["--results-json", "{tmp}/afile"], "not a .json report would be overwritten"),
    (["--results-json", "{tmp}/r.md", "--results-md", "{tmp}/r.md"], "is also --results-json"),
    (["--merge", "{tmp}/objreport", "--results-json", "{tmp}/objreport/learning.json"], "which this run reads"),
    (["--probe", "--seeds", "0"], "--probe measures the base model only: --seeds"),
    (["--preset", "from_adapter"], "--init-adapter and --dataset go together with --preset from_adapter"),
    (["--preset", "from_adapter_steps"], "go together with --preset from_adapter or from_adapter_steps"),
    (["--init-adapter", "{tmp}", "--dataset", "{tmp}"], "go together with --preset from_adapter or from_adapter_steps (and only"),
    (["--preset", "from_adapter", "--init-adapter", "{tmp}", "--dataset", "{tmp}"], "no adapter_config.json"),
    (["--preset", "from_adapter", "--init-adapter", "{tmp}/cutadapter", "--dataset", "{tmp}"], "weights missing"),
])
def test_bad_arguments_are_refused_before_any_work(argv, needle, tmp_path, monkeypatch, capsys):
    """Each bad value is one argparse error (exit 2) before the curriculum is synthesized or a model loads."""
    (tmp_path / "afile").write_text("a regular file")
    (tmp_path / "cutadapter").mkdir()  # a config, no weights: refused before the curriculum is built
    (tmp_path / "cutadapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}))
    (tmp_path / "listreport").mkdir()
    (tmp_path / "listreport" / "learning.json").write_text("[]")
    (tmp_path / "objreport").mkdir()
    (tmp_path / "objreport" / "learning.json").write_text("{}")
    out = tmp_path / "out"
    argv = [a.format(tmp=tmp_path, out=out) for a in argv]
    base = [] if "--out" in argv else ["--out", str(out)]
    monkeypatch.setattr(lb, "run", lambda *a, **k: pytest.fail("the benchmark started"))
    monkeypatch.setattr(lb, "probe", lambda *a, **k: pytest.fail("the probe started"))
    monkeypatch.setattr(sys, "argv", ["learning.py", "--no-append", *base, *argv]
                        if "--results-md" not in argv else ["learning.py", *base, *argv])
    with pytest.raises(SystemExit) as e:
        lb.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_from_adapter_starts_every_condition_from_the_given_adapter(tmp_path, tiny_model_dir, monkeypatch):
    """Preset from_adapter: the curated dataset's train split, held-out tasks from rehearsal_effect_heldout
    (stood in by a tau2 test task), no SFT; the warm start is the adapter itself, and the per-role policy
    starts from a copy of it in both roles."""
    import rehearsal_effect_heldout as reh
    from peft import LoraConfig, get_peft_model

    from envace_core.models import load_model
    from tests.heldout_stand_in import stand_in_heldout

    ds, stand_in, _ = stand_in_heldout(tmp_path)
    monkeypatch.setattr(reh, "heldout_tasks", lambda *a, **k: (stand_in, {}))
    cfg = lb.condition_config({}, "sft", 0)
    adapter = tmp_path / "adapter"
    get_peft_model(load_model(tiny_model_dir), LoraConfig(
        r=cfg.train.lora_r, lora_alpha=cfg.train.lora_alpha,
        target_modules=list(cfg.train.lora_target_modules))).save_pretrained(adapter)
    preset = _preset()
    preset.update(dataset_dir=str(ds), init_adapter=str(adapter), heldout_per_domain=1, heldout_seed=1,
                  max_iterations=1)
    preset["overrides"]["train"]["sft_warmup_steps"] = 0
    report = lb.run(preset, tmp_path / "out", ["sft", "per_role"], model_ref=str(tiny_model_dir))
    assert report["dataset"]["n_train"] == 2 and report["held_out_ids"] == [stand_in[0].id]  # airline only
    sft, per_role = report["runs"]["sft"][0], report["runs"]["per_role"][0]
    assert sft["adapter_dir"] == str(adapter) and sft["warm_start"]["steps"] == 0
    start = Path(per_role["warm_start"]["init_adapter"])
    assert start.parent == tmp_path / "out" / "store" / "per_role_init"
    assert {p.name for p in start.iterdir()} == {"act", "rehearse"}
    assert (start / "act" / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    assert per_role["iterations"] == 1 and len(per_role["final"]["success"]) == 1
    assert per_role["adapter_motion"] is None and "adapter_motion" not in sft  # a fresh LoRA has B = 0: no ratio


def test_from_adapter_steps_differs_from_from_adapter_only_in_the_update():
    """Same curriculum, held-out tasks, rollouts and token budget; only the optimizer steps per iteration
    (minibatches, PPO epochs) and the learning rate differ, so the two presets' runs are comparable."""
    a, b = lb.PRESETS["from_adapter"], lb.PRESETS["from_adapter_steps"]
    assert {k: v for k, v in a.items() if k != "overrides"} == {k: v for k, v in b.items() if k != "overrides"}
    ta, tb = a["overrides"]["train"], b["overrides"]["train"]
    assert {k: v for k, v in tb.items() if k not in ta} == {"mini_batch_rows": 8, "ppo_epochs": 2, "learning_rate": 1e-4}
    cfg = lb.condition_config(b["overrides"], "world_rehearsal", 0)
    assert (cfg.train.mini_batch_rows, cfg.train.ppo_epochs, cfg.train.learning_rate) == (8, 2, 1e-4)
    assert {k: v for k, v in a["overrides"].items() if k != "train"} == \
        {k: v for k, v in b["overrides"].items() if k != "train"}


def test_a_report_resumes_only_under_the_same_product_settings(tmp_path):
    """The resume key holds the resolved settings (profile, defaults, preset): a change to the cpu-smoke profile
    (e.g. its reward.fidelity_lambda) starts new runs; where files go and the seed do not count."""
    over = lb.PRESETS["from_adapter"]["overrides"]
    key = lb.settings_key(over, 0)
    assert lb.settings_key({**over, "store": {"root": str(tmp_path / "s"), "registry": str(tmp_path / "r")}}, 2) == key
    assert lb.settings_key({**over, "reward": {"fidelity_lambda": 0.0}}, 0) != key
    assert lb.settings_key({**over, "rollout": {"max_turns": 4}}, 0) != key


def test_adapter_motion_is_the_relative_change_of_the_lora_update(tmp_path):
    """‖Δ(B·A)‖ / ‖(B·A)_start‖ over modules and both roles; None for a fresh LoRA (B = 0) or a missing folder."""
    import torch
    from safetensors.torch import save_file

    def save(d, b_scale):
        d.mkdir(parents=True)
        save_file({"m.lora_A.weight": torch.ones(2, 3), "m.lora_B.weight": torch.ones(4, 2) * b_scale},
                  str(d / "adapter_model.safetensors"))

    save(tmp_path / "start", 1.0)
    save(tmp_path / "final", 1.01)
    assert lb.adapter_motion(str(tmp_path / "start"), str(tmp_path / "final")) == pytest.approx(0.01, rel=1e-4)
    assert lb.adapter_motion(str(tmp_path / "start"), str(tmp_path / "start")) == 0.0
    save(tmp_path / "fresh", 0.0)
    assert lb.adapter_motion(str(tmp_path / "fresh"), str(tmp_path / "final")) is None
    assert lb.adapter_motion(str(tmp_path / "start"), str(tmp_path / "gone")) is None
    for role, scale in (("act", 1.0), ("rehearse", 1.0)):
        save(tmp_path / "pr0" / role, scale)
    save(tmp_path / "pr1" / "act", 1.0)
    save(tmp_path / "pr1" / "rehearse", 1.02)  # one role moved 2 %: half the total squared norm
    assert lb.adapter_motion(str(tmp_path / "pr0"), str(tmp_path / "pr1")) == pytest.approx(0.02 / 2 ** 0.5, rel=1e-4)

