"""Training metrics in TensorBoard: every iteration's metrics record as scalars, beside the checkpoints.

The event files are written with `torch.utils.tensorboard.SummaryWriter` (the `tensorboard`
package's format), so `tensorboard --logdir <folder>` or any TensorBoard reader (e.g.
`tensorboard.backend.event_processing.event_accumulator.EventAccumulator`) opens them. One scalar per
numeric key of the record (`reward_mean/act`, `frac_zero_std`, `train/loss`, `train/kl`, ...), with the
iteration number (1-based) as the global step; non-numeric and non-finite values are left out (the
console table and the checkpoint's history keep them).

The folder is rebuilt from the whole history every time (`write_history`), not appended to: the history
is part of every checkpoint, so a resumed run writes exactly what an uninterrupted one would, with no
duplicated or orphaned steps from an attempt that was killed after its last checkpoint.
"""

from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

# the store key of a training run's TensorBoard folder, beside `runs/<run_id>/checkpoint`
TENSORBOARD_KEY = "runs/{run_id}/tensorboard"


def tensorboard_command(logdir: str) -> str:
    """The command that opens `logdir` in TensorBoard: the ``tensorboard`` script of the environment this
    Python runs in (e.g. ``/repo/.venv/bin/tensorboard``, which is not on PATH unless the venv is
    activated), or plain ``tensorboard`` when there is none beside the interpreter."""
    script = Path(sys.executable).with_name("tensorboard")
    return f"{script if script.is_file() else 'tensorboard'} --logdir {logdir}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite entries of one metrics record as floats (bools and strings dropped)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, Real):
            continue
        value = float(value)
        if math.isfinite(value):
            out[str(key)] = value
    return out


def write_history(history: Sequence[Mapping[str, Any]], logdir: str | Path) -> Path:
    """Write `history` (one metrics record per iteration, iteration 1 first) as TensorBoard scalars.

    Replaces whatever `logdir` held, so the folder always holds exactly this history. Each record's
    "iteration" key gives its step when present, else its 1-based position. Returns `logdir`.

    Raises OSError when the folder cannot be written.
    """
    from torch.utils.tensorboard import SummaryWriter

    logdir = Path(logdir)
    if logdir.exists():
        shutil.rmtree(logdir)
    logdir.mkdir(parents=True)
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for i, record in enumerate(history, 1):
            step = record.get("iteration", i)
            step = int(step) if isinstance(step, Real) and not isinstance(step, bool) else i
            for key, value in scalars(record).items():
                if key != "iteration":
                    writer.add_scalar(key, value, global_step=step)
    finally:
        writer.close()
    return logdir


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} read back from the event files under `logdir` (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
