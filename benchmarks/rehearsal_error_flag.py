"""Does REHEARSE's error flag say anything at test time? Each rehearsal's first call, replayed for real.

    .venv/bin/python benchmarks/rehearsal_error_flag.py \
        --tasks .envace/bench/rehearsal_effect/heldout_tasks/<file>.json \
        --cells actpit=.envace/bench/rehearsal_effect/cache/<fingerprint>,... \
        [--json benchmarks/results/rehearsal_error_flag.json]

Reads the episode cache of `benchmarks/rehearsal_effect.py --heldout` cells (each ``episodes.jsonl`` record
holds its episode's trace: every rehearsal's steps with the imagined observation and the verifier's verdict).
For every rehearsal of the first round whose first step is a tool call with an imagined response, the same
call is made in the real tau2 environment reset to the task (`envs.tau2.environment.Tau2Environment`: no
model runs) and the real error flag is set against the imagined one. Printed per cell, for all rehearsals and
for the verifier's kept ones: P(imagined error | real success) and P(imagined error | real error), with
counts. A rehearser whose two rates are equal tells the committed ACT nothing with "this call failed"
(METHOD.md §4: the memory's "pitfalls" are only as true as the imagined errors). Takes seconds; no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envace_core import EnvaceError
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.stages.dataset import read_tasks_file
from envace_core.types import ToolCall


def first_steps(cache_dir: Path):
    """(task_id, call dict, imagined error flag, kept by the verifier) per rehearsal of each episode's first
    round whose first step is a call with an imagined observation. Raises EnvaceError on a missing cache."""
    path = cache_dir / "episodes.jsonl"
    if not path.is_file():
        raise EnvaceError(f"{path} does not exist: give the cache folder of a rehearsal_effect cell")
    for line in path.read_text().splitlines():
        ep = json.loads(line)
        rounds = [r for r in ((ep.get("trace") or {}).get("rounds") or []) if r.get("turn", 0) == 0]
        for r in (rounds[0]["rehearsals"] if rounds else []):
            calls = [s for s in r.get("steps", []) if s.get("call")]
            if calls and calls[0].get("observation") is not None:
                yield ep["task_id"], calls[0]["call"], bool(calls[0].get("error")), not r.get("rejected")


def rates(rows: list[tuple[bool, bool]]) -> dict:
    """{'real_success': {n, imagined_error, rate}, 'real_error': {...}} over (real error, imagined error) pairs."""
    out = {}
    for key, real in (("real_success", False), ("real_error", True)):
        sel = [im for r, im in rows if r == real]
        out[key] = {"n": len(sel), "imagined_error": sum(sel), "rate": (sum(sel) / len(sel)) if sel else None}
    return out


def measure(tasks_file: str, cells: dict[str, str]) -> dict:
    tasks = {t.id: t for t in read_tasks_file(tasks_file)}
    envs: dict[str, Tau2Environment] = {}
    out = {}
    for label, cache in cells.items():
        every, kept = [], []
        for task_id, call, imagined, is_kept in first_steps(Path(cache)):
            task = tasks.get(task_id)
            if task is None:
                raise EnvaceError(f"{task_id} of {cache} is not in {tasks_file}: give the task file the cell ran on")
            env = envs.setdefault(task.domain, Tau2Environment(task.domain))
            env.reset(task)
            real = env.step(ToolCall(name=call["name"], arguments=call.get("arguments") or {}, id="replay")).error
            every.append((bool(real), imagined))
            if is_kept:
                kept.append((bool(real), imagined))
        out[label] = {"cache": str(cache), "all": rates(every), "kept": rates(kept)}
    return out


def table(res: dict) -> str:
    lines = ["| cell | rehearsals | real success: imagined as error | real error: imagined as error |",
             "|---|---|---|---|"]
    def cell(x: dict) -> str:
        return f"{x['imagined_error']} of {x['n']}" + (f" ({x['rate']:.2f})" if x["rate"] is not None else "")

    for label, r in res.items():
        for which in ("all", "kept"):
            lines.append(f"| {label} | {which} | {cell(r[which]['real_success'])} | {cell(r[which]['real_error'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", required=True, help="the held-out task file the cells ran on (.json list of tasks)")
    ap.add_argument("--cells", required=True, help="LABEL=CACHE_DIR,... (rehearsal_effect cache folders)")
    ap.add_argument("--json", help="write the rates here")
    a = ap.parse_args(argv)
    cells = dict(c.split("=", 1) for c in a.cells.split(",") if c)
    res = measure(a.tasks, cells)
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps({"tasks": a.tasks, "cells": res}, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (EnvaceError, ValueError) as e:
        print(f"rehearsal_error_flag: error: {e}", file=sys.stderr)
        sys.exit(2)
