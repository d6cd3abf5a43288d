"""benchmarks/iteration_profile.py: op categories, the phase timer's nesting (time counts in the innermost
phase only), the op timer's totals, and the report table."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

import envace_core  # noqa: F401  (offline environment before tau2)
from tests.benchmark_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
ip = load_benchmark("iteration_profile")


def test_ops_fall_in_their_categories():
    assert ip.category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert ip.category("aten::mm") == "matmul" and ip.category("aten::linear") == "matmul"
    assert ip.category("aten::_log_softmax") == "softmax / log-softmax"
    assert ip.category("aten::cumsum") == "sampling"
    assert ip.category("aten::_to_copy") == "copy and cast"
    assert ip.category("aten::_foreach_addcdiv_") == "optimizer"
    assert ip.category("aten::silu_backward") == "elementwise"
    assert ip.category("aten::empty_strided") == "other"


def test_nested_phases_count_in_the_innermost_only(monkeypatch):
    clock = [0.0]  # a fake clock: no sleeping, no timing in the test
    monkeypatch.setattr(ip.time, "perf_counter", lambda: clock[0])
    owner = types.SimpleNamespace()

    def inner():
        clock[0] += 5.0

    def outer():
        clock[0] += 2.0
        owner.inner()

    owner.inner, owner.outer = inner, outer
    timer = ip.PhaseTimer()
    timer.wrap(owner, "inner", "inner phase")
    timer.wrap(owner, "outer", lambda: "outer phase")
    owner.outer()
    assert timer.calls == {"inner phase": 1, "outer phase": 1}
    assert timer.seconds == {"inner phase": 5.0, "outer phase": 2.0}  # the outer phase's own time only


def test_op_timer_sees_forward_backward_and_inference_ops():
    timer = ip.OpTimer()
    lin = torch.nn.Linear(8, 8)
    with timer.mode:
        lin(torch.randn(4, 8)).sum().backward()
        with torch.inference_mode():
            lin(torch.randn(2, 8))
    assert timer.calls["addmm"] == 1 and timer.calls["mm"] >= 1  # forward, then the weight gradient
    assert all(s >= 0 for s in timer.seconds.values())


def test_report_table_lists_phases_categories_and_outside_time():
    report = {"timed": {"wall_s": 10.0, "phases_s": {"generate: decode + sampling (act)": 6.0, "other": 4.0}},
              "profiled": {"wall_s": 12.0, "op_self_s": 9.0, "categories_s": {"matmul": 7.0, "attention": 2.0},
                           "outside_torch_ops_s": 3.0,
                           "top_ops": [{"op": "aten::mm", "self_s": 7.0, "calls": 10, "category": "matmul"}]}}
    table = ip.markdown(report)
    assert "| generate: decode + sampling (act) | 6.0 | 60% |" in table
    assert "| matmul | 7.0 | 58% |" in table and "| outside torch ops (Python, op timer) | 3.0 | 25% |" in table
    assert "| `aten::mm` | 7.00 | 10 | matmul |" in table


def test_train_version_is_the_curate_stages_and_a_changed_dataset_is_refused(tmp_path):
    import json as _json

    import pandas as pd
    import pytest

    from envace_core import EnvaceError
    from envace_core.store.files import sha256_bytes

    records = [{"id": "a", "split": "train", "x": "1"}, {"id": "b", "split": "test", "x": "2"}]
    version = sha256_bytes(_json.dumps(records, sort_keys=True).encode())[:16]
    pd.DataFrame(records).to_parquet(tmp_path / "tasks.parquet", index=False)
    want = sha256_bytes(_json.dumps(records[:1], sort_keys=True).encode())[:16]  # as write_dataset computes it
    assert ip.train_version(tmp_path, version, "train") == want
    with pytest.raises(EnvaceError, match="do not hash to the manifest's version"):
        ip.train_version(tmp_path, "deadbeefdeadbeef", "train")
    with pytest.raises(EnvaceError, match="cannot read the dataset's tasks"):
        ip.train_version(tmp_path / "missing", version, "train")
