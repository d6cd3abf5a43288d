"""The benchmark report of `harness.run_eval`: ``results.json``, ``report.md``, PNG plots, ``report.html``.

Headline numbers (percent, as the paper prints them):
  * tau2-bench: mean over the domains run (mock excluded) of pass^1 (tau2's ``pass_hat_k`` with k = 1);
  * BFCL-v4: bfcl's overall (`bfcl.overall_scores`, bfcl's ``generate_leaderboard_csv`` weighting; a
    category not run counts 0, so a partial run is a lower bound; the overall over the evaluated
    categories only is shown beside it);
  * VitaBench: pass^1 (mean success, reward 1 = every rubric met);
  * overall: the mean of those three when all three ran (the paper's "overall");
  * FinMCP-Bench: micro TF1 and tool precision.
Published figures (EnvACE paper, arXiv:2608.06197, main results table) are shown beside ours, labelled
"published": never mixed into our numbers.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from envace_core.store.files import atomic_write_text

PAPER = "EnvACE paper (Xu et al., arXiv:2608.06197), main results"
PUBLISHED: dict[str, dict[str, float]] = {
    "EnvACE-8B": {"BFCL-v4": 46.04, "tau2-bench": 36.7, "VitaBench": 16.0, "Overall": 32.91},
    "Qwen3-8B": {"BFCL-v4": 44.04, "tau2-bench": 30.0, "VitaBench": 11.4, "Overall": 28.48},
}
PUBLISHED_FINMCP = {"EnvACE-8B": {"TF1": 46.78, "tool precision": 54.04}}
HEADLINE_COLUMNS = ("BFCL-v4", "tau2-bench", "VitaBench", "Overall")


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}"


def _f(v: Any) -> str:
    return "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _at(d: dict, k: int) -> Any:
    """d[k] whether the keys are ints or (after a JSON round trip) strings."""
    return d.get(k, d.get(str(k)))


def _by(results: dict, bench: str) -> list[dict]:
    return [b for b in results["benches"] if b["bench"] == bench]


def headline(results: dict) -> dict[str, float | None]:
    """Our headline numbers as fractions (module docstring); None where the benchmark was not run."""
    tau = [b["summary"]["pass_hat_k"].get(1, b["summary"]["pass_hat_k"].get("1"))
           for b in _by(results, "tau2") if b["name"] != "mock" and b["summary"].get("pass_hat_k")]
    bfcl = _by(results, "bfcl")
    vita = [b["metrics"]["pass^k"].get(1, b["metrics"]["pass^k"].get("1")) for b in _by(results, "vita")]
    out = {"tau2-bench": sum(tau) / len(tau) if tau else None,
           "BFCL-v4": bfcl[0]["report"]["overall"] if bfcl else None,
           "BFCL-v4 (evaluated categories)": bfcl[0]["report"]["overall_evaluated"] if bfcl else None,
           "VitaBench": sum(vita) / len(vita) if vita else None}
    three = [out[k] for k in ("BFCL-v4", "tau2-bench", "VitaBench")]
    out["Overall"] = sum(three) / 3 if all(v is not None for v in three) else None
    fin = _by(results, "finmcp")
    out["FinMCP TF1"] = fin[0]["micro"]["tf1"] if fin else None
    out["FinMCP tool precision"] = fin[0]["micro"]["precision"] if fin else None
    return out


def _params(n: int | None) -> str:
    if not n:
        return "unknown"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


# ------------------------------------------------------------------------------------------ markdown
def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def summary_rows(results: dict) -> list[list[str]]:
    """One row per bench/category: bench, subset, n, metric, pass^1 / score, pass^k, notes."""
    k = results["settings"]["trials"]
    rows = []
    for b in results["benches"]:
        if b["bench"] == "tau2":
            s, phk = b["summary"], b["summary"].get("pass_hat_k", {})
            rows.append(["tau2", b["name"], s.get("n_tasks", 0), "pass^1", _f(_at(phk, 1)),
                         f"pass^{k}={_f(_at(phk, k))}" if k > 1 else "—",
                         f"{s.get('errors', 0)} errors, {s.get('parse_errors', 0)} parse errors"])
        elif b["bench"] == "bfcl":
            r = b["report"]
            for c in r["categories"].values():
                rows.append(["bfcl", c["category"], c["n"], "accuracy", _f(c["accuracy"]), "—",
                             f"{c['decode_errors']} decode failures"])
            rows.append(["bfcl", "overall (bfcl weighting)", "", "accuracy", _f(r["overall"]), "—",
                         f"evaluated categories only: {_f(r['overall_evaluated'])}"])
        elif b["bench"] == "vita":
            m = b["metrics"]
            rows.append(["vita", Path(b["name"]).name, m["n_tasks"], "pass^1", _f(m["pass^k"].get(1, m["pass^k"].get("1"))),
                         f"pass^{k}={_f(m['pass^k'].get(k, m['pass^k'].get(str(k))))}" if k > 1 else "—",
                         f"avg reward {_f(m['avg_reward'])}"])
        elif b["bench"] == "finmcp":
            rows.append(["finmcp", Path(b["name"]).name, b["n_samples"], "TF1 (micro)", _f(b["micro"]["tf1"]), "—",
                         f"tool precision {_f(b['micro']['precision'])}; "
                         f"{b['decode'].get('failed_blocks', 0)} decode failures"])
    return rows


SUMMARY_HEAD = ["bench", "subset", "n", "metric", "score", "pass^k", "notes"]


def _tau2_md(results: dict) -> list[str]:
    bs = _by(results, "tau2")
    if not bs:
        return []
    keys = sorted({k for b in bs for k in b["summary"].get("reward_breakdown", {})})
    rows = []
    for b in bs:
        s = b["summary"]
        rb = s.get("reward_breakdown", {})
        rows.append([b["name"], b["split"], s.get("n_tasks", 0), s.get("n_scored", 0), _f(s.get("avg_reward")),
                     *[_f(rb.get(k)) for k in keys],
                     f"{s.get('nl_assertions_skipped', 0)} skipped (no judge offline)",
                     ", ".join(f"{t}: {c}" for t, c in s.get("termination_reasons", {}).items())])
    return ["## tau2-bench", "", *_table(["domain", "split", "tasks", "scored", "avg reward", *keys,
                                          "NL assertions", "termination reasons"], rows),
            "", "Sub-rewards are tau2's reward breakdown (mean over scored results; only criteria in a task's "
            "reward basis). NL assertions need an LLM judge, unavailable offline: they are left out of the basis.", ""]


def _protocol_md(results: dict) -> list[str]:
    """The tau2 protocol lines of the settings list (`evaluation.protocols`): its name, user and what it skips."""
    p = (results.get("protocol") or {}).get("tau2")
    if not isinstance(p, dict):  # results written before the protocol was an option
        return [f"- user simulator (tau2): {results['user_simulator']}"]
    user = f"user simulator (tau2): {results['user_simulator']}" if p.get("user_model") else \
        f"user (tau2): {p['user']}"
    return [f"- tau2 protocol: `{p['name']}` ({p['turns']}); skips: {p['skips']}", f"- {user}"]


def _bfcl_md(results: dict) -> list[str]:
    bs = _by(results, "bfcl")
    if not bs:
        return []
    r = bs[0]["report"]
    rows = [[c["category"], c["n"], _f(c["accuracy"]), c["correct"], c["wrong"], c["no_call"], c["decode_errors"],
             c.get("truncated", 0), _bfcl_rehearsals(c),
             ", ".join(f"{k}: {v}" for k, v in c["decode_reasons"].items()) or "—"] for c in r["categories"].values()]
    groups = [[g, _f(v), _f(r["groups_evaluated"].get(g))] for g, v in r["groups"].items()]
    return ["## BFCL-v4", "", *_table(["category", "n", "accuracy", "correct", "wrong", "no call",
                                       "decode failures", "truncated turns", "rehearsals", "decode reasons"], rows),
            "", ("Truncated turns: generations that hit max_new_tokens. Rehearsals: rehearsed trajectories over "
                 "the category's entries (multi-turn only; — where none ran)."), "",
            *_table(["group", "bfcl (missing = 0)", "evaluated only"], groups), "",
            f"Overall (bfcl weighting: {r['weighting']}): **{_f(r['overall'])}**; over the evaluated categories "
            f"only: {_f(r['overall_evaluated'])}." + ("" if r["complete"] else
                                                       " Partial run: the bfcl overall is a lower bound."), ""]


def _bfcl_rehearsals(c: dict) -> int | str:
    """Rehearsed trajectories over a BFCL category's entries; "—" when no entry rehearsed."""
    per = [e["rehearsal"].get("rehearsals", 0) for e in c.get("entries", []) if e.get("rehearsal")]
    return sum(per) if per else "—"


