"""Confidence intervals shared by the benchmarks and tool learning.

`bootstrap_ci` is the percentile bootstrap (Efron & Tibshirani 1993, ch. 13): resample the items
with replacement `n_boot` times, take the 2.5th and 97.5th percentiles of the resampled means.
"""

from __future__ import annotations

import random
import statistics
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    pass
from collections.abc import Sequence


def mean_or_none(xs: list[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def bootstrap_ci(xs: Sequence[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of xs (resampling items with replacement).

    Deterministic given `seed`. Raises ValueError for an empty `xs`."""
    if not xs:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(n_boot))
    return means[int(0.025 * n_boot)], means[int(0.975 * n_boot) - 1]


def mean_ci(xs: Sequence[float], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """{"mean", "ci95": [lo, hi], "n", "method"} of the per-item values xs; mean and ci95 are None
    when xs is empty (nothing measured, never reported as 0)."""
    if not xs:
        return {"mean": None, "ci95": None, "n": 0, "method": "no data"}
    lo, hi = bootstrap_ci(list(xs), n_boot, seed)
    return {"mean": statistics.fmean(xs), "ci95": [lo, hi], "n": len(xs),
            "method": f"percentile bootstrap over items ({n_boot} resamples)"}
