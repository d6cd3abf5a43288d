"""Flyte task: benchmark evaluation of one model (thin wrapper over envace_core.evaluation.harness).

Writes results.json, report.md and the PNG plots into `out` (re-running the same inputs resumes from the
cache there), returns the results as JSON and shows the report as HTML in the task's Flyte Deck.
"""

import json

from flytekit import Deck

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
from envace_core.evaluation import report
from envace_core.evaluation.harness import run_eval
from envace_core.evaluation.options import EvalOptions
from tasks.resources import stage_task


@stage_task("eval_bench", enable_deck=True)
def eval_bench(model: str, bench: str, rehearsal: str, trials: int, split: str, limit: int, user_model: str,
               user_url: str, max_steps: int, out: str, profile: str, overrides: str,
               protocol: str = "tau2_orchestrator") -> str:
    # Flyte inputs cannot be None: limit 0 means "all", an empty user_model/user_url means "the policy".
    opts = EvalOptions(model=model, benches=bench, out=out, rehearsal=rehearsal, trials=trials, split=split,
                       limit=limit or None, user_model=user_model or None, user_url=user_url or None,
                       max_steps=max_steps, profile=profile, overrides=overrides, protocol=protocol)
    res = run_eval(opts)
    paths = report.write_report(res, out)
    Deck("Benchmark evaluation", report.render_html(res, out))
    return json.dumps({**json.loads(json.dumps(res, default=str)), "report_paths": paths})
