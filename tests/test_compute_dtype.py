"""`model.compute_dtype=auto`: bf16 only where the hardware runs it natively (CUDA, CPUs with avx512_bf16/amx_bf16)."""

import pytest

from envace_core.engines import base
from envace_core.engines.base import cpu_has_native_bf16, resolve_compute_dtype


def _cpuinfo(tmp_path, flags):
    p = tmp_path / f"cpuinfo-{len(list(tmp_path.iterdir()))}"
    p.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
    return str(p)


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    cpu_has_native_bf16.cache_clear()
    assert cpu_has_native_bf16(_cpuinfo(tmp_path, "avx2 avx512f avx512_bf16")) is True
    assert cpu_has_native_bf16(_cpuinfo(tmp_path, "avx2 amx_bf16 amx_tile")) is True
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False
    assert cpu_has_native_bf16(_cpuinfo(tmp_path, "avx2 avx512f avx512bw")) is False  # AVX-512 without BF16


@pytest.mark.parametrize("native, device, want", [
    (True, "cpu", "bfloat16"), (False, "cpu", "float32"), (False, "cuda", "bfloat16"), (False, "mps", "float32")])
def test_auto_picks_bf16_only_where_it_is_native(monkeypatch, native, device, want):
    monkeypatch.setattr(base, "cpu_has_native_bf16", lambda: native)
    assert resolve_compute_dtype("auto", device) == want


def test_explicit_dtypes_are_kept_and_others_refused():
    assert resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_compute_dtype("float32", "cuda") == "float32"
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        resolve_compute_dtype("float16", "cpu")
