"""Data-parallel training: 2 CPU workers (gloo, loopback) against one process on the same rows.

Workers are real processes started with torch.multiprocessing's spawn and joined through the same
environment variables torch elastic / kfpytorch `Elastic` set (WORLD_SIZE, RANK, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT), via `distributed.session()`.

Tolerances: a rank sums its share of the micro-batch gradients, then the ranks' sums are added,
where one process adds the micro-batches in another order. float32 addition is not associative:
a sum of n terms carries an error up to ~n * 6e-8 * max|term|, and with cancellation that is large
relative to small elements, so each gradient tensor is compared with atol = 1e-4 * its max |g|
(observed with 2 OpenMP threads: max |diff| / max |g| <= 2.6e-5 per tensor, already in step 1 where
the weights are still identical; a rank that dropped or doubled rows is off by O(1) of max |g|). Adam divides each element by its own RMS, so rounding noise on a near-zero element
can move that weight by up to lr per step: the final weights (6 steps) are compared with
atol = lr / 10 (observed <= 2e-5 = lr / 50), and they moved by > 2 lr, so the check is not vacuous.
The ranks' weights, on the other hand, must be bitwise equal: both apply the one all-reduced gradient.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

import envace_core.training.grpo as grpo_mod
from envace_core.stages.curate import curate
from envace_core.stages.train import rollout_and_train
from envace_core.training.distributed import (
    DistributedSetupError,
    World,
    balanced_slices,
    init_from_env,
    session,
    shard_range,
)
from envace_core.training.grpo import role_wise

WORLD = 2
LR = 1e-3
UPDATE = {"ppo_epochs": 2, "mini_batch_rows": 4, "micro_batch_rows": 2, "learning_rate": LR,
          "max_grad_norm": 0.5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args) -> None:
    """Run fn(rank, port, *args) in WORLD fresh processes (an exception in one fails the test)."""
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(_free_port(), *args), nprocs=WORLD, join=True)


def _join(rank: int, port: int) -> dict:
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
    os.environ.update(env)  # as torch elastic sets them; gloo on the loopback interface only
    torch.set_num_threads(1)  # 2 workers on a 2-core machine
    return env


# ------------------------------------------------------------------------------ trainer level
def _rows(trainer):
    """6 act + 4 rehearse rows, slightly off-policy (ratios and clipping are not trivial)."""
    from tests.test_trainer import make_rows, on_policy

    rows = on_policy(trainer, make_rows(6, seed=4) + make_rows(4, seed=5, role="rehearse"))
    for r in rows:
        r.old_logprobs = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(r.old_logprobs)]
    return rows


def _train(model_dir, per_role: bool):
    """(trainer, update metrics, gradients of every optimizer step, rows each step trained here)."""
    from tests.test_trainer import make_trainer

    trainer = make_trainer(model_dir, policy_per_role=per_role, **UPDATE)
    rows = _rows(trainer)
    grads, seen = [], []
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(  # None: an adapter without rows
        [None if p.grad is None else p.grad.detach().clone() for p in trainer._params]))
    real = trainer._accumulate
    trainer._accumulate = lambda mb, *a: seen.append(len(mb)) or real(mb, *a)
    steps, real_step = [], trainer.step
    trainer.step = lambda batch: steps.append(seen.copy()) or seen.clear() or real_step(batch)
    m = trainer.update(rows)
    steps.append(seen.copy())
    return trainer, m, grads, [sum(s) for s in steps[1:]]


def _trainer_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    _join(rank, port)
    with session() as world:
        assert (world.rank, world.size, world.backend) == (rank, WORLD, "gloo")
        res = {}
        for per_role in (False, True):
            trainer, m, grads, rows = _train(model_dir, per_role)
            res[per_role] = {"params": [p.detach().clone() for p in trainer._params], "metrics": m,
                             "grads": grads, "rows": rows}
        torch.save(res, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    _spawn(_trainer_worker, str(tiny_model_dir), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("per_role", [False, True], ids=["shared-policy", "policy-per-role"])
def test_two_ranks_step_like_one_process_over_all_rows(two_ranks, tiny_model_dir, per_role):
    r0, r1 = two_ranks[0][per_role], two_ranks[1][per_role]
    # (a) both ranks hold the same LoRA weights, bit for bit
    assert all(torch.equal(p, q) for p, q in zip(r0["params"], r1["params"]))
    # the work was split, not duplicated: each step's rows are shared out, every rank got some
    trainer, m, grads, rows = _train(tiny_model_dir, per_role)
    assert m["optimizer_steps"] == 6 == len(r0["rows"])  # 2 epochs x ceil(10 / 4) global mini-batches
    assert [a + b for a, b in zip(r0["rows"], r1["rows"])] == rows == [4, 4, 2, 4, 4, 2]
    assert sum(r0["rows"]) > 0 and sum(r1["rows"]) > 0
    # (b) every optimizer step's gradient, the metrics and the final weights equal one process's
    for step_a, step_b in zip(r0["grads"], grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert (a is None and b is None) or torch.allclose(a, b, rtol=0, atol=1e-4 * float(b.abs().max()))
    for k in ("loss", "clip_frac", "approx_kl", "ratio_mean", "entropy", "grad_norm", "tokens", "rows"):
        assert r0["metrics"][k] == pytest.approx(m[k], rel=1e-5, abs=1e-7), k
    assert m["clip_frac"] > 0 and m["grad_norm"] > UPDATE["max_grad_norm"]  # clipping is exercised
    for p, q in zip(r0["params"], trainer._params):
        assert torch.allclose(p, q, rtol=0, atol=LR / 10)
    moved = max(float((p - q).abs().max()) for p, q in zip(r0["params"], _train_start(tiny_model_dir, per_role)))
    assert moved > 2 * LR


def _train_start(model_dir, per_role):
    from tests.test_trainer import make_trainer

    return [p.detach().clone() for p in make_trainer(model_dir, policy_per_role=per_role, **UPDATE)._params]


# ------------------------------------------------------------------------------ helpers
def test_shards_cover_every_item_once_and_balance_cost():
    assert [list(shard_range(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(shard_range(1, r, 3)) for r in range(3)] == [1, 0, 0]
    costs = [30, 1, 1, 1, 30, 1, 1, 1]
    parts = balanced_slices(costs, 2)
    assert [i for p in parts for i in p] == list(range(8))
    assert [sum(costs[i] for i in p) for p in parts] == [33, 33]
    assert [len(p) for p in balanced_slices([5], 3)].count(1) == 1


def test_one_worker_initialises_nothing_and_bad_variables_are_named():
    import torch.distributed as dist

    assert init_from_env({}) == World() and not dist.is_initialized()
    assert init_from_env({"WORLD_SIZE": "1"}).size == 1
    with pytest.raises(DistributedSetupError, match="MASTER_ADDR, MASTER_PORT"):
        init_from_env({"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(DistributedSetupError, match="RANK < WORLD_SIZE"):
        init_from_env({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "1"})
    with pytest.raises(DistributedSetupError, match="WORLD_SIZE='x'"):
        init_from_env({"WORLD_SIZE": "x"})


# ------------------------------------------------------------------------------ stage level
def _stage_cfg(model_dir, root):
    from envace_core.config import load_config

    return load_config("test", {
        "model": {"ref": str(model_dir), "compute_dtype": "float32"},
        "data": {"max_train_tasks_per_domain": 2},
        "rollout": {"tasks_per_iteration": 2, "group_size": 2, "max_new_tokens_act": 6},
        "train": {"learning_rate": 1e-2, "micro_batch_rows": 2},
        "store": {"root": str(Path(root) / "store"), "registry": str(Path(root) / "registry")}})


def _stage_run(model_dir, root, ds):
    """rollout_and_train with varied pseudo-rewards (the random model earns 0 everywhere, which
    would make every advantage 0 and the weights trivially equal); counts checkpoint writes."""
    from envace_core.training.trainer import PolicyTrainer
    from tests.test_resume import _pseudo_rewards

    saves, real_save = [], PolicyTrainer.save_checkpoint
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(grpo_mod.ADVANTAGE_ESTIMATORS, "role_wise", _pseudo_rewards(role_wise))
        mp.setattr(PolicyTrainer, "save_checkpoint", lambda self, *a: saves.append(1) or real_save(self, *a))
        mp.setattr(PolicyTrainer, "__init__", _keep_trainer(PolicyTrainer.__init__))
        out = rollout_and_train(_stage_cfg(model_dir, root), ds)
    from peft.utils import get_peft_model_state_dict

    # named as in the saved adapter_model.safetensors (peft's save_pretrained writes this dict)
    return out, len(saves), {k: v.detach().clone() for k, v in get_peft_model_state_dict(_TRAINERS[-1].model).items()}


_TRAINERS: list = []


def _keep_trainer(init):
    def wrapped(self, *a, **k):
        init(self, *a, **k)
        _TRAINERS.append(self)
    return wrapped


def _stage_worker(rank: int, port: int, model_dir: str, root: str, ds: dict) -> None:
    _join(rank, port)
    with session():
        out, saves, params = _stage_run(model_dir, root, ds)
    torch.save({"out": out, "saves": saves, "params": params}, Path(root) / f"stage-rank{rank}.pt")


def test_two_rank_rollout_and_train_matches_one_process_and_only_rank0_saves(tiny_model_dir, tmp_path,
                                                                            monkeypatch):

    monkeypatch.chdir(tmp_path)
    ds = curate(_stage_cfg(tiny_model_dir, tmp_path / "ddp"))
    assert ds["n_train"] == 2
    _spawn(_stage_worker, str(tiny_model_dir), str(tmp_path / "ddp"), ds)
    ranks = [torch.load(tmp_path / "ddp" / f"stage-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    one, one_saves, one_params = _stage_run(tiny_model_dir, tmp_path / "one", ds)

    assert [r["saves"] for r in ranks] == [1, 0] and one_saves == 1  # rank 0 alone writes
    p0, p1 = ranks[0]["params"], ranks[1]["params"]
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    from safetensors.torch import load_file

    saved = load_file(Path(ranks[1]["out"]["adapter_dir"]) / "adapter_model.safetensors")
    assert saved.keys() == p1.keys()  # rank 0's checkpoint holds the weights rank 1 ended with
    assert all(torch.equal(saved[k], p1[k]) for k in saved)
    rec, want = ranks[0]["out"]["history"][0], one["history"][0]
    assert rec["trajectories"] == 4 and rec["train/rows"] > 0 and rec["train/grad_norm"] > 0
    for k, v in want.items():  # rollouts (per-task seeds) are the same; training up to rounding
        if k.endswith(("seconds", "tokens_per_s")):
            continue
        assert rec[k] == (pytest.approx(v, rel=1e-4, abs=1e-6) if k.startswith("train/") else v), k
    for k in p0:
        assert torch.allclose(p0[k], one_params[k], rtol=0, atol=1e-2 / 10)  # lr / 10, as above