def not_rehearsed(results: dict) -> list[str]:
    """Bench labels of this run that asked for Private Rehearsal but never rehearse: single-turn BFCL
    categories (one generation per entry, nothing to imagine) and FinMCP. Empty when the mode is none."""
    from envace_core.evaluation.bfcl import MULTI_TURN_CATEGORIES

    if results["settings"]["rehearsal"]["mode"] == "none":
        return []
    out = [f"bfcl:{c}" for b in _by(results, "bfcl") for c in b["report"]["categories"]
           if c not in MULTI_TURN_CATEGORIES]
    return out + [f"finmcp:{Path(b['name']).name}" for b in _by(results, "finmcp")]


def _vita_md(results: dict) -> list[str]:
    rows = []
    for b in _by(results, "vita"):
        m = b["metrics"]
        rows.append([b["name"], m["n_tasks"], _f(m["avg_reward"]),
                     ", ".join(f"pass^{k}={_f(v)}" for k, v in m["pass^k"].items()),
                     ", ".join(f"{t}: {c}" for t, c in b["terminations"].items()),
                     json.dumps(b.get("judge_stats", {}))])
    if not rows:
        return []
    return ["## VitaBench", "", *_table(["path", "tasks", "avg reward", "pass^k", "terminations", "judge calls"], rows),
            "", f"Judge: {results.get('judge')}. Tools are generated read-only tools, not VitaBench's official "
            "ones, and the user is the opening request only: not comparable to published VitaBench numbers.", ""]


