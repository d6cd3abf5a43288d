"""RNG state capture and restore for exact resume of training from a checkpoint."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


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
