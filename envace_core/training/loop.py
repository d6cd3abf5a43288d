"""One World Rehearsal / GRPO training iteration, read top to bottom (METHOD.md §3), and the helpers it calls.

`train_iteration` is the whole iteration: draw tasks -> rollouts (scored: rewards) -> rows ->
advantages -> update -> metrics -> checkpoint. What it needs lives in a `TrainingRun` (built by
`stages.train.rollout_and_train`); where it stands lives in a `checkpoint.RunState`. Resume or the
start from the warm start's adapter (`start_or_resume`; the SFT warm start itself is the stage
`stages.warm_start`), the data-parallel gather (`roll_out`), the vLLM weight sync (`sync_engine`) and
checkpoint writes (`checkpoint_if_due`) are the helpers below it.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.evaluation.stats import mean_or_none
from envace_core.store.files import dir_checksums, sha256_bytes
from envace_core.store.uri import init_adapter_dir, open_store
from envace_core.training.checkpoint import RunState, recover_checkpoint, resume_run_state, save_run_state
from envace_core.training.heap import release_free_heap
from envace_core.types import Role, Task, Trajectory

if TYPE_CHECKING:
    from envace_core.engines.base import Engine
    from envace_core.store.local import LocalStore
    from envace_core.store.s3 import S3Store
    from envace_core.training.distributed import World
    from envace_core.training.rollout import RolloutParams
    from envace_core.training.trainer import PolicyTrainer
    from envace_core.training.transitions import Transition


@dataclass
class TrainingRun:
    """Everything an iteration uses: the config, the train tasks, the trainer and the engine sharing
    its model, the rollout parameters, this worker's `World`, the artifact store and the run id."""

    cfg: RunConfig
    tasks: list[Task]
    trainer: PolicyTrainer
    engine: Engine
    params: RolloutParams
    world: World
    store: LocalStore | S3Store
    run_id: str
    transitions: list[Transition] | None = None  # `train_transitions`, built on first use

    @property
    def checkpoint_key(self) -> str:
        return f"runs/{self.run_id}/checkpoint"

    def say(self, *args, **kwargs) -> None:
        """print, on rank 0 only."""
        if self.world.is_main:
            print(*args, **kwargs)


def train_iteration(run: TrainingRun, state: RunState) -> dict[str, Any]:
    """Iteration `state.iteration + 1`: appends its metrics record to `state.history`, returns it."""
    import torch

    from envace_core.training.grpo import advantage_estimator, estimate_advantages
    from envace_core.training.rows import rows_from_group, trainable_rows

    cfg, it, t0 = run.cfg, state.iteration, time.perf_counter()
    torch.manual_seed(cfg.train.seed + it)
    # 1. draw the next tasks from the data cursor (one GRPO group each)
    data_at = dict(state.cursor)
    picked, state.cursor = next_tasks(len(run.tasks), cfg.train.seed, state.cursor, cfg.rollout.tasks_per_iteration)
    batch = [run.tasks[i] for i in picked]
    # 2-3. rollouts, each trajectory scored by the configured reward (`rollout.training_group`)
    gen_before = dict(run.engine.stats)
    groups = roll_out(run, batch, it)
    if hasattr(run.engine, "reset_prefix_cache"):  # the update changes the weights, so the cached KV is stale:
        run.engine.reset_prefix_cache()             # freed before the update's memory peak, not after it
    release_free_heap()  # the rollouts' freed KV pages go back to the OS before the update allocates
    gen_tokens = run.engine.stats.get("generated_tokens", 0) - gen_before.get("generated_tokens", 0)
    groups, gen_tokens = run.world.gather_shards(groups, gen_tokens)  # every rank: all groups, task order
    t_roll = time.perf_counter() - t0
    # 4. rows: one per generation; R (+ lambda * fidelity on REHEARSE rows); the group id is the
    #    group's place in this batch, so a task drawn twice gets two groups and two baselines
    rows = [row for k, group in enumerate(groups)
            for row in rows_from_group(group_id(it, k, batch[k]), group, cfg.reward.fidelity_lambda)]
    # 5. advantages: the configured registered estimator (role-wise baseline by default)
    name, options = advantage_estimator(cfg.train)
    adv_stats = estimate_advantages(rows, name, **options)
    # 6. update: PPO epochs over the valid rows of the trained roles, then the vLLM weight sync
    train_rows = trainable_rows(rows, cfg.train.trained_roles)
    run.say(f"[train] iteration {it + 1}: updating the policy on {len(train_rows)} rows "
            f"({cfg.train.ppo_epochs} epoch(s)) after {t_roll:.0f}s of rollouts", flush=True)
    train_metrics = run.trainer.update(train_rows)
    release_free_heap()  # and the update's activations before the next rollouts: each phase peaks alone
    train_metrics.update(sync_engine(run))
    # 7. metrics
    trajs = [t for group in groups for t in group]
    rec = {"iteration": it + 1, "data/epoch": data_at["epoch"], "data/position": data_at["position"],
           **rollout_metrics(trajs), "rows/masked": sum(not r.valid for r in rows), **adv_stats,
           **{f"train/{k}": v for k, v in train_metrics.items()},
           "rollout_seconds": t_roll, "rollout_tokens_per_s": gen_tokens / max(t_roll, 1e-9),
           "seconds": time.perf_counter() - t0}
    state.history.append(rec)
    state.iteration = it + 1
    # 8. the rollouts, and a checkpoint every `train.checkpoint_every` iterations and after the last
    if run.world.is_main:  # one writer; the ranks hold the same trajectories and weights
        run.store.write_bytes(f"runs/{run.run_id}/rollouts/iteration-{it + 1:04d}.jsonl",
                              "".join(t.model_dump_json() + "\n" for t in trajs).encode())
    checkpoint_if_due(run, state)
    return rec


