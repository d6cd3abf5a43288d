"""Tool learning: teach a registered model new tools by rehearsal, then measure the effect.

    pyflyte run workflows/adapt_tools.py adapt_tools --model registry:envace-policy@VERSION \
        --tools_file examples/tools/tools.json --examples_file examples/tools/examples.jsonl
    pyflyte run workflows/adapt_tools.py adapt_tools --model registry:envace-policy@VERSION \
        --tools_file tools.json --domain retail --n_tasks 32 --config gpu-8b

check the inputs (CPU) → resolve the config → adapt (build + gate tasks, rehearsal-only GRPO from the
parent, register the new version) → measure parent vs adapted on the held-out tasks. Same steps as
`envace adapt-tools --measure`. Returns the new version's `registry:` reference, the adaptation result
and the measurement (JSON); the measure task's Deck shows the before/after table.
"""

from typing import NamedTuple, Optional

from flytekit import LaunchPlan, conditional, workflow
from flytekit.types.file import FlyteFile

import envace_core  # noqa: F401  (offline environment before tau2 is imported)
from tasks.adapt_tools import adapt_tools_task, check_tool_inputs, measure_tools
from tasks.preflight import resolve_config
from tasks.resources import GPU_PROFILES, gpu_overrides

AdaptToolsOutputs = NamedTuple("AdaptToolsOutputs", [("model", str), ("adaptation", str), ("measurement", str)])


def _adapt_and_measure(model, tools_file, examples_file, domain, n_tasks, config, overrides, name, trials,
                       seed, gpu: bool) -> AdaptToolsOutputs:
    def on(node, stage):
        return node.with_overrides(**gpu_overrides(stage)) if gpu else node

    checked = check_tool_inputs(tools_file=tools_file, examples_file=examples_file)
    cfg = resolve_config(profile=config, overrides=overrides)
    adapted = on(adapt_tools_task(config=cfg, model=model, tools_file=tools_file, examples_file=examples_file,
                                  domain=domain, n_tasks=n_tasks, name=name, checked=checked), "adapt_tools")
    measured = on(measure_tools(config=cfg, model=model, adapted=adapted.result, checked=checked, trials=trials,
                                seed=seed), "measure_tools")
    return AdaptToolsOutputs(model=adapted.model, adaptation=adapted.result, measurement=measured)


@workflow
def adapt_tools_on_cpu(model: str, tools_file: FlyteFile, examples_file: Optional[FlyteFile] = None,
                       domain: str = "retail", n_tasks: int = 16, config: str = "cpu-smoke", overrides: str = "",
                       name: str = "", trials: int = 1, seed: int = 0) -> AdaptToolsOutputs:
    """`adapt_tools` with every task on the `cpu` tier (tasks/resources.py)."""
    return _adapt_and_measure(model, tools_file, examples_file, domain, n_tasks, config, overrides, name,
                              trials, seed, gpu=False)


@workflow
def adapt_tools_on_gpu(model: str, tools_file: FlyteFile, examples_file: Optional[FlyteFile] = None,
                       domain: str = "retail", n_tasks: int = 16, config: str = "gpu-8b", overrides: str = "",
                       name: str = "", trials: int = 1, seed: int = 0) -> AdaptToolsOutputs:
    """`adapt_tools` with adaptation and measurement on the `gpu` tier, with the GPU type."""
    return _adapt_and_measure(model, tools_file, examples_file, domain, n_tasks, config, overrides, name,
                              trials, seed, gpu=True)


@workflow
def adapt_tools(model: str, tools_file: FlyteFile, examples_file: Optional[FlyteFile] = None,
                domain: str = "retail", n_tasks: int = 16, config: str = "cpu-smoke", overrides: str = "",
                name: str = "", trials: int = 1, seed: int = 0) -> AdaptToolsOutputs:
    """Adapt `model` to the tools in `tools_file`; returns (new registry ref, adaptation JSON,
    measurement JSON). `overrides` as `envace --overrides`; `name` "" = the profile's store.model_name.
    Resources follow `config`: `adapt_tools_on_gpu` for a GPU profile, else `adapt_tools_on_cpu`."""
    args = dict(model=model, tools_file=tools_file, examples_file=examples_file, domain=domain, n_tasks=n_tasks,
                config=config, overrides=overrides, name=name, trials=trials, seed=seed)
    branch = conditional("resources_of_profile")
    for p in GPU_PROFILES:
        branch = (branch.if_ if p == GPU_PROFILES[0] else branch.elif_)(config == p).then(adapt_tools_on_gpu(**args))
    return branch.else_().then(adapt_tools_on_cpu(**args))


# On the cluster: the GPU profile (and with it the GPU tier) is fixed so a launch cannot silently adapt
# with the CPU smoke settings.
adapt_tools_gpu = LaunchPlan.get_or_create(
    workflow=adapt_tools,
    name="envace_adapt_tools_gpu",
    fixed_inputs={"config": "gpu-8b"},
)
