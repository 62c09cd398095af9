"""One benchmark case: our kernel and the reference it is compared with, on the same inputs.

Each kernel family's `bench_*.py` returns a list of these; `bench.py` times both sides
in the same run, and places ours on layer 0's measured roofline.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchCase:
    """A kernel call to time against a reference on identical, already-allocated inputs.

    name:      what is timed, with its shape, e.g. "softmax 8192x8192 bf16".
    flops:     floating-point operations one call does (the count in the kernel's docstring).
    nbytes:    the fewest bytes one call must move through device memory.
    ours:      zero-argument callable running our kernel once.
    reference: zero-argument callable running the reference once (torch, cuBLAS, SDPA...).
    reference_name: what the reference is, e.g. "torch.softmax" or "cuBLAS (torch.matmul)".
    dtype:     the roofline roof that applies: "bf16", "fp16", "fp32", "tf32", "fp8", or
               None for memory-bound kernels judged against copy bandwidth.
    """

    name: str
    flops: float
    nbytes: float
    ours: Callable[[], object]
    reference: Callable[[], object]
    reference_name: str
    dtype: str | None = None