def _finmcp_md(results: dict) -> list[str]:
    rows = []
    for b in _by(results, "finmcp"):
        mi, ma = b["micro"], b["macro"]
        rows.append([b["name"], b["n_samples"], _pct(mi["tf1"]), _pct(mi["precision"]), _pct(mi["recall"]),
                     _pct(ma["tf1"]), b["decode"].get("failed_blocks", 0), b["decode"].get("invalid_calls", 0)])
    if not rows:
        return []
    pub = PUBLISHED_FINMCP["EnvACE-8B"]
    return ["## FinMCP-Bench", "", *_table(["path", "samples", "TF1 micro %", "tool precision %", "recall %",
                                            "TF1 macro %", "decode failures", "invalid calls"], rows), "",
            f"Published (EnvACE-8B, {PAPER}): TF1 {pub['TF1']}, tool precision {pub['tool precision']} (percent, micro).", ""]


def published_md(results: dict) -> list[str]:
    """The comparison block: published figures (labelled) beside ours from this run."""
    h = headline(results)
    rows = [[f"{name} (published)", *[v[c] for c in HEADLINE_COLUMNS]] for name, v in PUBLISHED.items()]
    rows.append([f"ours: {results['model']['label']} ({_params(results['model']['n_params'])}), this run",
                 *[_pct(h[c]) for c in HEADLINE_COLUMNS]])
    fin = [[f"{n} (published)", v["TF1"], v["tool precision"]] for n, v in PUBLISHED_FINMCP.items()]
    fin.append(["ours, this run", _pct(h["FinMCP TF1"]), _pct(h["FinMCP tool precision"])])
    return ["## Published figures beside ours", "",
            f"Rows marked **published** are copied from the {PAPER}; they were not measured here. "
            "Ours: tau2 = mean pass^1 over the domains run (mock excluded), BFCL-v4 = bfcl's overall (categories "
            "not run count 0), VitaBench = pass^1, Overall = their mean (only when all three ran). Small limits, "
            "other model sizes and our user simulator make these numbers not directly comparable.", "",
            *_table(["model", *[f"{c} %" for c in HEADLINE_COLUMNS]], rows), "",
            *_table(["model", "FinMCP TF1 %", "FinMCP tool precision %"], fin), ""]