# --------------------------------------------------------------------- helpers of the iteration
def group_id(iteration: int, k: int, task: Task) -> str:
    """The id of the k-th group of 0-based `iteration`: "<iteration + 1>/<k>/<task id>"."""
    return f"{iteration + 1}/{k}/{task.id}"


def roll_out(run: TrainingRun, batch: list[Task], iteration: int) -> list[list[Trajectory]]:
    """This rank's GRPO groups of `batch`: the contiguous share `shard_range` of its tasks, each
    rolled out by `rollout.training_group` (rollout.source, rollout.user_rehearse and reward.*
    select the branch) and scored. The seed follows the task's place k in the batch, so it does not
    depend on the rank. With ``rollout.merge_groups`` the groups run in lockstep, one thread each, their
    engine calls merged (`engines.merging.MergingEngine`): each call keeps its own seeds, so the groups
    are those of one group after another, up to float rounding of the larger batches; the engine's prefix
    KV cache then holds ``rollout.prefix_cache_tokens`` per group. One group after another, the C heap's free
    pages go back to the OS after each (`heap.release_free_heap`); merged groups finish together, so there
    the trim after all rollouts (`train_iteration`) is the only one."""
    from tqdm.auto import tqdm

    from envace_core.engines.merging import MergingEngine
    from envace_core.training.distributed import shard_range
    from envace_core.training.rollout import training_group

    cfg, world = run.cfg, run.world
    mine = shard_range(len(batch), world.rank, world.size)

    def group(engine, k: int) -> list[Trajectory]:
        return training_group(engine, batch[k], cfg, run.params, seed=cfg.train.seed * 100003 + iteration * 1009 + k)

    if cfg.rollout.merge_groups and len(mine) > 1:  # the prefix pool holds room for every group meanwhile
        return MergingEngine(run.engine).map(group, list(mine))
    groups = []
    for k in tqdm(mine, desc=f"rollouts iteration {iteration + 1}", leave=False, unit="task",
                  disable=not world.is_main):
        groups.append(group(run.engine, k))
        release_free_heap()  # a group's freed KV pages go back before the next group's differently sized ones
    return groups


def sync_engine(run: TrainingRun) -> dict[str, float]:
    """Give an engine that serves its own copy of the weights (vLLM: `sync_from`) the trainer's
    current ones; {"weight_sync_seconds": s} for it, {} for an engine sharing the model (HF)."""
    sync = getattr(run.engine, "sync_from", None)
    return {"weight_sync_seconds": sync(run.trainer.model)} if sync else {}


def checkpoint_if_due(run: TrainingRun, state: RunState) -> None:
    """After every `train.checkpoint_every`-th iteration and the last: rank 0 writes the checkpoint
    (`checkpoint.save_run_state`), every rank waits for it at a barrier (nobody runs ahead, or
    returns the adapter path, before it is written)."""
    done, cfg = state.iteration, run.cfg.train
    if done % cfg.checkpoint_every == 0 or done == cfg.iterations:
        if run.world.is_main:
            save_run_state(run.trainer, run.store, run.checkpoint_key, run.run_id, state)
        run.world.barrier()


def start_or_resume(run: TrainingRun, warm: dict[str, Any] | None = None) -> RunState:
    """The run's checkpoint restored (`checkpoint.resume_run_state`), or, for a fresh run, its
    starting adapter (`start_fresh`: the warm start `warm`, else train.init_adapter) and an empty
    state. What a killed checkpoint write left is used or removed first, by rank 0
    (`checkpoint.recover_checkpoint`), and said. REHEARSE grounding (rollout.grounding_k) is set up
    first (`ground_rehearsals`)."""
    ground_rehearsals(run)
    if run.world.is_main:
        for note in recover_checkpoint(run.store, run.checkpoint_key):
            run.say(f"[train] checkpoint recovery: {note}")
    run.world.barrier()
    state = resume_run_state(run.trainer, run.store, run.checkpoint_key)
    uri = run.store.uri(run.checkpoint_key)
    if state is not None:
        run.say(f"[train] resuming run {run.run_id} at iteration {state.iteration + 1} (epoch "
                f"{state.cursor['epoch']}, task {state.cursor['position']}, "
                f"{run.trainer.optimizer_steps} optimizer steps done; checkpoint {uri})")
        return state
    run.say(f"[train] run {run.run_id}: checkpoints -> {uri} (re-run the same command to resume)")
    start_fresh(run, warm)
    return RunState()


