"""benchmarks/packed_linear_bench.py end to end on the tiny random Llama (sizes are the script's; the model is
tiny, so this checks the plumbing and the JSON, not speed)."""

from __future__ import annotations

import json

import pytest
import torch

from envace_core.engines import packed_linear
from tests.benchmark_loader import load_benchmark


@pytest.mark.skipif(not packed_linear.available(torch.bfloat16, "cpu"),
                    reason="this torch build or CPU has no oneDNN bf16 inner product")
def test_sections_write_every_figure(tiny_model_dir, tmp_path):
    bench = load_benchmark("packed_linear_bench")
    out = tmp_path / "p.json"
    assert bench.main(["--model", str(tiny_model_dir), "--sections", "matmul,update", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["matmul"]["matrices"] == 2 * 7  # two layers of q, k, v, o, gate, up, down
    assert set(rep["matmul"]["passes"]) == {"1", "8", "16", "300", "1500"}
    assert all(p["f_linear_ms"] > 0 and p["packed_ms"] > 0 for p in rep["matmul"]["passes"].values())
    u = rep["update"]
    assert u["rows"] == 16 and len(u["runs_s"]["plain"]) == len(u["runs_s"]["packed"]) == 3
    assert u["ratio"] == pytest.approx(u["best_s"]["packed"] / u["best_s"]["plain"])
    assert "generate" not in rep and len(rep["load_start"]) == 3
    with pytest.raises(SystemExit):
        bench.main(["--sections", "nope"])
