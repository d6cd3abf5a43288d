"""Strict JSON decoding shared by the role parsers: NaN/Infinity constants and trailing text are rejected."""

from __future__ import annotations

import json
from typing import Any


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def strict_json(text: str) -> Any:
    """`json.loads` that also rejects NaN / Infinity. Raises `ValueError` for anything that is not one
    JSON value, including nesting deeper than the interpreter's recursion limit (`json` itself raises
    `RecursionError` there)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
