"""The `rollout_and_train` stage: World Rehearsal (or an ablation) training of the policy, checkpointed to the store."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.stages.console import print_training_table
from envace_core.stages.dataset import load_dataset
from envace_core.stages.warm_start import check_warm_start
from envace_core.store.uri import open_store
from envace_core.training.loop import (
    TrainingRun,
    start_or_resume,
    sync_engine,
    train_iteration,
    training_run_id,
)
from envace_core.training.policy import load_policy, policy_engine, rollout_params
from envace_core.training.tracking import TENSORBOARD_KEY, tensorboard_command, write_history


def publish_metrics(store: Any, run_id: str, history: list[dict[str, Any]]) -> str:
    """The run's metrics history as TensorBoard event files (`training.tracking.write_history`) at
    store key `runs/<run_id>/tensorboard`, rewritten whole after every iteration; returns its URI."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="envace-tb-") as tmp:
        write_history(history, tmp + "/tensorboard")
        store.put_dir(tmp + "/tensorboard", TENSORBOARD_KEY.format(run_id=run_id))
    return store.uri(TENSORBOARD_KEY.format(run_id=run_id))


def rollout_and_train(cfg: RunConfig, dataset: dict[str, Any], warm: dict[str, Any] | None = None) -> dict[str, Any]:
    """K iterations of `loop.train_iteration`: G self-unfolded rollouts per task → replay rewards →
    rows → role-wise advantages → a GRPO update (`PolicyTrainer.update`: `ppo_epochs` ×
    mini-batches, then one LR-schedule step).

    A fresh run starts from `warm`, the `stages.warm_start.warm_start` result for this config and
    dataset (its adapter; its id is part of the run id, `loop.training_run_id`), and without one from
    train.init_adapter or a fresh LoRA; a checkpoint of the run wins over both (resume). The SFT
    warm-up itself is the warm_start stage: with train.sft_warmup_steps > 0, `warm` is required.

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

    Returns:
        {"run_id", "learning_signal" (some iteration had a group with unequal rewards),
        "adapter_dir" (the checkpoint's adapter, local path), "base_model_dir", "history" (one
        metrics record per iteration), "metrics_uri" (the history as TensorBoard event files,
        `publish_metrics`), "warm_start" (`warm_start_lineage` of `warm`, None without)}.

    Raises:
        EnvaceError: the dataset has no train tasks; train.sft_warmup_steps > 0 without `warm`; a
        `warm` made with other settings (`warm_start.check_warm_start`); trainer.CheckpointError: a
        corrupt checkpoint.
    """
    from envace_core.training.distributed import init_from_env
    from envace_core.training.trainer import PolicyTrainer

    # set-up: store, tasks, workers, policy + trainer + engine, then the checkpoint or a warm start
    if warm is None and cfg.train.sft_warmup_steps > 0:
        raise EnvaceError(f"train.sft_warmup_steps={cfg.train.sft_warmup_steps}: the SFT warm start is its own "
                          "stage; pass warm=stages.warm_start.warm_start(cfg, dataset) (the train workflow and "
                          "`envace train` do), or set train.sft_warmup_steps=0")
    if warm is not None:
        check_warm_start(cfg, dataset, warm)
    store = open_store(cfg.store.root)
    run_id = training_run_id(cfg, dataset, warm)
    tasks = load_dataset(dataset, "train")
    if not tasks:
        raise EnvaceError(f"dataset {dataset['version']} has no train tasks: re-run curate")
    world = init_from_env()
    model, tok, base = load_policy(cfg)
    if world.enabled:
        model.to(world.device)  # cuda:LOCAL_RANK under NCCL; the trainer broadcasts rank 0's LoRA
    trainer = PolicyTrainer(model, tok, cfg.train, compute_dtype=cfg.model.compute_dtype)
    run = TrainingRun(cfg, tasks, trainer, policy_engine(cfg, trainer.model, tok), rollout_params(cfg),
                      world, store, run_id)
    run.say(f"[train] compute dtype {trainer.compute_dtype} (model.compute_dtype={cfg.model.compute_dtype})")
    state = start_or_resume(run, warm)
    sync_engine(run)  # a vLLM engine serves a copy of the weights: start it from the trainer's
    per_it = cfg.rollout.tasks_per_iteration
    if world.enabled:
        run.say(f"[train] data parallel over {world.size} workers ({world.backend}): rollouts of "
                f"{per_it} tasks/iteration split by task, every optimizer step all-reduced"
                + (f"; WARNING: {world.size - per_it} workers get no task to roll out "
                   f"(rollout.tasks_per_iteration < {world.size})" if per_it < world.size else ""))
    # the iterations
    bar = tqdm(range(state.iteration, cfg.train.iterations), desc="rollout+train", unit="it",
               initial=state.iteration, total=cfg.train.iterations, disable=not world.is_main)
    for _ in bar:
        rec = train_iteration(run, state)
        bar.set_postfix(reward=f"{rec.get('reward_mean/act', 0):.2f}", secs=f"{rec['seconds']:.0f}")
        if world.is_main:
            publish_metrics(store, run_id, state.history)
    # the result
    history = state.history
    if world.is_main:
        print_training_table(history, cfg.rollout.source)
        run.say(f"[train] metrics: {tensorboard_command(store.uri(TENSORBOARD_KEY.format(run_id=run_id)))}")
    if history and all(r.get("frac_zero_std") == 1.0 or "train/loss" not in r for r in history):
        run.say("[train] WARNING: no learning signal in any iteration: every group's trajectories got "
                "equal rewards (frac_zero_std = 1), so every advantage was 0 and the adapter did not "
                "move. Use more tasks/iterations, a larger group, or a model that follows the "
                "<tool_call> format.")
    signal = any(r.get("frac_zero_std", 1.0) < 1.0 for r in history)
    return {"run_id": run_id, "learning_signal": signal,
            "adapter_dir": str(store.get_dir(run.checkpoint_key) / "adapter"),
            "base_model_dir": str(base), "compute_dtype": trainer.compute_dtype, "history": history,
            "metrics_uri": store.uri(TENSORBOARD_KEY.format(run_id=run_id)),
            "warm_start": warm_start_lineage(warm)}


def warm_start_lineage(warm: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the registered manifest records of the warm start a run started from: {"warm_start_id",
    "adapter_uri", "init_adapter", "examples" {role: n}, "losses" {unit: per-step losses}, "steps",
    "seconds", "mixed_warm_start" (a two-phase warm start's first phase, else None)}; None without one."""
    if warm is None:
        return None
    return {k: warm.get(k) for k in ("warm_start_id", "adapter_uri", "init_adapter", "examples", "losses",
                                     "steps", "seconds", "mixed_warm_start")}
