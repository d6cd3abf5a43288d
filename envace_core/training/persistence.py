"""The policy trainer's files: LoRA adapter directories and checkpoints for an exact resume.

`TrainerPersistence` is the part of `PolicyTrainer` (which inherits it) that writes and reads them:
`save_adapter` / `load_adapter` (peft's `save_pretrained` layout, act/ and rehearse/ subdirectories
for a per-role policy; a saved adapter's LoRA config and tensor names and shapes are checked against
the trainer's before anything is loaded) and `save_checkpoint` / `load_checkpoint` (adapter, AdamW
and LR-scheduler state, update counters and RNG states in format `CHECKPOINT_FORMAT`, checked against
CHECKSUMS.json when the directory came from the artifact store). Writes are atomic (`atomic_dir`);
a checkpoint being read is never modified. Failures raise `AdapterLoadError` or `CheckpointError`,
whose messages name the file or the mismatch. `envace_core.training.trainer` re-exports every public
name defined here.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from envace_core import EnvaceError
from envace_core.store.files import CHECKSUMS, atomic_dir, dir_checksums
from envace_core.training.checkpoint import capture_rng_state, restore_rng_state

CHECKPOINT_FORMAT = 2  # 1 (adapter + history only) cannot resume exactly


class AdapterLoadError(EnvaceError):
    """A saved LoRA adapter directory is missing, corrupt, or does not match this trainer's LoRA config."""


class CheckpointError(EnvaceError):
    """A training checkpoint is missing, corrupt or incompatible; nothing in it was changed."""


