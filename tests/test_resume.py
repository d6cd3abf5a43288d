"""Exact resume: checkpoints hold adapter, optimizer, LR schedule, RNG states and the data cursor.

The stage-level test runs `stages.rollout_and_train` on the tiny random model three ways: without
interruption; killed inside iteration 3's update (after one of its optimizer steps); and re-run with
the same command. The re-run resumes from the epoch-boundary checkpoint of iteration 2 and must
produce exactly the uninterrupted run's iteration-3 metrics. Exact equality (not a tolerance) is
right here: the same process, CPU kernels, weights restored bit for bit (safetensors / torch.save)
and seeded sampling make every float deterministic; only wall-clock keys differ.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from envace_core.training.trainer import CheckpointError, PolicyTrainer
from tests.test_trainer import make_rows, make_trainer, on_policy

WALL_CLOCK = ("seconds", "tokens_per_s")  # key suffixes that measure time, not the computation


def _deterministic(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.endswith(WALL_CLOCK)}


# ----------------------------------------------------------------------------- trainer level
def test_checkpoint_restores_optimizer_schedule_and_rng_exactly(tiny_model_dir, tmp_path):
    kw = {"learning_rate": 1e-2, "ppo_epochs": 2, "mini_batch_rows": 2, "lr_scheduler": "cosine",
          "warmup_iterations": 1, "iterations": 4}
    a = make_trainer(tiny_model_dir, **kw)
    first, second = on_policy(a, make_rows(4, seed=1)), on_policy(a, make_rows(4, seed=2))
    a.update(first)  # warmup iteration: LR 0, the schedule and Adam's step count still move
    a.update(second)
    a.save_checkpoint(str(tmp_path / "ckpt"), {"cursor": {"epoch": 3, "position": 1}})
    want = a.update(first)
    want_params = [p.detach().clone() for p in a._params]
    want_draws = (random.random(), float(np.random.rand()), float(torch.rand(())))

    b = make_trainer(tiny_model_dir, lora_b_seed=7, **kw)  # other weights until it loads
    state = b.load_checkpoint(str(tmp_path / "ckpt"))
    assert state["cursor"] == {"epoch": 3, "position": 1}
    assert (state["updates"], state["optimizer_steps"]) == (2, 8) == (b.updates, b.optimizer_steps)
    got = b.update(first)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want_draws
    assert _deterministic(got) == _deterministic(want)
    assert got["lr"] == pytest.approx(1e-2 * 0.5 * (1 + np.cos(np.pi * 1 / 3)))  # k=2, W=1, K=4
    for p, q in zip(b._params, want_params):
        assert torch.equal(p, q)


def test_checkpoint_of_other_lora_config_is_a_clear_error(tiny_model_dir, tmp_path):
    make_trainer(tiny_model_dir).save_checkpoint(str(tmp_path / "ckpt"), {})
    other = make_trainer(tiny_model_dir, lora_r=4)
    before = [p.detach().clone() for p in other._params]
    with pytest.raises(CheckpointError, match="r, alpha.*Nothing was changed"):
        other.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, q) for p, q in zip(other._params, before))  # untouched
    with pytest.raises(CheckpointError, match="no checkpoint"):
        other.load_checkpoint(str(tmp_path / "absent"))


def test_a_checkpoint_without_checksums_that_fails_to_load_names_the_file(tiny_model_dir, tmp_path):
    import shutil

    trainer = make_trainer(tiny_model_dir)
    trainer.save_checkpoint(str(tmp_path / "good"), {"cursor": {"epoch": 0, "position": 0}})
    assert not (tmp_path / "good" / "CHECKSUMS.json").exists()  # a local folder, not from the store

    def broken(rel: str, how: str) -> str:
        d = tmp_path / f"{how}-{rel.replace('/', '-')}"
        shutil.copytree(tmp_path / "good", d)
        f = d / rel
        if how == "missing":
            f.unlink()
        else:
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])  # truncated, as by a full disk
        return str(d)

    for rel in ("state.json", "trainer_state.pt", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"):
        for how in ("truncated", "missing"):
            with pytest.raises(CheckpointError) as err:
                make_trainer(tiny_model_dir).load_checkpoint(broken(rel, how))
            assert Path(rel).name in str(err.value) and "Nothing was changed" in str(err.value), (rel, how, err.value)


# ------------------------------------------------------------------------------- data cursor
def test_data_cursor_visits_each_task_once_per_epoch_and_crosses_epochs():
    from envace_core.training.loop import epoch_order, next_tasks

    cursor, seen = {"epoch": 0, "position": 0}, []
    for _ in range(5):  # 5 batches of 2 over 3 tasks = 3 epochs + 1 task
        batch, cursor = next_tasks(3, 11, cursor, 2)
        seen += batch
    assert cursor == {"epoch": 3, "position": 1}
    for e in range(3):
        assert seen[3 * e:3 * e + 3] == epoch_order(3, 11, e) and sorted(seen[3 * e:3 * e + 3]) == [0, 1, 2]
    assert seen[9] == epoch_order(3, 11, 3)[0]
    # the end of an epoch is the start of the next one, never "0 steps into epoch 0"
    assert next_tasks(2, 0, {"epoch": 0, "position": 0}, 2)[1] == {"epoch": 1, "position": 0}
    assert epoch_order(50, 0, 0) != epoch_order(50, 0, 1)


# ------------------------------------------------------------------------------- stage level
class Killed(RuntimeError):
    """Stands in for SIGKILL: nothing after it in the process runs, the store keeps what it had."""


def _pseudo_rewards(real):
    """The random tiny model earns reward 0 everywhere (no learning signal); fixed varied rewards
    make advantages, gradients, Adam moments and the schedule matter to the compared metrics.
    Wraps the advantage estimator `real`: it sees row i with reward (i * 7919 % 5) / 4."""
    def estimator(rows, **kw):
        for i, r in enumerate(rows):
            r.reward, r.valid = (i * 7919 % 5) / 4, True
        return real(rows, **kw)
    return estimator


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """An uninterrupted run, a run killed in iteration 3, and the same command re-run."""
    import envace_core.training.grpo as grpo_mod
    from envace_core.config import load_config
    from envace_core.stages.curate import curate
    from envace_core.stages.train import rollout_and_train

    tmp = tmp_path_factory.mktemp("resume")

    def cfg(store: str):
        return load_config("test", {
            "model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
            "data": {"max_train_tasks_per_domain": 2},
            "rollout": {"tasks_per_iteration": 1, "group_size": 2, "max_new_tokens_act": 6},
            "train": {"iterations": 3, "checkpoint_every": 2, "ppo_epochs": 2, "mini_batch_rows": 2,
                      "lr_scheduler": "cosine", "learning_rate": 1e-2, "micro_batch_rows": 2},
            "store": {"root": str(tmp / store), "registry": str(tmp / "registry")}})

    saves = {"full": 0, "killed": 0}
    real_save, real_step = PolicyTrainer.save_checkpoint, PolicyTrainer.step
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.setitem(grpo_mod.ADVANTAGE_ESTIMATORS, "role_wise",
                   _pseudo_rewards(grpo_mod.ADVANTAGE_ESTIMATORS["role_wise"]))
        ds = curate(cfg("data"))
        assert ds["n_train"] == 2  # 2 tasks, 1 per iteration: iteration 2 ends epoch 0

        def counting_save(name):
            def save(self, *a, **k):
                saves[name] += 1
                return real_save(self, *a, **k)
            return save

        mp.setattr(PolicyTrainer, "save_checkpoint", counting_save("full"))
        full = rollout_and_train(cfg("full"), ds)

        it3_steps = []

        def step_then_die(self, rows):
            if self.updates == 2:  # iteration 3: its second optimizer step never happens
                it3_steps.append(len(rows))
                if len(it3_steps) == 2:
                    raise Killed("killed mid-update")
            return real_step(self, rows)

        mp.setattr(PolicyTrainer, "save_checkpoint", counting_save("killed"))
        mp.setattr(PolicyTrainer, "step", step_then_die)
        with pytest.raises(Killed):
            rollout_and_train(cfg("killed"), ds)
        saves["before_kill"] = saves["killed"]
        store = Path(cfg("killed").store.root) / "runs" / full["run_id"] / "checkpoint"
        after_kill = json.loads((store / "state.json").read_text())
        mp.setattr(PolicyTrainer, "step", real_step)
        resumed = rollout_and_train(cfg("killed"), ds)
    return {"full": full, "resumed": resumed, "after_kill": after_kill, "saves": saves,
            "ckpt": store, "cfg": cfg("killed"), "ds": ds}


def test_killed_run_resumes_with_the_uninterrupted_runs_metrics(runs):
    full, resumed = runs["full"]["history"], runs["resumed"]["history"]
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    # iterations 1-2 come from the checkpoint, 3 is recomputed after the resume
    assert [_deterministic(r) for r in resumed] == [_deterministic(r) for r in full]
    # the comparison is not vacuous: the update moved the weights and the schedule decays
    r3 = resumed[2]
    assert r3["train/optimizer_steps"] >= 2 and r3["train/grad_norm"] > 0 and r3["train/approx_kl"] > 0
    assert full[0]["train/lr"] == pytest.approx(1e-2) and r3["train/lr"] == pytest.approx(1e-2 * 0.25)
    # the per-iteration metrics the issue asks for are all logged
    for key in ("reward_mean/act", "reward_std/act", "adv_mean", "adv_std", "adv_abs_max", "frac_zero_std",
                "train/clip_frac", "train/approx_kl", "train/kl_ref", "train/entropy", "fidelity",
                "parse_error_rate", "parse_error_rate/act", "parse_error_rate/rehearse",
                "rollout_tokens_per_s", "train/tokens_per_s", "train/lr", "train/grad_norm"):
        assert key in r3, key
    # checkpoint_every=2: one checkpoint before the kill (iteration 2), two in the full run (2 and 3)
    assert runs["saves"] == {"full": 2, "before_kill": 1, "killed": 2}


def test_epoch_boundary_checkpoint_resumes_into_the_next_epoch(runs):
    state = runs["after_kill"]
    assert state["iteration"] == 2 and state["cursor"] == {"epoch": 1, "position": 0}
    assert state["updates"] == 2 and state["optimizer_steps"] == sum(
        r["train/optimizer_steps"] for r in runs["full"]["history"][:2]) > 0
    it3 = runs["resumed"]["history"][2]
    assert (it3["data/epoch"], it3["data/position"]) == (1, 0)
    assert [(r["data/epoch"], r["data/position"]) for r in runs["full"]["history"]] == [(0, 0), (0, 1), (1, 0)]


def test_corrupt_checkpoint_is_a_clear_error_and_loses_nothing(runs):
    from envace_core.stages.train import rollout_and_train

    ckpt = runs["ckpt"]
    blob = ckpt / "trainer_state.pt"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in ckpt.parent.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=r"corrupt: \['trainer_state.pt'\].*Nothing was changed"):
        rollout_and_train(runs["cfg"], runs["ds"])
    assert {p: p.read_bytes() for p in ckpt.parent.rglob("*") if p.is_file()} == before
