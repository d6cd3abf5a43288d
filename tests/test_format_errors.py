"""benchmarks/format_errors.py: its arguments (shared with iteration_profile), their checks, and the table."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import format_errors  # noqa: E402


def test_bad_arguments_are_refused_before_anything_loads():
    base = ["--dataset", "d", "--warm-start", "w"]
    with pytest.raises(SystemExit):
        format_errors.main(base + ["--tasks", "0"])
    with pytest.raises(SystemExit):
        format_errors.main(base + ["--settings", "on,maybe"])
    with pytest.raises(SystemExit):
        format_errors.main(["--tasks", "3"])  # --dataset and --warm-start are required


def test_error_class_and_table():
    assert format_errors.error_class("MalformedToolCall: unclosed <tool_call>") == "MalformedToolCall"
    assert format_errors.error_class(": x") == "unknown"
    setting = lambda on, rate: {"constrained_decoding": on, "parse_error_rate": rate, "parse_error_rate/act": None,
                                "generated_tokens": 12, "rollout_seconds": 3.4, "parse_errors_by_class": {},
                                "finish_reasons": {"act: stop": 2}}
    table = format_errors.markdown({"settings": [setting(False, 0.25), setting(True, 0.0)]})
    assert "| | unconstrained | constrained |" in table
    assert "| parse errors / generation | 0.250 | 0.000 |" in table
    assert "| ACT | — | — |" in table and "| rollout s | 3 | 3 |" in table
    assert "constrained: parse errors by class none" in table
