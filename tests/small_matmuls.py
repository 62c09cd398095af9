"""Ceilings measured with the CPU matmuls at a small size: bf16 is emulated on CI's CPUs (~1
GFLOP/s), so a quick measurement's 1024^3 products take ~10 s of CPU each. Every ceiling is still
measured, through the same code; only the matmul's size shrinks (layer 0's command tests, and
the notebooks' cached ceilings)."""
from __future__ import annotations

import pytest

from layer0_hardware import bench_suite
from layer0_hardware import ceilings as ceilings_module

SMALL_N = 256


def patch_small_matmuls(mp: pytest.MonkeyPatch) -> None:
    """matmul_flops at SMALL_N where more is asked for, wherever layer 0 calls it."""
    real = ceilings_module.matmul_flops

    def small(dtype, n=None, device=None, *, peak=False):
        return real(dtype, min(n or SMALL_N, SMALL_N), device, peak=peak)

    for module in (ceilings_module, bench_suite):
        mp.setattr(module, "matmul_flops", small)