def start_fresh(run: TrainingRun, warm: dict[str, Any] | None) -> None:
    """Fresh runs only (a checkpoint already holds the result): copy the starting adapter into the
    trainer's LoRA (`load_init_adapter`): the warm start's ``adapter_uri`` (`stages.warm_start`,
    which applied train.init_adapter and the SFT warm-up) when `warm` is given, else
    train.init_adapter; neither: the fresh LoRA of train.seed.

    Raises trainer.AdapterLoadError naming the adapter for an unusable one; EnvaceError when the warm
    start's adapter is gone from the store."""
    if warm is None:
        ref, setting, what = run.cfg.train.init_adapter, "train.init_adapter", ""
    else:
        ref, what = warm.get("adapter_uri"), f"warm start {warm['warm_start_id']}"
        setting = f"the adapter_uri of {what}"
    if ref:
        load_init_adapter(run.trainer, ref, setting=setting)
        run.say(f"[train] starting from the LoRA adapter {ref}" + (f" ({what})" if what else ""))
    elif warm is not None:
        run.say(f"[train] starting from a fresh LoRA ({what}: no SFT warm-up, no train.init_adapter)")


def real_train_transitions(cfg: RunConfig, tasks: list[Task]) -> list[Transition]:
    """The real transitions of the train `tasks` (`transitions.real_transitions`: gold calls of the
    first rollout.max_turns turns, plus wrong calls' real errors when train.sft_error_transitions;
    test-split tasks refused)."""
    from envace_core.training.transitions import real_transitions

    return real_transitions(tasks, errors=cfg.train.sft_error_transitions, seed=cfg.train.seed,
                            forbid_splits=(cfg.data.test_split,), max_turns=cfg.rollout.max_turns)


def grounded_params(cfg: RunConfig, params: RolloutParams, transitions: list[Transition]) -> RolloutParams:
    """`params` with a `roles.grounding.GroundingIndex` over `transitions` when rollout.grounding_k > 0
    (REHEARSE prompts then show grounding examples of other tasks), else `params` unchanged."""
    from dataclasses import replace

    from envace_core.roles.grounding import GroundingIndex

    return replace(params, grounding=GroundingIndex(transitions)) if cfg.rollout.grounding_k > 0 else params


def train_transitions(run: TrainingRun) -> list[Transition]:
    """`real_train_transitions` of the run's train tasks, built once per process and kept on `run`."""
    if run.transitions is None:
        run.transitions = real_train_transitions(run.cfg, run.tasks)
    return run.transitions


def ground_rehearsals(run: TrainingRun) -> None:
    """With rollout.grounding_k > 0, REHEARSE prompts of the run's rollouts get grounding examples from
    a `roles.grounding.GroundingIndex` over `train_transitions` (other tasks only; `grounded_params`)."""
    if run.cfg.rollout.grounding_k > 0:
        run.params = grounded_params(run.cfg, run.params, train_transitions(run))
        run.say(f"[train] REHEARSE grounding: {run.cfg.rollout.grounding_k} examples of "
                f"{len(run.transitions)} real train transitions, ≤ {run.cfg.rollout.grounding_max_tokens} tokens")


