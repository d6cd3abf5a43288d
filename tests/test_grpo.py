"""Role-wise GRPO math (METHOD.md §3): advantage estimators over rows, token log-probs, PPO-clip loss, k3 KL."""

from __future__ import annotations

import math

import pytest
import torch

from envace_core import EnvaceError
from envace_core.config import load_config
from envace_core.training.grpo import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    estimate_advantages,
    policy_loss,
    register_advantage,
    token_logprobs,
)
from envace_core.training.rows import TrainingRow, rows_from_group, trainable_rows
from envace_core.types import Generation, Role, Trajectory


def _rows(rewards, roles, groups):
    """One row per reward; None (or NaN) marks a failed score, as `rows_from_group` sets it."""
    return [TrainingRow(str(getattr(role, "value", role)), [1], [2], [0.0], group_id=g,
                        reward=r, valid=r is not None and math.isfinite(r))
            for r, role, g in zip(rewards, roles, groups)]


def _adv(rows):
    return [r.advantage for r in rows]


def test_all_equal_rewards_give_zero_advantages():
    rows = _rows([0.1, 0.1, 0.1, 0.1], ["act", "act", "rehearse", "rehearse"], ["g"] * 4)
    for r in rows:
        r.advantage = 9.0  # stale values are overwritten
    stats = estimate_advantages(rows, "std_scaled")
    assert _adv(rows) == [0.0] * 4
    assert stats["frac_zero_std"] == 1.0
    assert stats["adv_abs_max"] == 0.0


def test_single_row_role_gets_zero_advantage_without_nan():
    for name in ("role_wise", "std_scaled"):
        rows = _rows([1.0, 0.0, 1.0], ["act", "act", "rehearse"], ["g"] * 3)
        stats = estimate_advantages(rows, name)
        assert not any(math.isnan(a) for a in _adv(rows))
        assert rows[2].advantage == 0.0 and rows[0].advantage > 0 > rows[1].advantage
        assert stats["frac_zero_std"] == 0.5  # the one-row rehearse bucket has zero spread
        assert stats["reward_std/rehearse"] == 0.0


def test_failed_reward_is_masked_and_does_not_move_the_baseline():
    rows = _rows([1.0, None, 0.0, 0.0, float("nan")], ["act"] * 5, ["g"] * 5)
    estimate_advantages(rows)
    assert [r.valid for r in rows] == [True, False, True, True, False]
    b = 1.0 / 3.0  # mean over the three scored rows only
    assert _adv(rows) == pytest.approx([1 - b, 0.0, -b, -b, 0.0])
    assert trainable_rows(rows, ["act"]) == [rows[0], rows[2], rows[3]]  # masked, never trained as 0


def test_roles_have_separate_baselines_and_shared_baseline_uses_one():
    roles = [Role.ACT, Role.ACT, Role.REHEARSE, Role.REHEARSE, Role.REHEARSE, Role.REHEARSE]
    rows = _rows([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], roles, ["t1"] * 6)
    estimate_advantages(rows)
    # act baseline 0.5, rehearse baseline 0.5 (two 1s, two 0s): same numbers by role here
    assert _adv(rows) == pytest.approx([0.5, -0.5, 0.5, 0.5, -0.5, -0.5])
    rows = _rows([1.0, 0.0, 1.0, 0.0, 0.0, 0.0], roles, ["t1"] * 6)  # act 0.5, rehearse 0.25, all 1/3
    stats = estimate_advantages(rows, "role_wise")
    assert _adv(rows) == pytest.approx([0.5, -0.5, 0.75, -0.25, -0.25, -0.25])
    assert stats["reward_mean/act"] == 0.5 and stats["reward_mean/rehearse"] == 0.25
    assert stats["baseline_buckets"] == 2  # (group, ACT), (group, REHEARSE)
    stats = estimate_advantages(rows, "shared_baseline")
    b = 2.0 / 6.0
    assert _adv(rows) == pytest.approx([1 - b, -b, 1 - b, -b, -b, -b])
    assert stats["frac_zero_std"] == 0.0 and stats["baseline_buckets"] == 1


