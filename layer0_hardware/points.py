"""A few real operations timed with torch and placed on the roofline.

Each point pairs a cost model from ``roofline`` (FLOPs and minimum bytes) with a measured
time. Vector add sits far left (memory bound), a big matmul far right (compute bound), and
decode attention -- the op that dominates LLM token generation -- lands left of the ridge.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .microbench import random_floats
from .roofline import RooflinePoint, attention_decode_cost, matmul_cost, vector_add_cost
from .timing import resolve_device, time_fn

Op = tuple[str, Callable[[], object], tuple[float, float]]  # name, fn, (flops, bytes)


def roof_dtype(device: torch.device) -> str:
    """The dtype whose measured roof the points are judged against on this device."""
    return "bf16" if device.type == "cuda" else "fp32"


def _vector_add(n: int, dev: torch.device) -> Op:
    a, b = random_floats(n, dev), random_floats(n, dev)
    c = torch.empty_like(a)
    return f"vector add n={n:.2e} fp32", lambda: torch.add(a, b, out=c), vector_add_cost(n, 4)


def _matmul(n: int, dtype: torch.dtype, dev: torch.device) -> Op:
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    name = f"matmul n={n} {str(dtype).removeprefix('torch.')}"
    return name, lambda: torch.matmul(a, b, out=c), matmul_cost(n, n, n, a.element_size())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One decode step of grouped-query attention in plain torch.

    q: [batch, heads, head_dim] (the new token); k, v: [batch, kv_heads, context, head_dim].
    Returns [batch, heads, head_dim]. Query heads are grouped onto their shared KV head by
    a reshape, so K and V are read once and never copied per query head.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)     # [B, KVH, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) / math.sqrt(head_dim)  # [B, KVH, G, L]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(batch, heads, head_dim)


def _attention(batch: int, heads: int, kv_heads: int, head_dim: int, context: int,
               dtype: torch.dtype, dev: torch.device) -> Op:
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    k = torch.randn(batch, kv_heads, context, head_dim, device=dev, dtype=dtype)
    v = torch.randn(batch, kv_heads, context, head_dim, device=dev, dtype=dtype)
    cost = attention_decode_cost(batch, heads, kv_heads, head_dim, context, q.element_size())
    name = f"decode attention b={batch} L={context}"
    return name, lambda: decode_attention(q, k, v), cost


def measure_points(device: torch.device | str | None = None, *,
                   quick: bool = False) -> list[RooflinePoint]:
    """Time vector add, a matmul and decode attention on ``device``; one point each.

    GPU sizes fill an H100 (hundreds of MB per op, far beyond L2); on a CPU the memory-bound
    ops move 64 MiB or more (beyond L3, where the roof was measured) and the whole set
    takes a couple of seconds. Matmul and attention use ``roof_dtype(device)``.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        ops = [_vector_add(2**24 if quick else 2**26, dev),
               _matmul(4096 if quick else 8192, torch.bfloat16, dev),
               _attention(32, 32, 8, 128, 2048 if quick else 4096, torch.bfloat16, dev)]
    else:  # memory-bound ops over 64 MiB and more: out of a CPU's L3, as the roof's streams
        ops = [_vector_add(2**24, dev),
               _matmul(512, torch.float32, dev),
               _attention(16, 8, 2, 64, 4096 if quick else 8192, torch.float32, dev)]
    points = []
    for name, fn, (flops, nbytes) in ops:
        timing = time_fn(fn, warmup=3, repeats=10, device=dev)
        points.append(RooflinePoint(name, flops, nbytes, timing.median_s))
    return points
