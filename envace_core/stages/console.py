"""Rich tables the stages print for a person at the terminal (training metrics, evaluation results)."""

from __future__ import annotations

from typing import Any


def _console():
    """A rich console that does not cut tables to 80 columns when output goes to a file or pipe."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def print_training_table(history: list[dict[str, Any]], source: str = "imagined") -> None:
    """One row per iteration record of `training.loop`; `source` is `rollout.source`: 'imagined' titles it
    World Rehearsal, 'real' standard GRPO (rollouts in the real environment, ACT rows only)."""
    from rich.table import Table

    def f(v: Any) -> str:
        return "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    method = "World Rehearsal" if source == "imagined" else "standard GRPO (real rollouts)"
    table = Table(title=f"{method} training (per iteration)",
                  caption="— = no such rows (e.g. no REHEARSE rows when ACT never called a tool); wrong calls = "
                  "ACT calls of unknown tools or with invalid arguments, answered as tool errors")
    cols = [("it", "iteration"), ("reward ACT", "reward_mean/act"),
            ("reward REHEARSE", "reward_mean/rehearse"), ("frac_zero_std", "frac_zero_std"),
            ("fidelity", "fidelity"), ("parse err", "parse_error_rate"),
            ("wrong calls", "schema_error_rate/act"), ("loss", "train/loss"), ("secs", "seconds")]
    for name, _ in cols:
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for rec in history:
        table.add_row(*[f(rec.get(key)) for _, key in cols])
    _console().print(table)


def print_eval_table(summary: dict[str, dict[str, Any]], protocol: str) -> None:
    """One row per "<condition>|<domain>" of `stages.evaluate.summarise_eval`: tasks, scored, pass^1
    (— when none was scored), mean sub-rewards, termination reasons; the title names the protocol."""
    from rich.table import Table

    table = Table(title=f"tau2-bench evaluation (test split, protocol {protocol})")
    for c in ("condition", "domain", "tasks", "scored", "pass^1", "sub-rewards", "terminations"):
        table.add_column(c)
    for key, s in summary.items():
        cond, dom = key.split("|")
        table.add_row(cond, dom, str(s["n"]), str(s["n_scored"]),
                      "—" if s["pass^1"] is None else f"{s['pass^1']:.3f}",
                      ", ".join(f"{k}={v:.2f}" for k, v in s["reward_breakdown"].items()),
                      ", ".join(f"{k}:{v}" for k, v in s["termination_reasons"].items()))
    _console().print(table)


def print_comparison_table(summary: dict[str, Any], protocol: str) -> None:
    """One row per (task set, model) of `stages.compare.summarize`: tasks scored, pass^1 [95 % CI],
    and the paired differences to base and to the warm start [95 % CI]."""
    from rich.table import Table

    def ci(s: dict[str, Any] | None, signed: bool = False) -> str:
        if not s or s.get("mean") is None:
            return "—"
        f = "{:+.3f}" if signed else "{:.3f}"
        lo, hi = s["ci95"]
        return f"{f.format(s['mean'])} [{f.format(lo)}, {f.format(hi)}] (n={s['n']})"

    table = Table(title=f"base vs warm start vs trained (no rehearsal, greedy, protocol {protocol}; "
                        "paired 95% bootstrap CIs over tasks)")
    for c in ("task set", "model", "pass^1", "− base", "− warm start"):
        table.add_column(c)
    for set_name, s in summary.items():
        for model, m in s["models"].items():
            table.add_row(set_name, model, ci(m), ci(s["paired"].get(f"{model} - base"), True),
                          ci(s["paired"].get(f"{model} - warm_start"), True))
    _console().print(table)
