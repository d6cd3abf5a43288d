"""Flyte tasks of tool learning: thin wrappers over envace_core.tool_learning.

* check_tool_inputs  validates tools.json / examples.jsonl on a small CPU pod, so a bad schema fails
                     with the field at fault before a GPU pod starts.
* adapt_tools_task   `tool_learning.adapt`: adaptation tasks built and gated, a short rehearsal-only
                     role-wise GRPO run from the parent, a new registered version (JSON result).
* measure_tools      `tool_learning.measure` of the parent and of the adapted version on the held-out
                     tasks that need the new tools (JSON result; the table in the task's Deck).

None of the three is cached (tasks/resources.py, stages "check_tool_inputs", "adapt_tools",
"measure_tools"):
* check_tool_inputs: flytekit keys a FlyteFile input by its URI, not by its bytes, so a cache hit
  could pass a tools file edited in place since the last run; and it takes seconds.
* adapt_tools_task: it registers a model version, a side effect (as tasks/register.py): a cache hit
  would hand back a version without writing it (a deleted registry would stay empty) and the parent
  `registry:` reference is resolved and verified against the registry as it is now. Training is not
  repeated needlessly anyway: a retry resumes from the run's own checkpoint in the artifact store.
* measure_tools: its inputs name models by reference; a local folder or `bundled:` reference can hold
  other weights later under the same string, so a cached result could describe another model. And
  its Deck only renders when the body runs.
"""

import json
from typing import NamedTuple, Optional

from flytekit import Deck
from flytekit.types.file import FlyteFile

import envace_core  # noqa: F401  (offline environment before anything imports tau2)
from envace_core.cli import measurement_table
from envace_core.config import config_from_json
from envace_core.stages.dataset import load_dataset
from envace_core.tool_learning.adapt import adapt
from envace_core.tool_learning.inputs import load_examples, load_tools
from envace_core.tool_learning.measure import measure
from envace_core.tool_learning.tasks import HELD_OUT_SPLIT
from tasks.resources import stage_task


def _inputs(tools_file: FlyteFile, examples_file: Optional[FlyteFile]):
    tools = load_tools(tools_file.download())
    examples = load_examples(examples_file.download(), tools) if examples_file else []
    return tools, examples


@stage_task("check_tool_inputs")
def check_tool_inputs(tools_file: FlyteFile, examples_file: Optional[FlyteFile]) -> str:
    """The tool names and example count (JSON); ToolSchemaError naming the field for a bad file."""
    tools, examples = _inputs(tools_file, examples_file)
    return json.dumps({"tools": [t.spec.name for t in tools], "n_examples": len(examples)})


Adapted = NamedTuple("Adapted", [("model", str), ("result", str)])


@stage_task("adapt_tools")
def adapt_tools_task(config: str, model: str, tools_file: FlyteFile, examples_file: Optional[FlyteFile],
                     domain: str, n_tasks: int, name: str, checked: str) -> Adapted:
    """`tool_learning.adapt` from `model`: the new version as `registry:NAME@VERSION` and adapt's
    result (name, version, manifest path, dataset, ...) as JSON.

    `checked` (check_tool_inputs' output) orders this task after the input check; `name` "" = the
    parent's registry name, else the config's store.model_name.
    """
    del checked
    cfg = config_from_json(config)
    tools, examples = _inputs(tools_file, examples_file)
    out = adapt(cfg, model, tools, examples, domain=domain, n_tasks=n_tasks,
                registry=cfg.store.registry, name=name or None)
    return Adapted(model=f"registry:{out['name']}@{out['version']}", result=json.dumps(out, default=str))


@stage_task("measure_tools", enable_deck=True)
def measure_tools(config: str, model: str, adapted: str, checked: str, trials: int, seed: int) -> str:
    """Parent `model` vs the adapted version on the held-out tasks: {"parent", "adapted", "n_tasks",
    "table"} as JSON, the table also in the Deck."""
    cfg, res = config_from_json(config), json.loads(adapted)
    tools, held = json.loads(checked)["tools"], load_dataset(res["dataset"], HELD_OUT_SPLIT)
    new_ref = f"registry:{res['name']}@{res['version']}"
    before = measure(cfg, model, held, tools=tools, trials=trials, seed=seed)
    after = measure(cfg, new_ref, held, tools=tools, trials=trials, seed=seed)
    table = measurement_table(before, after)
    Deck("Tool learning: parent vs adapted", _html(f"{model} → {new_ref}, {len(held)} held-out tasks\n\n{table}"))
    return json.dumps({"parent": before, "adapted": after, "parent_ref": model, "adapted_ref": new_ref,
                       "n_tasks": len(held), "table": table}, default=str)


def _html(markdown: str) -> str:
    from markdown_it import (
        MarkdownIt,  # flytekit's own markdown renderer; tables need enabling
    )

    return MarkdownIt("commonmark").enable("table").render(markdown)
