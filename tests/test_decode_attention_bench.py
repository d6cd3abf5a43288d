"""benchmarks/decode_attention.py on one layer and one call per case (plumbing and JSON, not speed): both paths
timed, the fused route taken in every case, bad arguments refused before anything runs."""

from __future__ import annotations

import json

import pytest

from envace_core.engines import shared_prefix
from tests.benchmark_loader import load_benchmark

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bench():
    return load_benchmark("decode_attention")


def test_every_case_on_one_layer(tmp_path, capsys):
    if not shared_prefix.fused_kernel_available():
        pytest.skip("this torch has no fused CPU attention op")
    out = tmp_path / "da.json"
    assert _bench().main(["--layers", "1", "--calls", "1", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == set(report["runs"]) == {"distinct8", "g8", "g1", "act_turn1", "root_60",
                                                               "root_300"}
    for name, case in report["summary"].items():
        assert case["fused_route_taken"] is True
        assert len(report["runs"][name]["classic"]) == len(report["runs"][name]["fused"]) == 1
        assert case["fused_over_classic"] > 0
    assert "| g8 |" in capsys.readouterr().out
    assert report["details"]["load_average_start"] and report["details"]["date"]
    assert shared_prefix.FUSED_ATTENTION is True  # switched back on


@pytest.mark.parametrize("argv, message", [(["--layers", "0"], "--layers must be >= 1"),
                                           (["--cases", "g9"], "unknown ['g9']"),
                                           (["--cases", ","], "--cases is empty"),
                                           (["--cases", ""], "--cases is empty"),
                                           (["--json", ""], "--json: is empty"),
                                           (["--json", "{tmp}"], "is a folder"),
                                           (["--json", "{tmp}/file/x.json"], "is a file, not a folder")])
def test_bad_arguments_are_refused_before_measuring(argv, message, capsys, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    bench = _bench()
    monkeypatch.setattr(bench, "time_case", lambda *a: pytest.fail("measured before refusing"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--json" not in argv:
        argv += ["--json", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
