"""A training run's checkpoint in the artifact store: what it holds (`RunState`, the RNG states) and
how it is written (`save_run_state`) and read back (`resume_run_state`) for an exact resume."""

from __future__ import annotations

import base64
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class RunState:
    """The loop's position: `iteration` iterations done, the data `cursor` {"epoch", "position"} of
    the next draw, and the per-iteration metric records so far (`history[k]` is iteration k + 1's)."""

    iteration: int = 0
    cursor: dict[str, int] = field(default_factory=lambda: {"epoch": 0, "position": 0})
    history: list[dict[str, Any]] = field(default_factory=list)


def recover_checkpoint(store, key: str) -> list[str]:
    """Use or clean up what a checkpoint write that was killed left at store `key` (`recover_dir`
    of `LocalStore` / `S3Store`: a missing checkpoint is restored from the newest complete version
    left beside it; partial and superseded versions are removed). Returns one line per action,
    for the caller to print. Run it on one worker only, before any worker resumes.

    Raises:
        store.StoreError for storage failures.
    """
    return store.recover_dir(key)


def resume_run_state(trainer, store, key: str) -> RunState | None:
    """Restore the checkpoint committed at store `key` into `trainer` (a `PolicyTrainer`:
    adapter, optimizer, scheduler, counters, RNG states) and return its `RunState`; None when no
    checkpoint is there (a fresh run). Run `recover_checkpoint` first.

    Raises:
        trainer.CheckpointError: the checkpoint is corrupt or incompatible (nothing is changed);
        store.StoreError for storage failures.
    """
    if not store.exists(f"{key}/state.json"):
        return None
    state = trainer.load_checkpoint(str(store.get_dir(key)))
    done = state["iteration"]
    return RunState(done, state["cursor"], state["history"][:done])


def save_run_state(trainer, store, key: str, run_id: str, state: RunState) -> None:
    """Write `trainer`'s checkpoint (`PolicyTrainer.save_checkpoint`) with `state` and `run_id` in its
    state.json to a local temp directory, then commit it to store `key` (`put_dir`: a new version,
    then one atomic pointer swap, so a kill at any step leaves the previous checkpoint or this one)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer.save_checkpoint(str(Path(tmp) / "ckpt"), {
            "run_id": run_id, "iteration": state.iteration, "cursor": state.cursor, "history": state.history})
        store.put_dir(Path(tmp) / "ckpt", key)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """The python `random`, numpy and torch (CPU and every CUDA device) RNG states, JSON-able."""
    import numpy as np

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(internal), gauss],
           "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the RNGs to a `capture_rng_state` result (CUDA states only where saved and available)."""
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