def test_baseline_buckets_count_only_buckets_with_a_valid_row():
    rows = _rows([1.0, 0.0, None, float("nan"), 2.0, 2.0], ["act", "act", "rehearse", "rehearse", "act", "act"],
                 ["a", "a", "a", "a", "b", "b"])
    for name in ("role_wise", "std_scaled", "shared_baseline"):
        stats = estimate_advantages(rows, name)
        assert stats["baseline_buckets"] == 2  # (a, ACT) and (b, ACT) / a and b; a's REHEARSE rows are all masked
        assert stats["frac_zero_std"] == 0.5
    assert estimate_advantages([], "role_wise")["baseline_buckets"] == 0


def test_groups_are_independent():
    rows = _rows([1.0, 0.0, 5.0, 5.0], ["act"] * 4, ["a", "a", "b", "b"])
    stats = estimate_advantages(rows)
    assert _adv(rows) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert stats["frac_zero_std"] == 0.5


def test_two_groups_of_one_task_get_separate_baselines():
    """A task drawn twice in one iteration makes two groups: each is baselined on its own rows."""
    def traj(r):
        return Trajectory(task_id="same-task", reward=r, generations=[
            Generation(role=Role.ACT, prompt_ids=[1], completion_ids=[2], logprobs=[0.0])])

    first = rows_from_group("1/0/same-task", [traj(1.0), traj(0.0)])
    second = rows_from_group("1/1/same-task", [traj(1.0), traj(1.0)])
    assert [r.trajectory_index for r in first] == [0, 1] and {r.group_id for r in second} == {"1/1/same-task"}
    stats = estimate_advantages(first + second)
    assert _adv(first) == [0.5, -0.5] and _adv(second) == [0.0, 0.0]  # one shared baseline: 0.25, -0.75, 0.25, 0.25
    assert stats["frac_zero_std"] == 0.5


def test_std_scaling_uses_unbiased_std():
    rewards = [1.0, 0.0, 0.0, 0.0]
    m = 0.25
    s = math.sqrt(((1 - m) ** 2 + 3 * m ** 2) / 3)  # ddof = 1
    want = [(1 - m) / s, -m / s, -m / s, -m / s]
    rows = _rows(rewards, ["act"] * 4, ["g"] * 4)
    estimate_advantages(rows, "std_scaled", eps=0.0)
    assert _adv(rows) == pytest.approx(want)
    rows = _rows(rewards, ["act"] * 4, ["g"] * 4)
    estimate_advantages(rows, "shared_baseline", scale="std", eps=0.0)
    assert _adv(rows) == pytest.approx(want)
    with pytest.raises(ValueError, match="scale"):
        estimate_advantages(rows, "role_wise", scale="max")
    with pytest.raises(EnvaceError, match="registered: role_wise, shared_baseline, std_scaled"):
        estimate_advantages(rows, "no_such")


def test_config_selects_the_estimator_and_new_ones_register():
    def pick(**train):
        return advantage_estimator(load_config("test", {"train": train}).train)

    assert pick() == ("role_wise", {})
    assert pick(advantage_scale="std") == ("std_scaled", {})
    assert pick(shared_baseline=True, advantage_scale="std") == ("shared_baseline", {"scale": "std"})

    @register_advantage("test_constant")
    def constant(rows):
        for r in rows:
            r.advantage = 1.0 if r.valid else 0.0
        return {"frac_zero_std": 0.0}

    try:
        rows = _rows([0.0, None], ["act"] * 2, ["g"] * 2)
        assert estimate_advantages(rows, "test_constant")["adv_mean"] == 1.0 and _adv(rows) == [1.0, 0.0]
        with pytest.raises(EnvaceError, match="already registered"):
            register_advantage("test_constant")(lambda rows: {})
    finally:
        del ADVANTAGE_ESTIMATORS["test_constant"]


