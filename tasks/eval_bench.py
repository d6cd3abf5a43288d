"""Flyte task: benchmark evaluation of one model (thin wrapper over envace_core.evaluation.harness).

Writes results.json, report.md, report.html, the PNG plots and the resume cache (`cache/`) into a
report folder and returns it as a FlyteDirectory, i.e. through Flyte's data plane (the cluster's blob
store; flytekit's local sandbox in a local run), with the results as JSON and the report as HTML in
the task's Flyte Deck. The folder is `out` when given (a local run that wants the files in one
place; new, empty or an earlier report folder, else refused: `options.check_out_folder`), else a fresh
folder in the task's working directory; a pod's disk is never the only copy.
`resume`, the report folder of an earlier run, is downloaded into the folder first, so its cache
entries are reused (same fingerprint: same model, benches and settings).
"""

import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple, Optional

from flytekit import Deck, FlyteContextManager, current_context
from flytekit.types.directory import FlyteDirectory

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
from envace_core.evaluation import report
from envace_core.evaluation.harness import run_eval
from envace_core.evaluation.options import EvalOptions, check_out_folder
from tasks.resources import stage_task

EvalBench = NamedTuple("EvalBench", [("results", str), ("report", FlyteDirectory)])


def _report_dir(out: str) -> tuple[Path, Optional[str]]:
    """(local folder to write, remote URI it is uploaded to or None to keep flytekit's choice)."""
    if out:
        return Path(out).expanduser(), None
    local = Path(current_context().working_directory) / "eval-report"
    return local, FlyteContextManager.current_context().file_access.get_random_remote_directory()


@stage_task("eval_bench", enable_deck=True)
def eval_bench(model: str, bench: str, rehearsal: str, trials: int, split: str, limit: int, user_model: str,
               user_url: str, max_steps: int, out: str, profile: str, overrides: str,
               protocol: str = "tau2_orchestrator", resume: Optional[FlyteDirectory] = None) -> EvalBench:
    """Evaluate `model` on `bench`; (results JSON with `report_paths`, the report folder).

    `report_paths` are paths under `out` when given, else URIs under the uploaded report folder.
    """
    # Flyte inputs cannot be None: limit 0 means "all", an empty user_model/user_url means "the policy".
    local, remote = _report_dir(out)
    check_out_folder(str(local))  # not a folder of other files (an earlier report folder resumes)
    if resume is not None:
        shutil.copytree(resume.download(), local, dirs_exist_ok=True)
    opts = EvalOptions(model=model, benches=bench, out=str(local), rehearsal=rehearsal, trials=trials, split=split,
                       limit=limit or None, user_model=user_model or None, user_url=user_url or None,
                       max_steps=max_steps, profile=profile, overrides=overrides, protocol=protocol)
    res = run_eval(opts)
    paths = report.write_report(res, local)
    Deck("Benchmark evaluation", report.render_html(res, local))
    if remote is not None:  # name the files where they will live after this pod is gone
        def at(p: str) -> str:
            return remote.rstrip("/") + "/" + os.path.relpath(p, local).replace(os.sep, "/")
        paths = {k: [at(p) for p in v] if isinstance(v, list) else at(v) for k, v in paths.items()}
        paths["folder"] = remote
    results = json.dumps({**json.loads(json.dumps(res, default=str)), "report_paths": paths})
    return EvalBench(results=results, report=FlyteDirectory(str(local), remote_directory=remote or None))
