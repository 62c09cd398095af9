"""Every CUDA C source under layer1_kernels/cuda compiles (nvcc, sm_90), with no GPU needed.

CuPy compiles these at run time only on a CUDA machine; this catches a syntax error in CI.
Skipped, with the reason, where nvcc is not installed.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from layer1_kernels import cupy_support, nvcc

SOURCES = sorted(cupy_support.CUDA_DIR.glob("*.cu"))
needs_nvcc = pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc is not on PATH (CUDA toolkit not installed)")


def test_sources_exist_in_reading_order() -> None:
    names = [p.name for p in SOURCES]
    assert "reduce_sum.cu" in names
    sgemm = [n for n in names if n.startswith("sgemm_")]
    assert [int(n[6:8]) for n in sgemm] == list(range(1, len(sgemm) + 1))
    assert len(sgemm) >= 6


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_kernels_are_extern_c(path: Path) -> None:
    # CuPy's RawModule finds kernels by their unmangled names.
    text = path.read_text()
    kernels = re.findall(r"__global__", text)
    assert kernels, f"{path.name} defines no kernel"
    assert len(re.findall(r'extern "C" __global__', text)) == len(kernels)
    assert "#include" not in text, "sources must be self-contained for NVRTC"


@needs_nvcc
@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_compiles_with_nvcc(path: Path) -> None:
    nvcc.compile_check(path)


@needs_nvcc
@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_no_register_spills(path: Path) -> None:
    # A spill moves registers to local memory: a silent slowdown worth failing CI for.
    report = nvcc.ptxas_report(path)
    assert "Used" in report and "registers" in report, report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


@needs_nvcc
def test_compile_check_reports_nvcc_errors(tmp_path: Path) -> None:
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(RuntimeError, match="undefined_name"):
        nvcc.compile_check(bad)


def test_compile_check_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no CUDA source"):
        nvcc.compile_check(tmp_path / "absent.cu")
