"""One World Rehearsal / GRPO iteration, read top to bottom (METHOD.md §3), and the helpers it calls."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.evaluation.stats import mean_or_none
from envace_core.store.files import dir_checksums, sha256_bytes
from envace_core.store.uri import open_store
from envace_core.types import Role, Task, Trajectory


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
    out["parse_error_rate"] = mean_or_none([float(g.parse_error is not None) for g in gens])
    return out


# ------------------------------------------------------------------------------ rollout + train
def training_run_id(cfg: RunConfig, dataset: dict[str, Any]) -> str:
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
    from envace_core.store.base import StoreError

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


def load_init_adapter(trainer, ref: str) -> None:
    """Copy the weights of adapter `ref` into the trainer's fresh LoRA in place (no second model;
    `PolicyTrainer.load_adapter`: a per-role policy reads act/ and rehearse/). Raises
    trainer.AdapterLoadError naming train.init_adapter when the adapter is missing, corrupt, or has
    another LoRA config or layout than train.*."""
    from envace_core.training.trainer import AdapterLoadError

    try:
        trainer.load_adapter(str(init_adapter_dir(ref)))
    except AdapterLoadError as e:
        raise AdapterLoadError(f"train.init_adapter={ref!r}: {e}. Use the parent's LoRA settings "
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
