"""Data-parallel training over torch.distributed workers (torch elastic, kfpytorch `Elastic`, torchrun).

The launcher sets the standard variables WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
(torch elastic's env:// rendezvous); `init_from_env` turns them into a process group: NCCL with one
GPU per worker (cuda:LOCAL_RANK) when CUDA is available, gloo on CPU otherwise. Without them, or with
WORLD_SIZE=1, nothing is initialised and every helper here is a no-op: the single-process path makes
no collective call at all.

How the training loop uses it (`training.loop.train_iteration`, `trainer.PolicyTrainer.step`):
  - rollouts: rank r rolls out the contiguous share `shard_range(T, r, W)` of the iteration's T tasks
    (whole GRPO groups), then `World.gather_shards` gives every rank the union in task order, so the
    role-wise advantages and rollout metrics are exactly those of one process;
  - each optimizer step: every rank holds the step's rows, trains its contiguous, cost-balanced share
    (`balanced_slices`) with the *global* loss normaliser (tokens or rows of the whole step), and the
    LoRA gradients are summed over ranks (`all_reduce_sum_`) before clipping and the AdamW step, so
    every rank applies the gradient a single process would compute over all rows;
  - rank 0 alone writes rollouts and checkpoints; the others wait at `barrier`.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from envace_core import EnvaceError

# One rank's rollouts can finish long after another's, and rank 0 uploads checkpoints while the
# others wait: the default collective timeout (10-30 min) would abort a healthy gpu-8b run.
TIMEOUT = timedelta(hours=2)
_REQUIRED = ("RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedSetupError(EnvaceError):
    """The torch.distributed environment variables are incomplete or inconsistent; the message names them."""


@dataclass(frozen=True)
class World:
    """This worker's place among the data-parallel workers (rank 0 of 1 when not distributed).

    `device` is where this rank's model must live for the backend's collectives: cuda:LOCAL_RANK
    under NCCL, the CPU under gloo or without a process group.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    @classmethod
    def current(cls) -> World:
        """The initialised default process group's world, or the single-process world."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return cls(dist.get_rank(), dist.get_world_size(), local, dist.get_backend())

    # --- collectives (no-ops for one worker) ------------------------------------------------------

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over ranks, in place (every rank gets the same result); returns it."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """[rank 0's obj, rank 1's obj, ...] on every rank (pickled; for rollouts and small metrics)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def gather_shards(self, items: list[Any], count: int) -> tuple[list[Any], int]:
        """Every rank's `items` concatenated in rank order, and the sum of the ranks' `count`s, on
        every rank (one `all_gather_objects`). With `shard_range` shares, rank order is item order,
        so the result is what one process would have produced; (items, count) for one process."""
        parts = self.all_gather_objects((items, count))
        return [x for xs, _ in parts for x in xs], sum(n for _, n in parts)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite `tensors` on every rank with rank `src`'s values, in place."""
        if self.enabled:
            for t in tensors:
                dist.broadcast(t.data, src=src)


def _parse(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(world size, rank, local rank) from the launcher's variables; size 1 without them."""
    raw = env.get("WORLD_SIZE", "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise DistributedSetupError(f"WORLD_SIZE={raw!r}: expected a whole number >= 1 (set by "
                                    "torchrun / torch elastic / kfpytorch Elastic)")
    size = int(raw)
    if size == 1:
        return 1, 0, 0
    missing = [k for k in _REQUIRED if not env.get(k, "").strip()]
    if missing:
        raise DistributedSetupError(f"WORLD_SIZE={size} but {', '.join(missing)} not set: start the "
                                    "workers with torchrun, torch elastic or a kfpytorch Elastic task, "
                                    "which set RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    rank, local = env["RANK"].strip(), (env.get("LOCAL_RANK", "").strip() or "0")
    if not (rank.isdigit() and local.isdigit()) or int(rank) >= size:
        raise DistributedSetupError(f"RANK={rank!r}, LOCAL_RANK={local!r}: expected whole numbers "
                                    f"with RANK < WORLD_SIZE={size}")
    return size, int(rank), int(local)


def init_from_env(env: Mapping[str, str] | None = None) -> World:
    """Join the process group the launcher's variables describe (idempotent) and return this World.

    WORLD_SIZE unset or 1: nothing is initialised, World() is returned. Otherwise the default group
    is initialised over env:// (MASTER_ADDR:MASTER_PORT) with NCCL and cuda:LOCAL_RANK as this
    process's device when CUDA is available, gloo otherwise; it is destroyed at interpreter exit.
    An already initialised group (a caller's own, e.g. a test) is used as it is.

    Raises:
        DistributedSetupError: WORLD_SIZE > 1 with RANK / MASTER_ADDR / MASTER_PORT missing, or a
            rank outside the world.
    """
    if dist.is_available() and dist.is_initialized():
        return World.current()
    size, rank, local = _parse(os.environ if env is None else env)
    if size == 1:
        return World()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)  # object collectives and NCCL use the current device
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=TIMEOUT)
    atexit.register(_destroy)
    return World.current()


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def session(env: Mapping[str, str] | None = None) -> Iterator[World]:
    """`init_from_env` for a block; a group it created is destroyed when the block ends."""
    created = not (dist.is_available() and dist.is_initialized())
    world = init_from_env(env)
    try:
        yield world
    finally:
        if created and world.enabled:
            _destroy()


def shard_range(n: int, rank: int, size: int) -> range:
    """Rank `rank`'s contiguous share of n items, sizes differing by at most one (earlier ranks
    get the extra items); empty when n < size for the last ranks."""
    q, r = divmod(n, size)
    start = rank * q + min(rank, r)
    return range(start, start + q + (rank < r))


def balanced_slices(costs: Sequence[float], size: int) -> list[range]:
    """Cut items (in their order) into `size` contiguous slices of about equal total cost.

    Item i goes to the slice whose band [k C/size, (k+1) C/size) holds the midpoint of its cost
    interval (C = total cost), so every item is in exactly one slice, the cut is deterministic
    (every rank computes the same one), and a slice is empty only when single items outweigh it.
    """
    total = float(sum(costs))
    if total <= 0:
        return [shard_range(len(costs), k, size) for k in range(size)]
    owner, before = [], 0.0
    for c in costs:
        owner.append(min(size - 1, int((before + c / 2) * size / total)))
        before += c
    return [range(owner.index(k), len(owner) - owner[::-1].index(k)) if k in owner else range(0)
            for k in range(size)]