def test_token_logprobs_matches_log_softmax_with_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, dtype=torch.bfloat16)
    ids = torch.randint(0, 11, (2, 3))
    temp = torch.tensor([0.7, 1.3])
    got = token_logprobs(logits, ids, temp)
    ref = torch.log_softmax(logits.float() / temp.view(2, 1, 1), -1).gather(-1, ids[..., None])[..., 0]
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, atol=1e-6)
    assert torch.allclose(token_logprobs(logits, ids, 0.7),
                          torch.log_softmax(logits.float() / 0.7, -1).gather(-1, ids[..., None])[..., 0],
                          atol=1e-6)


def _lp(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_ratio_one_loss_is_minus_token_mean_advantage():
    lp = _lp([-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([2.0, -1.0])
    loss, m = policy_loss(lp, lp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-(3 * 2.0 - 1.0) / 4)
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == pytest.approx(0.0)
    assert m["ratio_mean"] == pytest.approx(1.0)


def test_clipping_engages_beyond_one_plus_minus_eps():
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.1, 1.3, 0.9, 0.7]]))  # ratios
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(lp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    # A > 0: min(r, clip(r)) = [1.1, 1.2, 0.9, 0.7]; only r = 1.3 is clipped
    assert loss.item() == pytest.approx(-(1.1 + 1.2 + 0.9 + 0.7) / 4, rel=1e-6)
    assert m["clip_frac"] == pytest.approx(0.25)
    loss, m = policy_loss(lp, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    # A < 0: -min(-r, -clip(r)) = max(r, clip(r)) = [1.1, 1.3, 0.9, 0.8]; r = 0.7 is clipped
    assert loss.item() == pytest.approx((1.1 + 1.3 + 0.9 + 0.8) / 4, rel=1e-6)
    assert m["clip_frac"] == pytest.approx(0.25)
    # the clipped token gets no gradient
    lp = lp.clone().requires_grad_(True)
    policy_loss(lp, old, torch.tensor([1.0]), mask)[0].backward()
    assert lp.grad[0, 1] == 0.0 and (lp.grad[0, [0, 2, 3]] != 0).all()


def test_masked_tokens_do_not_change_the_loss():
    lp = _lp([-1.0, -2.0, -3.0])
    old = _lp([-1.1, -1.9, -3.0])
    mask = torch.tensor([[True, True, False]])
    adv = torch.tensor([1.5])
    base, mb = policy_loss(lp, old, adv, mask)
    junk_lp, junk_old = lp.clone(), old.clone()
    junk_lp[0, 2], junk_old[0, 2] = 1e4, float("nan")
    loss, m = policy_loss(junk_lp, junk_old, adv, mask, ref_logprobs=junk_lp, kl_beta=0.1)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(base.item() + 0.1 * m["kl_ref"])
    assert m["clip_frac"] == mb["clip_frac"] and m["approx_kl"] == pytest.approx(mb["approx_kl"])


def test_aggregations_differ_on_ragged_rows():
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, -2.0])
    tok, _ = policy_loss(lp, lp, adv, mask, agg="token-mean")
    seq, _ = policy_loss(lp, lp, adv, mask, agg="seq-mean-token-mean")
    assert tok.item() == pytest.approx(-(3 * 1.0 - 2.0) / 4)  # -0.25
    assert seq.item() == pytest.approx(-(1.0 - 2.0) / 2)  # +0.5
    with pytest.raises(ValueError, match="agg"):
        policy_loss(lp, lp, adv, mask, agg="sum")


def test_k3_kl_zero_at_reference_positive_elsewhere():
    lp = _lp([-1.0, -2.0])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([0.0])
    loss, m = policy_loss(lp, lp, adv, mask, ref_logprobs=lp.clone(), kl_beta=0.5)
    assert m["kl_ref"] == 0.0 and loss.item() == 0.0
    ref = _lp([-1.5, -1.0])
    loss, m = policy_loss(lp, lp, adv, mask, ref_logprobs=ref, kl_beta=0.5)
    d = ref - lp
    k3 = (d.exp() - d - 1).mean().item()
    assert m["kl_ref"] == pytest.approx(k3) and k3 > 0
    assert loss.item() == pytest.approx(0.5 * k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, adv, mask, kl_beta=0.5)
