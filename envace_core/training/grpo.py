"""Role-wise GRPO: advantage estimators over rows, per-token log-probs and the PPO-clip loss (METHOD.md §3).

No model and no state beyond the estimator registry. Conventions used throughout:
  B rows (one generated completion each), T token positions, V vocabulary entries;
  `mask` [B, T] bool marks the generated tokens that carry loss; log-probs are natural logs.

Formulas and their sources:
  - advantage   A_i = R_i - mean_{j in bucket(i)} R_j                    (METHOD.md §3; Dr. GRPO style)
                optionally / (std_bucket + eps)                          (GRPO, Shao et al. 2024)
                bucket = (group, role) for "role_wise" and "std_scaled", the group for
                "shared_baseline" (the `shared_baseline` ablation, METHOD.md §3)
  - ratio       r_t = exp(logp_t - logp_old_t)
  - PPO-clip    l_t = -min(r_t A, clip(r_t, 1-eps, 1+eps) A)            (Schulman et al. 2017, eq. 7)
  - KL (k3)     k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (Schulman, "Approximating KL
                divergence", 2020: unbiased, non-negative estimator of KL(pi || pi_ref))

Advantage estimators are registered functions ``fn(rows, **options) -> stats`` over
`rows.TrainingRow`s: they set `advantage` on every row (0 on invalid rows) and return
{"frac_zero_std": ...}; `estimate_advantages` calls one by name and adds the shared statistics.
Adding one is a function decorated with ``@register_advantage("name")``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from envace_core import EnvaceError

if TYPE_CHECKING:
    from envace_core.config import TrainConfig
    from envace_core.training.rows import TrainingRow

AdvantageFn = Callable[..., dict]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn(rows, **options) -> {"frac_zero_std": float}`` as estimator `name`.
    Raises EnvaceError if `name` is taken by another function."""
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name] is not fn:
            raise EnvaceError(f"advantage estimator {name!r} is already registered "
                              f"({ADVANTAGE_ESTIMATORS[name].__name__})")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return deco


def _unbiased_std(xs: list[float]) -> float:
    """Sample standard deviation (ddof=1, as torch.std, TRL and verl use); 0.0 for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return 0.0
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def baseline_advantages(rows: Sequence[TrainingRow], bucket: Callable[[TrainingRow], Hashable],
                        scale: str = "none", eps: float = 1e-6) -> dict:
    """A = R - b over buckets of valid rows (b = the bucket's mean reward), in place.

    Args:
        rows: rows with `reward` and `valid` set (`rows.rows_from_group`).
        bucket: row -> the key of its baseline bucket; rows of one bucket share b.
        scale: "none": A = R - b (the reference's choice); "std": A = (R - b) / (s + eps) with s the
            bucket's sample (unbiased, ddof=1) std, as in GRPO/TRL/verl.
        eps: added to s when scale="std".

    Sets `advantage` = 0 on invalid rows, on a bucket of one valid row and on a bucket whose rewards
    are all equal (exactly 0, no NaN).

    Returns:
        {"frac_zero_std": fraction of buckets whose rewards are all equal (no learning signal),
         "baseline_buckets": number of buckets holding >= 1 valid row (each has its own b)}.

    Raises:
        ValueError: `scale` is not "none"/"std".
    """
    if scale not in ("none", "std"):
        raise ValueError(f"scale must be 'none' or 'std', got {scale!r}")
    buckets: dict[Hashable, list[TrainingRow]] = {}
    for r in rows:
        r.advantage = 0.0
        if r.valid:
            buckets.setdefault(bucket(r), []).append(r)
    zero_std = 0
    for members in buckets.values():
        rs = [float(r.reward) for r in members]
        if max(rs) == min(rs):  # exact test: float mean of equal values can be off by an ulp
            zero_std += 1
            continue
        b = sum(rs) / len(rs)
        denom = _unbiased_std(rs) + eps if scale == "std" else 1.0
        for r, x in zip(members, rs):
            r.advantage = (x - b) / denom
    return {"frac_zero_std": zero_std / len(buckets) if buckets else 0.0, "baseline_buckets": len(buckets)}


@register_advantage("role_wise")
def role_wise(rows: Sequence[TrainingRow], scale: str = "none", eps: float = 1e-6) -> dict:
    """World Rehearsal's default (METHOD.md §3): b_r = mean R over role r's valid rows in the group."""
    return baseline_advantages(rows, lambda r: (r.group_id, r.role), scale, eps)


@register_advantage("shared_baseline")
def shared_baseline(rows: Sequence[TrainingRow], scale: str = "none", eps: float = 1e-6) -> dict:
    """The `shared_baseline` ablation (METHOD.md §3): one b per group over the rows of all roles."""
    return baseline_advantages(rows, lambda r: r.group_id, scale, eps)


@register_advantage("std_scaled")
def std_scaled(rows: Sequence[TrainingRow], eps: float = 1e-6) -> dict:
    """Role-wise with GRPO's std division (METHOD.md §3 `scale="std"`): A = (R - b_r) / (s_r + eps)."""
    return baseline_advantages(rows, lambda r: (r.group_id, r.role), "std", eps)


def advantage_estimator(cfg: TrainConfig) -> tuple[str, dict]:
    """(estimator name, its options) that `train.shared_baseline` and `train.advantage_scale` select:
    shared_baseline -> "shared_baseline" with scale=advantage_scale; else advantage_scale "std" ->
    "std_scaled"; else "role_wise"."""
    if cfg.shared_baseline:
        return "shared_baseline", {"scale": cfg.advantage_scale}
    return ("std_scaled", {}) if cfg.advantage_scale == "std" else ("role_wise", {})


def estimate_advantages(rows: Sequence[TrainingRow], estimator: str = "role_wise", **options) -> dict:
    """Fill every row's `advantage` with the registered `estimator` and summarise.

    Returns:
        the estimator's stats ("frac_zero_std": fraction of buckets with >= 1 valid row whose
        rewards are all equal; "baseline_buckets": the number of buckets with >= 1 valid row), then
        "adv_mean", "adv_std", "adv_abs_max" (over valid rows; sample std) and "reward_mean/<role>",
        "reward_std/<role>" (over each role's valid rows).

    Raises:
        EnvaceError: unknown `estimator` (the message lists the registered ones); ValueError: bad options.
    """
    try:
        fn = ADVANTAGE_ESTIMATORS[estimator]
    except KeyError:
        raise EnvaceError(f"unknown advantage estimator {estimator!r}; registered: "
                          f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))}") from None
    stats = dict(fn(rows, **options))
    va = [r.advantage for r in rows if r.valid]
    stats["adv_mean"] = sum(va) / len(va) if va else 0.0
    stats["adv_std"] = _unbiased_std(va)
    stats["adv_abs_max"] = max((abs(a) for a in va), default=0.0)
    for role in sorted({r.role for r in rows}):
        rs = [float(r.reward) for r in rows if r.valid and r.role == role]
        if rs:
            stats[f"reward_mean/{role}"] = sum(rs) / len(rs)
            stats[f"reward_std/{role}"] = _unbiased_std(rs)
    return stats


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
