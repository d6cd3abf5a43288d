"""Role-wise GRPO math (METHOD.md §3): advantages, token log-probs, PPO-clip loss, k3 KL."""

from __future__ import annotations

import math

import pytest
import torch

from envace_core.training.grpo import policy_loss, role_advantages, token_logprobs
from envace_core.types import Role


def test_all_equal_rewards_give_zero_advantages():
    adv, valid, stats = role_advantages([0.1, 0.1, 0.1, 0.1], ["act", "act", "rehearse", "rehearse"],
                                        ["g", "g", "g", "g"], scale="std")
    assert torch.equal(adv, torch.zeros(4))
    assert valid.all()
    assert stats["frac_zero_std"] == 1.0
    assert stats["adv_abs_max"] == 0.0


def test_single_row_role_gets_zero_advantage_without_nan():
    for scale in ("none", "std"):
        adv, _, stats = role_advantages([1.0, 0.0, 1.0], ["act", "act", "rehearse"], ["g"] * 3,
                                            scale=scale)
        assert not torch.isnan(adv).any()
        assert adv[2] == 0.0
        assert stats["frac_zero_std"] == 0.5  # the one-row rehearse bucket has zero spread


def test_none_reward_is_masked_and_does_not_move_the_baseline():
    adv, valid, _ = role_advantages([1.0, None, 0.0, 0.0], ["act"] * 4, ["g"] * 4)
    assert valid.tolist() == [True, False, True, True]
    assert adv[1] == 0.0
    b = 1.0 / 3.0  # mean over the three scored rows only
    assert torch.allclose(adv, torch.tensor([1 - b, 0.0, -b, -b]))


def test_roles_have_separate_baselines_and_shared_baseline_uses_one():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    roles = [Role.ACT, Role.ACT, Role.REHEARSE, Role.REHEARSE, Role.REHEARSE, Role.REHEARSE]
    groups = ["t1"] * 6
    adv, _, stats = role_advantages(rewards, roles, groups)
    # act baseline 0.5, rehearse baseline 0.5 (two 1s, two 0s): same numbers by role here
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5, -0.5]))
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # act mean 0.5, rehearse mean 0.25, overall 1/3
    adv, _, stats = role_advantages(rewards, roles, groups)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.75, -0.25, -0.25, -0.25]))
    assert stats["reward_mean/act"] == 0.5 and stats["reward_mean/rehearse"] == 0.25
    adv, _, _ = role_advantages(rewards, roles, groups, shared_baseline=True)
    b = 2.0 / 6.0
    assert torch.allclose(adv, torch.tensor([1 - b, -b, 1 - b, -b, -b, -b]))


def test_groups_are_independent():
    adv, _, stats = role_advantages([1.0, 0.0, 5.0, 5.0], ["act"] * 4, ["a", "a", "b", "b"])
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert stats["frac_zero_std"] == 0.5


def test_std_scaling_uses_unbiased_std():
    rewards = [1.0, 0.0, 0.0, 0.0]
    adv, _, _ = role_advantages(rewards, ["act"] * 4, ["g"] * 4, scale="std", eps=0.0)
    m = 0.25
    s = math.sqrt(((1 - m) ** 2 + 3 * m ** 2) / 3)  # ddof = 1
    assert torch.allclose(adv, torch.tensor([(1 - m) / s, -m / s, -m / s, -m / s]))
    with pytest.raises(ValueError, match="scale"):
        role_advantages(rewards, ["act"] * 4, ["g"] * 4, scale="max")
    with pytest.raises(ValueError, match="one entry per row"):
        role_advantages(rewards, ["act"] * 3, ["g"] * 4)


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
