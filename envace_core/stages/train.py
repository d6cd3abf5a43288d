"""The `rollout_and_train` stage: World Rehearsal (or an ablation) training of the policy, checkpointed to the store."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

if TYPE_CHECKING:
    pass
from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.stages.console import print_training_table
from envace_core.stages.dataset import load_dataset
from envace_core.store.uri import open_store
from envace_core.training.loop import (
    load_init_adapter,
    next_tasks,
    rollout_metrics,
    training_run_id,
)
from envace_core.training.policy import load_policy, policy_engine, rollout_params
from envace_core.types import Trajectory


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

    from envace_core.training.distributed import init_from_env, shard_range
    from envace_core.training.grpo import role_advantages
    from envace_core.training.rewards import generation_rewards
    from envace_core.training.rollout import training_group
    from envace_core.training.rows import TrainingRow
    from envace_core.training.sft import act_examples, sft_warmup
    from envace_core.training.trainer import PolicyTrainer

    store = open_store(cfg.store.root)
    run_id = training_run_id(cfg, dataset)
    ckpt_key = f"runs/{run_id}/checkpoint"
    tasks = load_dataset(dataset, "train")
    if not tasks:
        raise EnvaceError(f"dataset {dataset['version']} has no train tasks: re-run curate")
    world = init_from_env()
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
            load_init_adapter(trainer, cfg.train.init_adapter)
            say(f"[train] starting from the LoRA adapter {cfg.train.init_adapter}")
        if cfg.train.sft_warmup_steps > 0:  # fresh run only: a checkpoint already holds the warmed-up adapter
            from envace_core.training.distributed import init_from_env, shard_range
            from envace_core.training.sft import act_examples, sft_warmup

            examples = act_examples(tasks, tok, cfg.data.policy_max_chars, max_turns=cfg.rollout.max_turns,
                                        max_tokens=cfg.train.sft_max_tokens)
            if not examples:
                raise EnvaceError(f"train.sft_warmup_steps={cfg.train.sft_warmup_steps} but no train task has a "
                                  f"gold ACT turn within rollout.max_turns={cfg.rollout.max_turns} and "
                                  f"train.sft_max_tokens={cfg.train.sft_max_tokens} tokens")
            losses = sft_warmup(trainer, examples, cfg.train.sft_warmup_steps, cfg.train.sft_learning_rate,
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
        picked, cursor = next_tasks(len(tasks), cfg.train.seed, cursor, per_it)
        batch = [tasks[i] for i in picked]
        trajs: list[Trajectory] = []
        gen_before = dict(engine.stats)
        mine = shard_range(len(batch), world.rank, world.size)  # whole GRPO groups
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
               **rollout_metrics(trajs), **adv_stats,
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
