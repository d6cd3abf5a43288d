"""Role-wise GRPO: advantages, per-token log-probs and the PPO-clip policy loss (METHOD.md §3).

Pure tensor functions, no model and no state. Conventions used throughout:
  B rows (one generated completion each), T token positions, V vocabulary entries;
  `mask` [B, T] bool marks the generated tokens that carry loss; log-probs are natural logs.

Formulas and their sources:
  - advantage   A_i = R_i - mean_{j in bucket(i)} R_j                    (METHOD.md §3; Dr. GRPO style)
                optionally / (std_bucket + eps)                          (GRPO, Shao et al. 2024)
  - ratio       r_t = exp(logp_t - logp_old_t)
  - PPO-clip    l_t = -min(r_t A, clip(r_t, 1-eps, 1+eps) A)            (Schulman et al. 2017, eq. 7)
  - KL (k3)     k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (Schulman, "Approximating KL
                divergence", 2020: unbiased, non-negative estimator of KL(pi || pi_ref))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

import torch


def _name(role) -> str:
    return role.value if isinstance(role, Enum) else str(role)


def _unbiased_std(xs: list[float]) -> float:
    """Sample standard deviation (ddof=1, as torch.std, TRL and verl use); 0.0 for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return 0.0
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def role_advantages(
    rewards: Sequence[float | None],
    roles: Sequence[str],
    groups: Sequence[str],
    scale: str = "none",
    shared_baseline: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Group-relative advantages with one baseline per (group, role) (METHOD.md §3).

    Args:
        rewards: N trajectory rewards, one per generation row (the trajectory's R goes to every row
            it produced); `None` marks a failed score: that row is masked, never scored 0.
        roles: N role names (`Role` members or their string values).
        groups: N group ids (a group = the G rollouts of one task).
        scale: "none": A = R - b (the reference's choice, the default); "std": A = (R - b) / (s + eps)
            with s the sample (unbiased, ddof=1) std of the bucket, as in GRPO/TRL/verl.
        shared_baseline: ablation: one bucket per group over all roles instead of one per (group, role).
        eps: added to the std when scale="std".

    Returns:
        advantages: [N] float32; 0 for masked rows, for a bucket of one valid row, and for a bucket
            whose rewards are all equal (exactly 0, no NaN).
        valid: [N] bool; False where the reward is None (the trainer drops those rows).
        stats: "frac_zero_std" (fraction of buckets with >= 1 valid row whose rewards are all equal:
            they carry no learning signal), "adv_mean", "adv_std", "adv_abs_max" (over valid rows),
            "reward_mean/<role>", "reward_std/<role>" (over valid rows, sample std).

    Raises:
        ValueError: lengths differ, or `scale` is not "none"/"std".
    """
    n = len(rewards)
    if len(roles) != n or len(groups) != n:
        raise ValueError(f"rewards, roles and groups must have one entry per row: got "
                         f"{n}, {len(roles)}, {len(groups)}")
    if scale not in ("none", "std"):
        raise ValueError(f"scale must be 'none' or 'std', got {scale!r}")
    role_names = [_name(r) for r in roles]
    valid = [r is not None and math.isfinite(float(r)) for r in rewards]

    buckets: dict[tuple, list[int]] = {}
    for i in range(n):
        if valid[i]:
            key = (groups[i],) if shared_baseline else (groups[i], role_names[i])
            buckets.setdefault(key, []).append(i)

    adv = [0.0] * n
    zero_std = 0
    for idx in buckets.values():
        rs = [float(rewards[i]) for i in idx]
        if max(rs) == min(rs):  # exact test: float mean of equal values can be off by an ulp
            zero_std += 1
            continue
        b = sum(rs) / len(rs)
        denom = _unbiased_std(rs) + eps if scale == "std" else 1.0
        for i, r in zip(idx, rs):
            adv[i] = (r - b) / denom

    stats: dict = {"frac_zero_std": zero_std / len(buckets) if buckets else 0.0}
    va = [adv[i] for i in range(n) if valid[i]]
    stats["adv_mean"] = sum(va) / len(va) if va else 0.0
    stats["adv_std"] = _unbiased_std(va)
    stats["adv_abs_max"] = max((abs(a) for a in va), default=0.0)
    for role in sorted(set(role_names)):
        rs = [float(rewards[i]) for i in range(n) if valid[i] and role_names[i] == role]
        if rs:
            stats[f"reward_mean/{role}"] = sum(rs) / len(rs)
            stats[f"reward_std/{role}"] = _unbiased_std(rs)
    return (torch.tensor(adv, dtype=torch.float32), torch.tensor(valid, dtype=torch.bool), stats)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                   temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position, in float32.

    Args:
        logits: [B, T, V] next-token logits (any float dtype; upcast to float32 first).
        target_ids: [B, T] int64 ids whose log-probs are wanted (any value where masked later).
        temperature: a float, or a [B] tensor (one per row), > 0. Dividing by the sampling temperature
            makes these the log-probs of the distribution that was actually sampled.

    Returns:
        [B, T] float32 natural-log probabilities (differentiable w.r.t. `logits`).
    """
    z = logits.float()
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.to(z.device, torch.float32).reshape(-1, 1, 1)
    elif temperature != 1.0:
        z = z / float(temperature)
    # gather - logsumexp: same value as log_softmax(z).gather, without a [B, T, V] output tensor.
    picked = z.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """token-mean: sum over all masked tokens / their count (DAPO; long rows weigh more).
    seq-mean-token-mean: mean over each row's masked tokens, then mean over rows that have any
    (original GRPO; every row weighs the same)."""
    m = mask.to(per_token.dtype)
    if agg == "token-mean":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if agg == "seq-mean-token-mean":
        counts = m.sum(-1)
        has = counts > 0
        row = (per_token * m).sum(-1) / counts.clamp(min=1.0)
        return row[has].sum() / has.sum().clamp(min=1)
    raise ValueError(f"agg must be 'token-mean' or 'seq-mean-token-mean', got {agg!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    agg: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """Token-level PPO-clip loss with optional k3 KL penalty (METHOD.md §3).

    Per generated token t of row i (A_i broadcast to every token of the row):
        r_t    = exp(logp_t - old_t)                          importance ratio to the behaviour policy
        l_t    = -min(r_t * A_i, clip(r_t, 1-eps, 1+eps) * A_i)  pessimistic PPO-clip (Schulman 2017)
        l_t   += kl_beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)   k3 KL to pi_ref (Schulman 2020)
    then aggregated over masked tokens by `agg` ("token-mean" or "seq-mean-token-mean").

    Args:
        logprobs: [B, T] current policy log-probs (with grad).
        old_logprobs: [B, T] behaviour log-probs recorded at rollout.
        advantages: [B] one advantage per row.
        mask: [B, T] bool; False positions never affect the loss or metrics (even if they hold inf/NaN).
        clip_eps: PPO epsilon.
        agg: "token-mean" | "seq-mean-token-mean".
        ref_logprobs: [B, T] reference policy log-probs, or None (no KL term).
        kl_beta: weight of the k3 term; > 0 requires `ref_logprobs`.

    Returns:
        (loss scalar, metrics) with metrics (token means over masked tokens, python floats):
        "clip_frac": fraction of tokens whose clipped term is the minimum (their gradient is zero:
        r > 1+eps with A > 0, or r < 1-eps with A < 0); "approx_kl": k3 estimate of
        KL(pi_old || pi) = exp(logp - old) - (logp - old) - 1; "ratio_mean"; "kl_ref" when
        ref_logprobs is given.

    Raises:
        ValueError: unknown `agg`, or kl_beta > 0 without `ref_logprobs`.
    """
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs (the reference policy's log-probs)")
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    lp = torch.where(mask, logprobs.float(), zero)
    old = torch.where(mask, old_logprobs.float(), zero)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    a = advantages.float().reshape(-1, 1)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * a
    per_token = -torch.minimum(unclipped, clipped)
    metrics: dict = {}
    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs.float(), zero)
        d = ref - lp
        k3 = torch.exp(d) - d - 1.0
        if kl_beta:
            per_token = per_token + kl_beta * k3
        metrics["kl_ref"] = _aggregate(k3.detach(), mask, "token-mean").item()
    loss = _aggregate(per_token, mask, agg)
    with torch.no_grad():
        is_clipped = ((ratio > 1.0 + clip_eps) & (a > 0)) | ((ratio < 1.0 - clip_eps) & (a < 0))
        metrics["clip_frac"] = _aggregate(is_clipped.float(), mask, "token-mean").item()
        metrics["approx_kl"] = _aggregate(ratio - log_ratio - 1.0, mask, "token-mean").item()
        metrics["ratio_mean"] = _aggregate(ratio, mask, "token-mean").item()
    return loss, metrics
