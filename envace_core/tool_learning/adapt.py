"""Tool learning's adaptation run (METHOD.md §5): rehearsal-only GRPO from a registered parent, guarded against real calls of the new tools."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from envace_core import EnvaceError

if TYPE_CHECKING:
    from envace_core.config import RunConfig
from envace_core.tool_learning.inputs import NewTool, ToolExample
from envace_core.tool_learning.tasks import (
    HELD_OUT_SPLIT,
    AdaptationError,
    RealToolCallError,
    build_tasks,
    canonical_json,
    examples_sha256,
    tool_schema_sha256,
)


# ----------------------------------------------------------------------------------- adaptation run
class RealCallGuard:
    """Counts, while active, every real tool call (`Tau2Environment.step`, the only way to the real
    tau2 environment) and refuses those of the `blocked` tools: they get an error observation and are
    never executed. ``calls`` = {tool name: attempts}; ``blocked_calls`` = attempts on blocked tools.
    A context manager; patches the class, so it sees every environment made inside it."""

    def __init__(self, blocked: set[str]):
        self.blocked, self.calls = set(blocked), {}

    @property
    def blocked_calls(self) -> int:
        return sum(v for k, v in self.calls.items() if k in self.blocked)

    def __enter__(self) -> Self:
        from envace_core.envs.tau2.environment import Tau2Environment
        from envace_core.types import Observation

        self._cls, self._step, guard = Tau2Environment, Tau2Environment.step, self

        def step(env, call):
            guard.calls[call.name] = guard.calls.get(call.name, 0) + 1
            if call.name in guard.blocked:
                return Observation(content=f"Error: real call to new tool {call.name!r} refused "
                                   "during tool-learning adaptation", error=True)
            return guard._step(env, call)

        Tau2Environment.step = step
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls.step = self._step


def _adapter_settings(adapter_dir: str | None) -> dict[str, Any]:
    """train.* settings a parent adapter fixes (`train.init_adapter` must match them): LoRA r, alpha,
    target modules, and the per-role layout (act/ + rehearse/)."""
    if not adapter_dir:
        return {}
    d = Path(adapter_dir)
    per_role = (d / "act" / "adapter_config.json").is_file()
    cfg_file = d / "act" / "adapter_config.json" if per_role else d / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdaptationError(f"parent adapter {adapter_dir} has no adapter_config.json")
    lora = json.loads(cfg_file.read_text())
    mods = lora.get("target_modules") or []
    return {"lora_r": lora["r"], "lora_alpha": lora["lora_alpha"],
            "lora_target_modules": sorted([mods] if isinstance(mods, str) else mods),
            "policy_per_role": per_role}


def adaptation_config(cfg: RunConfig, parent: Any, domain: str, hidden: Sequence[str],
                      registry: str, name: str) -> RunConfig:
    """`cfg` set up for an adaptation run from `parent` (an `models.ResolvedModel`): its base
    model and adapter (`train.init_adapter`; LoRA shape taken from it), rehearsal only
    (rollout.source=imagined, reward.name=actions, reward.replay_fidelity=false: no environment call
    while scoring; train.sft_warmup_steps=0: the warm-up executes gold calls for real), data.domains =
    [domain] with `hidden`, and the registry/name to register under."""
    from envace_core.config import ConfigError, RunConfig

    d = cfg.to_dict()
    d["model"]["ref"] = parent.base_ref
    d["data"].update(domains=[domain], hidden_tools=list(hidden))
    d["rollout"].update(source="imagined")
    d["reward"].update(name="actions", replay_fidelity=False, fidelity_lambda=0.0)
    fixed = _adapter_settings(parent.adapter_dir)
    for k, v in fixed.items():  # a continued adapter keeps its shape: say so instead of silently overriding
        mine = d["train"].get(k)
        if (sorted(mine) if k == "lora_target_modules" and mine else mine) != v:
            print(f"[adapt] train.{k}={mine!r} from the config is replaced by the parent's {v!r} "
                  f"(the adaptation continues {parent.ref}'s adapter, so its shape is fixed)")
    d["train"].update(init_adapter=parent.adapter_dir, sft_warmup_steps=0, **fixed)
    d["store"].update(registry=registry, model_name=name)
    try:
        return RunConfig.model_validate(d)
    except ValueError as e:
        raise ConfigError(f"adaptation config for {domain!r} from {parent.ref!r} is invalid: {e}") from None


def _parent_lineage(parent: Any, registry: str) -> dict[str, Any]:
    """{ref, name, version, manifest_sha256, base_model} of the parent; name/version/sha None for a
    plain model (a base model with a fresh adapter)."""
    import hashlib

    from envace_core.store.registry import MANIFEST, Registry

    if parent.manifest is None:
        return {"ref": parent.ref, "name": None, "version": None, "manifest_sha256": None,
                "base_model": parent.base_ref}
    name, version = parent.manifest["name"], parent.manifest["version"]
    raw = (Registry(registry).local_dir(name, version) / MANIFEST).read_bytes()  # S3 registries too
    return {"ref": parent.ref, "name": name, "version": version,
            "manifest_sha256": hashlib.sha256(raw).hexdigest(), "base_model": parent.base_ref}


def _inputs_text(tools: Sequence[NewTool], examples: Sequence[ToolExample]) -> dict[str, str]:
    """The adaptation inputs as registry artifacts (hashed with the version): tools.json, examples.jsonl."""
    out = {"tools.json": json.dumps([{**t.spec.openai_schema(), "documentation": t.doc,
                                      **({"implementation": t.implementation} if t.implementation else {})}
                                     for t in tools], indent=2, sort_keys=True)}
    if examples:
        out["examples.jsonl"] = "".join(canonical_json({"tool": e.call.name, "arguments": e.call.arguments,
                                                    "result": e.result}) + "\n" for e in examples)
    return out


def adapt(cfg: RunConfig, model_ref: str, tools: Sequence[NewTool], examples: Sequence[ToolExample], *,
          domain: str, n_tasks: int, registry: str | None = None, name: str | None = None) -> dict[str, Any]:
    """Teach `model_ref` the new `tools` by rehearsal only and register the result.

    1. Parent: `models.resolve_model_ref` (``registry:NAME@VERSION`` is verified first; a plain
       path/``bundled:`` ref is the base model with a fresh adapter). Its hidden tools
       (``data.hidden_tools`` of its manifest config, plus `cfg`'s) stay hidden unless re-added.
    2. Tasks: `build_adaptation_tasks` (n = `n_tasks`, seed = ``train.seed``), written as a dataset
       with `stages.write_dataset` (train + held-out split "test"), gate report included.
    3. Training: `stages.rollout_and_train` with `adaptation_config` (imagined rollouts, `actions`
       reward, no fidelity replay, starting from the parent's adapter), inside a `RealCallGuard`:
       any real call of a new tool is refused and raises `RealToolCallError` after the run (nothing
       registered). Re-running the same command resumes the run's checkpoint.
    4. Registration: `stages.register` under `name` (default: the parent's name, else
       ``store.model_name``) in `registry` (default ``store.registry``); the manifest adds `parent`
       {ref, name, version, manifest_sha256, base_model}, `tools` [{name, schema_sha256}],
       `examples_sha256`, and `adaptation` {domain, tasks, hidden, real calls}; tools.json and
       examples.jsonl are artifacts.

    Returns {"name", "version", "path", "manifest" (its path), "dataset" (the `stages.load_dataset`
    dict; split "test" = held-out tasks), "trained" {run_id, adapter_dir, learning_signal,
    iterations}, "tasks" {train, held_out}, "real_calls_to_new_tools": 0, "real_calls": {tool: n}}.
    Raises `models.ModelRefError`, `AdaptationError`, `stages.gates.GateFailed`, `config.ConfigError`.
    """
    from envace_core.envs.tau2.tasks import domain_static
    from envace_core.models import resolve_model_ref
    from envace_core.stages.dataset import task_record, write_dataset
    from envace_core.stages.preflight import preflight
    from envace_core.stages.register import register
    from envace_core.stages.train import rollout_and_train

    registry = registry or cfg.store.registry
    parent = resolve_model_ref(model_ref, registry)
    domain_tools = {t.name for t in domain_static(domain)[0]}
    inherited = (((parent.manifest or {}).get("config") or {}).get("data") or {}).get("hidden_tools") or []
    hidden = sorted((set(inherited) | set(cfg.data.hidden_tools)) & domain_tools)
    name = name or (parent.manifest or {}).get("name") or cfg.store.model_name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name):
        raise AdaptationError(f"registry name {name!r}: use letters, digits, '.', '_' or '-' (e.g. envace-policy)")
    acfg = adaptation_config(cfg, parent, domain, hidden, registry, name)
    try:  # model, store, registry, parent adapter, engine: fail now, not after the tasks are built
        preflight(acfg)
    except EnvaceError as e:
        hint = (f" (a registry version is written registry:{model_ref})"
                if "@" in model_ref and not model_ref.startswith(("registry:", "s3://", "bundled:")) else "")
        raise AdaptationError(f"--model {model_ref!r} cannot be used: {e}{hint}") from e
    built, gate = build_tasks(domain, tools, examples, n_tasks, acfg.train.seed, 0.3, hidden)
    train, held = built["train"], built["held_out"]
    blocked = {t.spec.name for t in tools} & domain_tools
    dataset = {**write_dataset(acfg, [task_record(t) for t in train + held], gate, {
        "domains": [domain], "n_train": len(train), "n_test": len(held),
        "splits": {"train": "train", "test": HELD_OUT_SPLIT}, "source": "envace tool learning",
        "tools": [t.spec.name for t in tools], "hidden_tools": hidden}),
        "n_train": len(train), "n_test": len(held),
        "dvc": {"tracked": False, "reason": "adaptation dataset: data.dvc tracks the curated dataset"}}
    print(f"[adapt-tools] dataset {dataset['version']}: {len(train)} train / {len(held)} held-out tasks "
          f"needing {sorted(t.spec.name for t in tools)} -> {dataset['dir']}")
    with RealCallGuard({t.spec.name for t in tools}) as guard:
        trained = rollout_and_train(acfg, dataset)
    if guard.blocked_calls:
        raise RealToolCallError(f"{guard.blocked_calls} real call(s) to new tools were attempted during "
                                f"adaptation ({guard.calls}); refused, and the model was not registered")
    print(f"[adapt-tools] real tool calls during training: {sum(guard.calls.values())} "
          f"(new tools: {guard.blocked_calls})")
    lineage = {
        "parent": _parent_lineage(parent, registry),
        "tools": [{"name": t.spec.name, "schema_sha256": tool_schema_sha256(t.spec)} for t in tools],
        "examples_sha256": examples_sha256(examples),
        "adaptation": {"domain": domain, "n_train": len(train), "n_held_out": len(held), "hidden_tools": hidden,
                       "real_calls_to_new_tools": guard.blocked_calls, "real_calls": dict(guard.calls),
                       "new_domain_tools": sorted(blocked)},
    }
    reg = register(acfg, dataset, trained, {"metrics": {}, "gate": None},
                          {"summary": {}, "note": "not evaluated here: see tool_learning.measure"},
                          extra_manifest=lineage, extra_artifacts=_inputs_text(tools, examples))
    return {**reg, "dataset": dataset, "tasks": {"train": len(train), "held_out": len(held)},
            "trained": {"run_id": trained["run_id"], "adapter_dir": trained["adapter_dir"],
                        "learning_signal": trained["learning_signal"], "iterations": len(trained["history"])},
            "real_calls_to_new_tools": guard.blocked_calls, "real_calls": dict(guard.calls)}