def _code_md(results: dict) -> list[str]:
    """The code line: the commit that ran, and the cache's note when reused episodes came from other code
    (`code_ledger.reuse_note`). Reports written before the ledger have no "code" entry: no line."""
    code = results.get("code")
    if not code:
        return []
    commit = code.get("commit")
    line = f"- code: {commit[:12] if isinstance(commit, str) and commit else 'unknown commit'}" + \
        {True: " (uncommitted changes)", None: " (uncommitted changes unknown)"}.get(code.get("dirty"), "")
    return [line] + ([f"- **note**: {code['cache_note']}"] if code.get("cache_note") else [])


def markdown(results: dict, plots: list[str]) -> str:
    """The whole ``report.md``."""
    m, s = results["model"], results["settings"]
    reh = s["rehearsal"]
    lines = ["# Benchmark evaluation", "",
             f"- model: `{m['label']}`, {_params(m['n_params'])} parameters"
             + (f" (registry version {m['registry_version']})" if m.get("registry_version") else ""),
             f"- Private Rehearsal: {reh['mode']}" + (f", N = {reh['n']}" if reh["mode"] != "none" else "")
             + f" ({reh.get('applies_to', 'tau2 and VitaBench only')})",
             *([(f"- no rehearsal ran for {', '.join(not_rehearsed(results))} in this run (single-turn BFCL and "
                 "FinMCP never rehearse)")] if not_rehearsed(results) else []),
             *_protocol_md(results),
             f"- trials k = {s['trials']}; split {s['split']}; limit {s['limit'] or 'none'} per bench; "
             f"tau2 max steps {s['max_steps']}; seed {s['seed']}",
             "- work: " + ", ".join(f"{b}: {w['ran']} ran, {w['cached']} from cache" for b, w in results["work"].items()),
             *_code_md(results),
             f"- wall time: {results['seconds']['total']:.1f}s (model load {results['seconds']['load']:.1f}s)", "",
             "## Summary", "", *_table(SUMMARY_HEAD, summary_rows(results)), "",
             *published_md(results), *_tau2_md(results), *_bfcl_md(results), *_vita_md(results), *_finmcp_md(results),
             "## Plots", "", *[f"![{Path(p).stem}]({Path(p).name})" for p in plots], ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- plots
def _bar_values(results: dict) -> list[tuple[str, float]]:
    out = []
    for r in summary_rows(results):
        try:
            out.append((f"{r[0]}:{r[1]}"[:28], float(r[4])))
        except ValueError:
            continue
    return out


def plot(results: dict, out_dir: Path) -> list[Path]:
    """``scores.png`` (our score per bench/category) and ``published_comparison.png`` (ours beside the
    published figures, hatched bars labelled "published"). Matplotlib's Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    vals = _bar_values(results)
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(vals) + 2), 3.6))
    ax.bar([v[0] for v in vals], [100 * v[1] for v in vals], color="#3572b0")
    ax.set_ylabel("score (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{results['model']['label']}: per bench (this run)", fontsize=9)
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    paths.append(out_dir / "scores.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    h = headline(results)
    series = [(f"{n} (published)", [v[c] for c in HEADLINE_COLUMNS], "//") for n, v in PUBLISHED.items()]
    series.append(("ours (this run)", [0.0 if h[c] is None else 100 * h[c] for c in HEADLINE_COLUMNS], ""))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(series)
    for i, (name, ys, hatch) in enumerate(series):
        xs = [j + i * width for j in range(len(HEADLINE_COLUMNS))]
        ax.bar(xs, ys, width, label=name, hatch=hatch, edgecolor="black", linewidth=0.4)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(HEADLINE_COLUMNS))], HEADLINE_COLUMNS)
    ax.set_ylabel("%")
    ax.set_title("ours vs published figures (hatched = published, not measured here)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "published_comparison.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------------------------- html
def render_html(results: dict, out_dir: str | Path) -> str:
    """A self-contained HTML rendering (for a Flyte Deck): the summary, the published comparison, the
    per-bench tables (from ``report.md``) and the PNGs inlined as data URIs."""
    e = html.escape
    out_dir = Path(out_dir)

    def table(head, rows):
        return ("<table border='1' cellpadding='3'><tr>" + "".join(f"<th>{e(str(h))}</th>" for h in head) + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows) + "</table>")

    h = headline(results)
    pub = [[f"{n} (published)", *[v[c] for c in HEADLINE_COLUMNS]] for n, v in PUBLISHED.items()]
    pub.append([f"ours ({_params(results['model']['n_params'])}, this run)", *[_pct(h[c]) for c in HEADLINE_COLUMNS]])
    imgs = "".join(f"<img src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}' "
                   f"alt='{e(p.stem)}'/>" for p in sorted(out_dir.glob("*.png")))
    md = (out_dir / "report.md").read_text() if (out_dir / "report.md").is_file() else ""
    return ("<div class='envace-eval'><h2>Benchmark evaluation</h2>"
            f"<p>model {e(results['model']['label'])} ({_params(results['model']['n_params'])} parameters); "
            f"user simulator: {e(str(results['user_simulator']))}</p>"
            + table(SUMMARY_HEAD, summary_rows(results))
            + f"<h3>Published figures beside ours</h3><p>published = copied from the {e(PAPER)}</p>"
            + table(["model", *HEADLINE_COLUMNS], pub) + imgs
            + f"<h3>report.md</h3><pre style='white-space:pre-wrap'>{e(md)}</pre></div>")


# --------------------------------------------------------------------------------------------- write
# every file `write_report` may write (the PNGs only when there is something to plot); `evaluation.options.
# check_out_folder` tells an earlier --out by them
REPORT_FILES = ("results.json", "report.md", "report.html", "scores.png", "published_comparison.png")


def write_report(results: dict, out_dir: str | Path) -> dict[str, str]:
    """Write ``results.json``, the PNGs, ``report.md`` and ``report.html`` into `out_dir`; return their paths."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads(json.dumps(results, default=str))  # what is rendered is what is stored
    results["headline"] = headline(results)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2, sort_keys=True))
    pngs = plot(results, out)
    atomic_write_text(out / "report.md", markdown(results, [str(p) for p in pngs]))
    atomic_write_text(out / "report.html", render_html(results, out))
    return {"results": str(out / "results.json"), "report": str(out / "report.md"),
            "html": str(out / "report.html"), "plots": [str(p) for p in pngs]}


