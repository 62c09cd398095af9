"""Benchmarks for the CuPy / CUDA C kernels: the SGEMM progression and the reduction.

`bench_cases(device)` hands bench.py one BenchCase per SGEMM version at 4096^3 (against
cuBLAS in true fp32, TF32 off) and the reduction over 2^28 floats (against torch.sum).
`sgemm_progression_table(n)` times every version and cuBLAS itself, in one run, for the
table a student reads: GFLOP/s per version and its ratio to cuBLAS.
Importable anywhere; running either needs a CUDA GPU and CuPy (RuntimeError otherwise).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from layer0_hardware import time_fn

from . import cupy_support as cs
from .bench_case import BenchCase
from .reduction import reduce_sum, reduce_sum_reference
from .sgemm import SGEMM_VERSIONS, sgemm, sgemm_reference

SGEMM_N = 4096
REDUCE_N = 2**28  # 1 GiB of float32: 20x the H100's 50 MB L2


def _cuda_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type != "cuda":
        cs.require_cupy()  # on a machine without CUDA this raises the clear message
        raise RuntimeError(f"the CUDA C benchmarks run on a CUDA device, not {dev}")
    cs.require_cupy()
    return dev


def _cublas_fp32(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    # sgemm_reference switches TF32 off for the duration of each call and restores it.
    return lambda: sgemm_reference(a, b)


def bench_cases(device: str | torch.device) -> list[BenchCase]:
    """One BenchCase per SGEMM version at 4096^3 fp32, and the 2^28-float reduction."""
    dev = _cuda_device(device)
    n = SGEMM_N
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen)
    b = torch.randn(n, n, device=dev, generator=gen)
    flops, nbytes = 2.0 * n**3, 4.0 * 3 * n * n
    cases = [
        BenchCase(
            name=f"sgemm {i} {version} {n}x{n}x{n} fp32",
            flops=flops,
            nbytes=nbytes,
            ours=lambda version=version: sgemm(a, b, version=version),
            reference=_cublas_fp32(a, b),
            reference_name="cuBLAS fp32, TF32 off (torch.matmul)",
            dtype="fp32",
        )
        for i, version in enumerate(SGEMM_VERSIONS, start=1)
    ]
    x = torch.rand(REDUCE_N, device=dev, generator=gen)
    cases.append(BenchCase(
        name=f"reduce_sum {REDUCE_N} fp32",
        flops=float(REDUCE_N),
        nbytes=4.0 * REDUCE_N,
        ours=lambda: reduce_sum(x),
        reference=lambda: reduce_sum_reference(x),
        reference_name="torch.sum",
        dtype=None,
    ))
    return cases


def _median_ms(fn: Callable[[], object]) -> float:
    """Median CUDA-event milliseconds of fn(), after warm-up (layer 0's timer). Ten calls:
    the naive kernel takes a quarter of a second each at 4096^3."""
    return time_fn(fn, warmup=1, repeats=10, device="cuda").median_s * 1e3


def sgemm_progression_table(n: int = SGEMM_N) -> list[dict]:
    """Time every SGEMM version and cuBLAS fp32 (TF32 off) at n x n x n, in this run.

    Returns one dict per version, in reading order: version (1-based), name, ms, gflops,
    ratio_to_cublas (our GFLOP/s over cuBLAS's), cublas_gflops; plus a last row for
    cuBLAS itself (version 0, name "cuBLAS"). Also checks each version's result against
    cuBLAS (relative Frobenius error, raising RuntimeError above 1e-4).
    """
    dev = _cuda_device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen)
    b = torch.randn(n, n, device=dev, generator=gen)
    flops = 2.0 * n**3
    ref = sgemm_reference(a, b)
    cublas_ms = _median_ms(lambda: sgemm_reference(a, b))
    cublas_gflops = flops / cublas_ms / 1e6
    rows = []
    for i, version in enumerate(SGEMM_VERSIONS, start=1):
        out = sgemm(a, b, version=version)
        err = (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()
        if not err < 1e-4:
            raise RuntimeError(f"sgemm version {version} is wrong at "
                               f"n={n}: relative error {err:.2e}")
        ms = _median_ms(lambda version=version: sgemm(a, b, version=version))
        gflops = flops / ms / 1e6
        rows.append({"version": i, "name": version, "ms": ms, "gflops": gflops,
                     "ratio_to_cublas": gflops / cublas_gflops, "cublas_gflops": cublas_gflops})
    rows.append({"version": 0, "name": "cuBLAS", "ms": cublas_ms, "gflops": cublas_gflops,
                 "ratio_to_cublas": 1.0, "cublas_gflops": cublas_gflops})
    return rows
