"""Benchmark evaluation of any model on any subset of tau2-bench, BFCL-v4, VitaBench and FinMCP-Bench.

    pyflyte run workflows/evaluate.py evaluate --model registry:envace-policy@VERSION \
        --bench tau2:airline,bfcl:simple --rehearsal parallel:4
    pyflyte run workflows/evaluate.py evaluate --model bundled:smollm2-135m-instruct \
        --bench tau2:mock,bfcl:simple --split full --limit 2 --out /tmp/evalrun
    pyflyte run --remote workflows/evaluate.py evaluate_on_gpu --model registry:envace-policy@VERSION \
        --bench tau2:airline --overrides "$ENVACE_CLUSTER_OVERRIDES"

Same inputs as `envace eval`, `--protocol` included (limit 0 = all; empty user_model / user_url = the
policy plays the user). Returns the results as JSON; the task's Flyte Deck shows the report (tables,
plots, published figures). The report folder (results.json, report.md/.html, PNGs, resume cache) is the
eval_bench task's FlyteDirectory output, in Flyte's blob store; with `out` "" (the default) the JSON's
`report_paths` are URIs there. `out` names a local folder instead (local runs): a new or empty folder, or
an earlier run's report folder (a folder of other files is refused before the model loads). `resume` (an earlier
run's report folder, e.g. its `report_paths.folder`) seeds the resume cache. `evaluate` puts the
task on the `cpu` tier (CPU profiles), `evaluate_on_gpu` on the `gpu` tier with the GPU type.
"""

from typing import Optional

from flytekit import workflow
from flytekit.types.directory import FlyteDirectory

import envace_core  # noqa: F401  (offline environment before tau2 is imported)
from tasks.eval_bench import eval_bench
from tasks.resources import gpu_overrides


@workflow
def evaluate(model: str, bench: str, rehearsal: str = "none", trials: int = 1, split: str = "test", limit: int = 0,
             user_model: str = "", user_url: str = "", max_steps: int = 30, out: str = "",
             profile: str = "cpu-smoke", overrides: str = "", protocol: str = "tau2_orchestrator",
             resume: Optional[FlyteDirectory] = None) -> str:
    """Evaluate `model` on `bench` (comma-separated BENCH:ARG); returns the JSON results.

    `protocol` is how tau2 benches are run and scored (`envace_core.evaluation.protocols`):
    ``tau2_orchestrator`` (tau2's Orchestrator with a simulated user) or ``opening_request``."""
    return eval_bench(model=model, bench=bench, rehearsal=rehearsal, trials=trials, split=split, limit=limit,
                      user_model=user_model, user_url=user_url, max_steps=max_steps, out=out, profile=profile,
                      overrides=overrides, protocol=protocol, resume=resume).results


@workflow
def evaluate_on_gpu(model: str, bench: str, rehearsal: str = "none", trials: int = 1, split: str = "test",
                    limit: int = 0, user_model: str = "", user_url: str = "", max_steps: int = 30,
                    profile: str = "gpu-8b", overrides: str = "", protocol: str = "tau2_orchestrator",
                    resume: Optional[FlyteDirectory] = None) -> str:
    """`evaluate` on the `gpu` tier (a GPU profile's model); the report only in Flyte's blob store."""
    return eval_bench(model=model, bench=bench, rehearsal=rehearsal, trials=trials, split=split, limit=limit,
                      user_model=user_model, user_url=user_url, max_steps=max_steps, out="", profile=profile,
                      overrides=overrides, protocol=protocol, resume=resume).with_overrides(**gpu_overrides("eval_bench")).results
