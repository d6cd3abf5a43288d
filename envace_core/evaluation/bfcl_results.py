"""BFCL results: per-entry and per-category results and the overall score in BFCL's own weighting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from envace_core.envs.bfcl import (
    import_bfcl,
)
from envace_core.evaluation.bfcl import MULTI_TURN_CATEGORIES


# ------------------------------------------------------------------------------------------- report
class EntryResult(BaseModel):
    """One entry's verdict. outcome: correct | wrong | no_call | decode_error (single-turn);
    correct | wrong | force_terminated (multi-turn, whose decode errors are counted in `decode_errors`)."""

    id: str
    valid: bool
    outcome: str
    error_type: str = ""
    error: str = ""
    decode_errors: int = 0
    decode_reasons: list[str] = Field(default_factory=list)
    output: str = ""  # the model's raw text (single-turn), truncated
    calls: Any = None  # the decoded calls (single-turn) or per-turn call strings (multi-turn)
    truncated: int = 0  # generations that hit max_new_tokens
    # multi-turn with Private Rehearsal only: mode, n, reenter, rounds, rehearsals, rejected, memory_chars (last
    # round), real_calls_during_rehearsal (always 0: anything else raises IsolationError)
    rehearsal: dict[str, Any] | None = None


class CategoryResult(BaseModel):
    """Per-category numbers. `accuracy` = correct / n, bfcl's definition (decode errors stay in n; for
    irrelevance bfcl counts an undecodable output as "no call", i.e. correct). `decode_errors` counts entries
    with at least one decode error and is never folded into `wrong`."""

    category: str
    n: int = 0
    correct: int = 0
    accuracy: float = 0.0
    wrong: int = 0
    no_call: int = 0
    decode_errors: int = 0
    decode_error_steps: int = 0
    force_terminated: int = 0
    truncated: int = 0  # generations that hit max_new_tokens
    error_types: dict[str, int] = Field(default_factory=dict)
    decode_reasons: dict[str, int] = Field(default_factory=dict)
    entries: list[EntryResult] = Field(default_factory=list)


class BfclReport(BaseModel):
    """The evaluation report: per category, bfcl's groups, and the overall.

    `overall` follows bfcl exactly: a category that was not run counts as accuracy 0 with its full
    dataset size (bfcl's `get_category_score`), so a partial run's overall is a lower bound and
    `complete` is False (also when `limit_per_category` subsampled). `overall_evaluated` is the same formula over only the categories that were run
    (groups without any are dropped and the remaining group weights renormalised), for partial runs.
    """

    categories: dict[str, CategoryResult] = Field(default_factory=dict)
    groups: dict[str, float | None] = Field(default_factory=dict)  # bfcl's rule (missing = 0)
    groups_evaluated: dict[str, float | None] = Field(default_factory=dict)  # over evaluated categories
    overall: float = 0.0
    overall_evaluated: float | None = None
    complete: bool = False
    missing_categories: list[str] = Field(default_factory=list)
    weighting: str = ("bfcl_eval/eval_checker/eval_runner_helper.py::generate_leaderboard_csv: overall = "
                      "10% non-live AST + 10% live AST + 10% irrelevance + 30% multi-turn + 40% agentic")
    limit_per_category: int | None = None

    def table(self) -> str:
        """A text table: per category n / accuracy / correct / wrong / no call / decode errors, then groups."""
        head = f"{'category':<26}{'n':>6}{'acc':>8}{'correct':>9}{'wrong':>7}{'no_call':>9}{'decode_err':>12}"
        lines = [head, "-" * len(head)]
        for c in self.categories.values():
            lines.append(f"{c.category:<26}{c.n:>6}{c.accuracy:>8.3f}{c.correct:>9}{c.wrong:>7}{c.no_call:>9}"
                         f"{c.decode_errors:>12}")
        lines.append("-" * len(head))
        fmt = lambda v: "N/A" if v is None else f"{v:.3f}"
        lines.append(f"{'group':<26}{'bfcl (missing = 0)':>20}{'evaluated only':>16}")
        for g, v in self.groups.items():
            lines.append(f"{g:<26}{fmt(v):>20}{fmt(self.groups_evaluated.get(g)):>16}")
        ev = "N/A" if self.overall_evaluated is None else f"{self.overall_evaluated:.3f}"
        lines.append(f"{'overall (bfcl)':<26}{'':>6}{self.overall:>8.3f}"
                     + ("" if self.complete else f"   (partial run; over evaluated categories: {ev})"))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------- weighting
@dataclass(frozen=True)
class _Node:
    """A node of bfcl's score composition: kind "u" (unweighted mean), "w" (count-weighted mean) or
    "p" (percentage weights); children are nodes or category names."""

    kind: str
    children: tuple
    name: str | None = None
    weights: tuple = ()


# bfcl_eval/eval_checker/eval_runner_helper.py::generate_leaderboard_csv, as a tree.
_OVERALL_TREE = _Node("p", (
    _Node("u", (_Node("u", ("simple_python", "simple_java", "simple_javascript"), "simple"),
                "multiple", "parallel", "parallel_multiple"), "non_live"),
    _Node("w", ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"), "live"),
    _Node("u", ("irrelevance", "live_irrelevance"), "irrelevance"),
    _Node("u", MULTI_TURN_CATEGORIES, "multi_turn"),
    _Node("u", (_Node("u", ("web_search_base", "web_search_no_snippet"), "web_search"),
                _Node("u", ("memory_kv", "memory_vector", "memory_rec_sum"), "memory")), "agentic"),
), "overall", (10, 10, 10, 30, 40))


def _dataset_size(category: str) -> int:
    b = import_bfcl()
    try:
        return len(b.load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False))
    except (OSError, ValueError, KeyError):  # a category bfcl cannot load offline weighs nothing
        return 0


def overall_scores(scores: dict[str, dict], only_evaluated: bool = False) -> tuple[dict | None, dict]:
    """bfcl's overall and group scores from per-category `{"accuracy", "total_count"}` dicts.

    The composition is bfcl's `generate_leaderboard_csv` (eval_runner_helper.py): non-live = unweighted
    mean of simple (itself the unweighted mean of simple_python/java/javascript), multiple, parallel,
    parallel_multiple; live = count-weighted mean of live simple/multiple/parallel/parallel_multiple;
    irrelevance = unweighted mean of irrelevance and live_irrelevance; multi-turn = unweighted mean of its
    four categories; agentic = unweighted mean of web search and memory; overall = 10/10/10/30/40
    percentage weights; every step is computed by bfcl's own `calculate_unweighted_accuracy`,
    `calculate_weighted_accuracy` or `calculate_percentage_weighted_accuracy`. live_relevance is not in
    the overall (bfcl only displays it).

    With `only_evaluated` False a missing category is `{"accuracy": 0, "total_count": <dataset size>}`
    (bfcl's `get_category_score`); with True missing categories are dropped, empty nodes disappear and the
    remaining percentage weights are renormalised (by bfcl's function).
    Returns (overall dict, or None when nothing was evaluated; {group name: accuracy or None}).
    """
    b = import_bfcl()
    groups: dict[str, float | None] = {}

    def visit(spec) -> dict | None:
        if isinstance(spec, str):
            if spec in scores:
                s = scores[spec]
                return {"accuracy": s["accuracy"], "total_count": s["total_count"], "display_accuracy": s["accuracy"]}
            if only_evaluated:
                return None
            return {"accuracy": 0, "total_count": _dataset_size(spec), "display_accuracy": "N/A"}
        vals, ws = [], []
        for i, child in enumerate(spec.children):
            v = visit(child)
            if v is not None:
                vals.append(v)
                ws.append(spec.weights[i] if spec.weights else 1)
        if not vals:
            result = None
        elif spec.kind == "u":
            result = b.calculate_unweighted_accuracy(vals, display_na_if_category_missing=False)
        elif spec.kind == "w":
            result = (b.calculate_weighted_accuracy(vals, display_na_if_category_missing=False)
                      if sum(v["total_count"] for v in vals) else {"accuracy": 0.0, "total_count": 0})
        else:
            result = b.calculate_percentage_weighted_accuracy(vals, ws, display_na_if_category_missing=False)
        if spec.name is not None and spec is not _OVERALL_TREE:
            groups[spec.name] = None if result is None else float(result["accuracy"])
        return result

    return visit(_OVERALL_TREE), groups


def overall_leaves(spec=_OVERALL_TREE) -> list[str]:
    if isinstance(spec, str):
        return [spec]
    return [c for child in spec.children for c in overall_leaves(child)]


def tally(res: CategoryResult) -> CategoryResult:
    res.n = len(res.entries)
    res.correct = sum(r.valid for r in res.entries)
    res.accuracy = res.correct / res.n if res.n else 0.0
    res.decode_errors = sum(r.decode_errors > 0 for r in res.entries)
    res.decode_error_steps = sum(r.decode_errors for r in res.entries)
    res.wrong = sum(r.outcome == "wrong" for r in res.entries)
    res.no_call = sum(r.outcome == "no_call" for r in res.entries)
    res.force_terminated = sum(r.outcome == "force_terminated" for r in res.entries)
    res.truncated = sum(r.truncated for r in res.entries)
    for r in res.entries:
        if not r.valid and r.error_type:
            res.error_types[r.error_type] = res.error_types.get(r.error_type, 0) + 1
        for reason in r.decode_reasons:
            res.decode_reasons[reason] = res.decode_reasons.get(reason, 0) + 1
    return res
