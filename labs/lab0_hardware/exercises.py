"""Lab 0 — hardware: your answers.

Fill in each function where it raises NotImplementedError; `lab0.ipynb` explains the
ideas and calls these. Grade yourself with `stack grade --lab 0`.

Units throughout: FLOPs (floating-point operations), bytes, seconds, FLOP/s, bytes/s.
Do not import `layer0_hardware` here: it holds the answers, and the grader refuses it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs done per byte moved (FLOP/byte). Raise ValueError if nbytes <= 0 or flops < 0."""
    raise NotImplementedError("arithmetic_intensity")


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) where the bandwidth slope meets the compute roof."""
    raise NotImplementedError("ridge_point")


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: the most FLOP/s a kernel of this intensity can reach on this device."""
    raise NotImplementedError("attainable_flops")


def classify_bound(intensity: float, peak_flops: float, bandwidth: float) -> str:
    """"memory" below the ridge point, "compute" at or above it."""
    raise NotImplementedError("classify_bound")


def vector_add_cost(n: int, dtype_bytes: int = 4) -> tuple[float, float]:
    """(flops, bytes) of out = x + y over n elements: each input read once, out written once."""
    raise NotImplementedError("vector_add_cost")


def matmul_cost(m: int, n: int, k: int, dtype_bytes: int = 2) -> tuple[float, float]:
    """(flops, bytes) of C[m,n] = A[m,k] @ B[k,n]: a multiply and an add per term; A and B
    read once, C written once."""
    raise NotImplementedError("matmul_cost")


def attention_decode_cost(
    batch: int, heads: int, kv_heads: int, head_dim: int, context_len: int, dtype_bytes: int = 2
) -> tuple[float, float]:
    """(flops, bytes) of one decode step of attention: each of `batch` sequences has one new
    query token with `heads` heads, attending to `context_len` cached keys and values held
    for `kv_heads` heads (grouped-query attention shares a kv head among heads/kv_heads query
    heads). Count QK^T and PV (ignore the softmax's few FLOPs); bytes: the K and V cache
    read once, q read once, the output written once."""
    raise NotImplementedError("attention_decode_cost")


def median_time(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Seconds one call of fn takes: call it `warmup` times untimed, then time `repeats`
    calls one by one on a host clock and return the median. If CUDA is available,
    synchronize before starting and before stopping each clock (GPU work is asynchronous)."""
    raise NotImplementedError("median_time")


def copy_bandwidth(device: torch.device | str | None = None, nbytes: int = 64 * 2**20) -> float:
    """Measure memory bandwidth in bytes/s by timing dst.copy_(src) for tensors of `nbytes`
    bytes of random data on `device` (default: CUDA if available, else CPU). Count bytes
    read plus bytes written."""
    raise NotImplementedError("copy_bandwidth")