class TrainerPersistence:
    """Adapter and checkpoint files of a `PolicyTrainer`, as methods it inherits.

    The class that inherits them provides `model` (the PeftModel holding the adapter(s)),
    `optimizer` and `scheduler` (AdamW and its LR schedule), the counters `updates` and
    `optimizer_steps`, and `_reset_optimizer()` (a fresh AdamW and LR schedule positioned at
    iteration `updates`).
    """

    def save_adapter(self, directory: str) -> None:
        """Write the LoRA adapter(s) (peft `save_pretrained`: adapter_config.json +
        adapter_model.safetensors; a per-role policy writes act/ and rehearse/ subdirectories) to
        `directory`, atomically: built in a temp sibling, then renamed into place (an existing
        directory is swapped out and removed), so a reader never sees half."""
        atomic_dir(directory, lambda tmp: self.model.save_pretrained(str(tmp)))

    def load_adapter(self, directory: str) -> None:
        """Load LoRA weights saved by `save_adapter` into `self.model` in place (an engine sharing the
        model sees them at once) and reset the optimizer state (its moments belonged to other
        weights); the LR schedule keeps its position (`self.updates`).

        Raises:
            AdapterLoadError: the directory or its files are missing or unreadable, its LoRA config
                (r, alpha, target modules) differs from this trainer's, or its tensors do not match
                this model's adapter (names or shapes). Nothing is loaded then.
        """
        states = {name: self._read_adapter(Path(directory), name) for name in self.model.peft_config}
        from peft.utils import set_peft_model_state_dict

        for name, state in states.items():
            set_peft_model_state_dict(self.model, state, adapter_name=name)
        self._reset_optimizer()

    def _read_adapter(self, root: Path, name: str) -> dict:
        """The checked tensors of adapter `name` saved under `root` (peft's layout)."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import load_file

        d = root if name == "default" else root / name
        cfg_file, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
        for f in (cfg_file, weights):
            if not f.is_file():
                raise AdapterLoadError(f"cannot load adapter {name!r} from {d}: {f.name} is missing "
                                       "(expected a directory written by PolicyTrainer.save_adapter "
                                       "with the same train.policy_per_role)")
        try:
            saved = json.loads(cfg_file.read_text())
        except Exception as e:  # noqa: BLE001  (json raises assorted types on corrupt files)
            raise AdapterLoadError(f"adapter in {d} is corrupt: {cfg_file.name}: {type(e).__name__}: {e}") from e
        try:
            state = load_file(str(weights))
        except Exception as e:  # noqa: BLE001  (safetensors raises assorted types on corrupt files)
            raise AdapterLoadError(f"adapter in {d} is corrupt: {weights.name}: {type(e).__name__}: {e}") from e
        ours = self.model.peft_config[name]
        theirs = (saved.get("r"), saved.get("lora_alpha"), sorted(saved.get("target_modules") or []))
        if theirs != (ours.r, ours.lora_alpha, sorted(ours.target_modules)):
            raise AdapterLoadError(f"adapter in {d} has (r, alpha, target_modules) = {theirs}; this "
                                   f"trainer uses {(ours.r, ours.lora_alpha, sorted(ours.target_modules))}")
        expected = {k: v.shape for k, v in get_peft_model_state_dict(self.model, adapter_name=name).items()}
        got = {k: v.shape for k, v in state.items()}
        if expected != got:
            missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
            bad = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
            raise AdapterLoadError(f"adapter in {d} does not fit this model: missing {missing[:3]}, "
                                   f"unexpected {extra[:3]}, shape mismatch {bad[:3]}")
        return state

    # --- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, state: dict[str, Any]) -> None:
        """Write everything needed to resume exactly, atomically (`atomic_dir`) into `directory`:
        adapter/ (`save_adapter`), trainer_state.pt (AdamW and LR-scheduler state dicts, updates,
        optimizer_steps) and state.json = the caller's JSON-able `state` (e.g. data cursor, history)
        + format + updates + optimizer_steps + rng (`capture_rng_state`, taken now)."""
        def build(tmp: Path) -> None:
            self.model.save_pretrained(str(tmp / "adapter"))
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "updates": self.updates, "optimizer_steps": self.optimizer_steps},
                       tmp / "trainer_state.pt")
            meta = {"format": CHECKPOINT_FORMAT, "updates": self.updates,
                    "optimizer_steps": self.optimizer_steps, "rng": capture_rng_state()}
            (tmp / "state.json").write_text(json.dumps({**state, **meta}, default=str))

        atomic_dir(directory, build)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Restore a `save_checkpoint` directory: adapter weights, optimizer and scheduler state,
        counters and the RNG states (python, numpy, torch). Every file is read and checked (against
        CHECKSUMS.json when the directory came from the artifact store) before anything changes.

        Returns:
            the saved state.json (the caller's state plus format, updates, optimizer_steps, rng).

        Raises:
            CheckpointError: the directory is missing, a file is corrupt, missing or from an
                incompatible run (LoRA config, per-role setting, format); the message names the file.
                The checkpoint itself is never modified.
        """
        d = Path(directory)
        fix = (f"Nothing was changed. Restore the checkpoint, or move {d} away to restart the run "
               "from the beginning.")
        if not d.is_dir():
            raise CheckpointError(f"no checkpoint directory at {d}")
        if (d / CHECKSUMS).is_file():
            try:
                expected = json.loads((d / CHECKSUMS).read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"checkpoint {d}: {CHECKSUMS} is corrupt ({e}). {fix}") from e
            actual = {k: v for k, v in dir_checksums(d).items() if k != CHECKSUMS}
            bad = sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))
            if bad:
                raise CheckpointError(f"checkpoint {d} is corrupt: {bad[:5]} differ from {CHECKSUMS}. {fix}")
        def read(name: str, load: Callable[[Path], Any]) -> Any:
            try:
                return load(d / name)
            except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, EnvaceError) as e:
                raise CheckpointError(f"cannot resume from checkpoint {d}: {name} is missing or unreadable "
                                      f"({type(e).__name__}: {e}). {fix}") from e

        state = read("state.json", lambda f: json.loads(f.read_text()))
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"checkpoint {d} has format {found!r} in state.json, this version "
                                  f"resumes format {CHECKPOINT_FORMAT} only (optimizer, RNG and data "
                                  f"cursor are needed to resume exactly). {fix}")
        saved = read("trainer_state.pt", lambda f: torch.load(f, map_location="cpu", weights_only=True))
        try:
            states = {name: self._read_adapter(d / "adapter", name) for name in self.model.peft_config}
        except EnvaceError as e:  # AdapterLoadError: names the adapter file or the mismatch
            raise CheckpointError(f"cannot resume from checkpoint {d}: {e}. {fix}") from e
        from peft.utils import set_peft_model_state_dict

        for name, adapter_state in states.items():
            set_peft_model_state_dict(self.model, adapter_state, adapter_name=name)
        self.updates, self.optimizer_steps = int(saved["updates"]), int(saved["optimizer_steps"])
        self._reset_optimizer()
        try:
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"optimizer state in {d} does not fit this trainer: {e}. {fix}") from e
        restore_rng_state(state["rng"])
        return state