def print_summary(results: dict, console=None) -> None:
    """The summary and published-comparison tables in the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    c = console or Console()
    t = Table(title=f"Benchmark evaluation: {results['model']['label']} ({_params(results['model']['n_params'])})")
    for col in SUMMARY_HEAD:
        t.add_column(col)
    for r in summary_rows(results):
        t.add_row(*[str(x) for x in r])
    c.print(t)
    h = headline(results)
    p = Table(title="beside the published figures (published = from the paper, not measured here)")
    for col in ("model", *HEADLINE_COLUMNS):
        p.add_column(col)
    for name, v in PUBLISHED.items():
        p.add_row(f"{name} (published)", *[str(v[col]) for col in HEADLINE_COLUMNS])
    p.add_row("ours (this run)", *[_pct(h[col]) for col in HEADLINE_COLUMNS])
    c.print(p)
    if not_rehearsed(results):
        c.print(f"no rehearsal ran for {', '.join(not_rehearsed(results))} (they never rehearse)")
    c.print(f"user simulator: {results['user_simulator']}; work: "
            + ", ".join(f"{b} {w['ran']} ran / {w['cached']} cached" for b, w in results["work"].items()))
    if (results.get("code") or {}).get("cache_note"):
        c.print(f"note: {results['code']['cache_note']}")
