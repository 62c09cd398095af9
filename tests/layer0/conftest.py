"""CPU matmuls at a small size where a test measures ceilings through the commands: bf16 is
emulated on CI's CPUs (~1 GFLOP/s), so each quick measurement's 1024^3 products took ~10 s of
CPU. The lab 0 notebook (tests/labs/test_notebooks.py) still measures them at the quick
plan's own sizes."""
from __future__ import annotations

import pytest

from layer0_hardware import bench_suite
from layer0_hardware import ceilings as ceilings_module

SMALL_N = 256


@pytest.fixture
def small_cpu_matmuls(monkeypatch):
    """Every ceiling measured as before, through the same code, with the CPU matmuls at
    SMALL_N where more was asked for."""
    real = ceilings_module.matmul_flops

    def small(dtype, n=None, device=None, *, peak=False):
        return real(dtype, min(n or SMALL_N, SMALL_N), device, peak=peak)

    for module in (ceilings_module, bench_suite):
        monkeypatch.setattr(module, "matmul_flops", small)
