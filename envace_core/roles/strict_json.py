"""Strict JSON decoding shared by the role parsers: NaN/Infinity constants and trailing text are rejected."""

from __future__ import annotations

import json
from typing import Any


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def strict_json(text: str) -> Any:
    """`json.loads` that also rejects NaN / Infinity."""
    return json.loads(text, parse_constant=_reject_constant)