def score(task: Task, traj: Trajectory, format_penalty: float = 0.0, reward_fn=None) -> Trajectory:
    """Score a trajectory (METHOD.md §2; default: the `replay` reward) and apply tau2's termination rule.

    `rewards.score_trajectory`: the reward function (`reward_fn`, default `rewards.replay_reward`;
    evaluation always uses replay) runs for every trajectory, and the real observations and the
    rehearsal fidelity are filled too, but, as in tau2's `evaluate_simulation`, only a trajectory
    that ended cleanly (the agent's message, or the rehearsed user's stop token) keeps its score:
    one stopped by the turn limit gets 0, one stopped by an unparseable output gets
    `format_penalty`. A scoring failure leaves `reward=None` (masked).
    """
    from envace_core.training.rewards import score_trajectory

    return score_trajectory(task, traj, reward_fn, format_penalty)


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, Any]:
    """Rollout metrics of one iteration: trajectories, fidelity, success_rate, per role
    ``parse_error_rate/<role>`` and ``rows/<role>``, ``schema_error_rate/act`` (well-formed calls of an
    unknown tool or with invalid arguments, answered as tool errors: not parse errors),
    ``parse_error_rate`` over all generations,
    ``termination/<name>`` = trajectories ended that way (``termination/prompt_too_long`` always, 0
    when none), ``masked_trajectories`` (reward None: their rows carry no loss), and the real
    environment's tool calls ``env_steps/rollout`` (made by the rollouts: standard GRPO's; World
    Rehearsal's are 0) and ``env_steps/reward`` (made while scoring: replays, gold transpositions),
    summed from each trajectory's ``reward_info["env_steps"]`` (`rollout.training_group`)."""
    from envace_core.training.rollout import PROMPT_TOO_LONG

    gens = [g for t in trajs for g in t.generations]
    fid = [s.fidelity for t in trajs for s in t.steps if s.fidelity is not None]
    out: dict[str, Any] = {"trajectories": len(trajs), "fidelity": mean_or_none(fid),
                           "fidelity_n": len(fid),
                           "success_rate": mean_or_none([float((t.reward or 0) >= 1.0) for t in trajs])}
    for role in (Role.ACT, Role.REHEARSE, Role.USER):
        rg = [g for g in gens if g.role == role]
        if role == Role.USER and not rg:
            continue  # USER-REHEARSE off: keep the training table as it was
        out[f"parse_error_rate/{role.value}"] = mean_or_none([float(g.parse_error is not None) for g in rg])
        out[f"rows/{role.value}"] = len(rg)
        if role == Role.ACT:
            out["schema_error_rate/act"] = mean_or_none([float(g.schema_error is not None) for g in rg])
    out["parse_error_rate"] = mean_or_none([float(g.parse_error is not None) for g in gens])
    out[f"termination/{PROMPT_TOO_LONG}"] = 0
    for t in trajs:
        key = f"termination/{t.termination or 'unknown'}"
        out[key] = out.get(key, 0) + 1
    out["masked_trajectories"] = sum(t.reward is None for t in trajs)
    for phase in ("rollout", "reward"):
        out[f"env_steps/{phase}"] = sum(int((t.reward_info.get("env_steps") or {}).get(phase, 0)) for t in trajs)
    return out


# ----------------------------------------------------------------- run identity, init adapter, data
def training_run_id(cfg: RunConfig, dataset: dict[str, Any], warm: dict[str, Any] | None = None) -> str:
    """The run's id (12 hex digits of a sha256): the config (store.* aside), the dataset version and
    what the run starts from: the warm start's id (`stages.warm_start.warm_start_id`: base model and
    init adapter content, SFT settings) when `warm` is given, else train.init_adapter's content."""
    d = cfg.to_dict()
    d.pop("store", None)
    key: list[Any] = [d, dataset["version"]]
    if warm is not None:
        key.append({"warm_start_id": warm["warm_start_id"]})
    elif cfg.train.init_adapter:  # the adapter's content, not only its path, decides the run
        key.append(dir_checksums(init_adapter_dir(cfg.train.init_adapter)))
    return sha256_bytes(json.dumps(key, sort_keys=True).encode())[:12]


def load_init_adapter(trainer, ref: str, setting: str = "train.init_adapter") -> None:
    """Copy the weights of adapter `ref` into the trainer's fresh LoRA in place (no second model;
    `PolicyTrainer.load_adapter`: a per-role policy reads act/ and rehearse/). Raises
    trainer.AdapterLoadError naming `setting` (where `ref` came from) when the adapter is missing,
    corrupt, or has another LoRA config or layout than train.*."""
    from envace_core.training.trainer import AdapterLoadError

    try:
        trainer.load_adapter(str(init_adapter_dir(ref, setting)))
    except AdapterLoadError as e:
        raise AdapterLoadError(f"{setting}={ref!r}: {e}. Use the parent's LoRA settings "
                               "(train.lora_r, lora_alpha, lora_target_modules, policy_per_role)") from e


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` visits the n train tasks: a seeded shuffle per epoch."""
    order = list(range(n))
    random.Random(seed + 1_000_003 * epoch).shuffle(order)
    return order


def next_tasks(n: int, seed: int, cursor: dict[str, int], k: int) -> tuple[list[int], dict[str, int]]:
    """Indices of the next k of n train tasks from the data cursor {"epoch", "position"} and the
    cursor after them; a batch that reaches the end of an epoch continues in the next one's order,
    and a cursor at the end of an epoch is moved to the start of the next (epoch + 1, 0)."""
    epoch, pos, out = cursor["epoch"], cursor["position"], []
    while len(out) < k:
        take = epoch_order(n, seed, epoch)[pos:pos + k - len(out)]
        out, pos = out + take, pos + len(take)
        if pos >= n:
            epoch, pos = epoch + 1, 0
    return out, {"epoch": epoch, "position": pos}
