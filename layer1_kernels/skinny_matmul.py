"""Skinny products for decode batches: y = x @ W^T for a few to a few dozen rows (M <= 64).

    skinny_matmul(x, w, config=None)        x (M, K), w (N, K) row-major -> y (M, N)
    skinny_linear(x, w, bias=None)          F.linear, or skinny_matmul where measured faster

Why a kernel of its own. A decode step of B sequences multiplies a (B, K) activation by each
weight matrix once: with B = 32 every weight byte is used 32 times, still far below the ~300
FLOPs a byte an H100's tensor cores need, so the product is bound by streaming W, as at batch
1. cuBLAS picks tiles made for square products; at the narrow per-rank shapes tensor
parallelism gives (8B at TP=4: o_proj 4096 x 1024, qkv 1536 x 4096) it launches few tiles
and a split-K reduction kernel behind them.

What one program does ("swap AB"): program n owns BLOCK_N rows of W (outputs) and walks all
of K in BLOCK_K steps; each step loads a (BLOCK_N, BLOCK_K) tile of W and the (BLOCK_K,
BLOCK_M) activations (from L2: every program reads the same x), and `tl.dot` multiplies them
on the tensor cores with W's rows as the MMA's long side, so BLOCK_M (>= 16, the MMA's
narrowest) pads the few rows of x instead of W's thousands. Triton pipelines the K loop
(`stages` tiles of W in flight through shared memory), which is what keeps enough bytes in
flight per SM to stream at copy bandwidth. The fp32 (BLOCK_N, BLOCK_M) accumulator is
stored transposed, once.

    FLOPs = 2 * M * N * K          bytes ~ N * K * w_itemsize (+ M * K + M * N activations)
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl

from .host import cdiv, next_pow2

_DTYPES = (torch.float16, torch.bfloat16)
#: Most rows one call takes (the accumulator tile holds them all).
MAX_ROWS = 64


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, stride_xm,
                   stride_wn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + rk)[:, None]  # (BLOCK_K, BLOCK_M): x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # no column mask: the loads stay 16 bytes wide
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k + rk < k_hi
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    if SPLIT == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:
        # Split K: each program leaves its partial tile in the workspace; the last of a
        # column's SPLIT programs to finish (a counter per column of tiles) adds them in
        # split order (the same sum whichever finishes last) and resets the counter for the
        # next call. The CTA barrier orders every thread's stores before the release.
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rm[None, :]
        column = pid_n * BLOCK_N * BLOCK_M
        stride = tl.num_programs(0) * BLOCK_N * BLOCK_M
        tl.store(part_ptr + pid_k * stride + column + tile, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part_ptr + s * stride + column + tile, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & m_ok[None, :])
            tl.store(count_ptr + pid_n, 0)


#: (BLOCK_N, BLOCK_K, warps, stages[, split]) per (N, K), where skinny_matmul was measured faster
#: than cuBLAS at 32 rows (benchmarks/tp_gemm_shapes.py); skinny_linear uses it only there.
TUNED: dict[tuple[int, int], tuple[int, ...]] = {}
#: skinny_linear's row range: the measured one (32 rows; 17..32 pad to the same 32-row tile)
LINEAR_ROWS = (17, 32)
#: "1": skinny_linear takes skinny_matmul at TUNED's shapes (off until measured in decode steps)
ENV = "LLM_STACK_SKINNY_GEMM"
ENABLED = os.environ.get(ENV, "0") == "1"


def default_config(n: int, k: int) -> tuple[int, ...]:
    """An untuned guess: 32-row tiles of W (N / 32 programs: 48..896 at the 8B's per-rank
    shapes), 256 columns a step, four steps in flight."""
    if interpreter.INTERPRETED:
        return 16, 32, 1, 1
    return 32, min(256, max(16, next_pow2(k))), 4, 4


_COUNTS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K arrival counters of a device: zeros, left zero by every call (the last
    program of a column resets its counter), so graphs replay them; grown when needed."""
    t = _COUNTS.get(device)
    if t is None or t.numel() < tiles:
        t = _COUNTS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return t


def skinny_matmul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T).to(x.dtype)


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, *, config=None) -> torch.Tensor:
    """y = x @ w^T: x (M, K) with 1 <= M <= MAX_ROWS, w (N, K) (an nn.Linear weight, read in
    place), both fp16 or bf16 -> y (M, N) in x's dtype, fp32 accumulation. config:
    (BLOCK_N, BLOCK_K, warps, stages[, split]): split > 1 cuts K into that many parts, one
    program each (more programs for narrow N), summed by the last to finish; default TUNED's
    entry or default_config."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_matmul: x must be (M, K) and w (N, K), got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_matmul: takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"skinny_matmul: x and w must share a dtype of {_DTYPES}, got "
                         f"{x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_matmul: x and w need unit stride along K")
    M, K = x.shape
    N = w.shape[0]
    block_n, block_k, warps, stages, *rest = config or TUNED.get((N, K)) or default_config(N, K)
    split = max(1, min(rest[0] if rest else 1, cdiv(K, block_k)))
    k_split = cdiv(cdiv(K, split), block_k) * block_k  # whole K tiles a split
    split = cdiv(K, k_split)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles = cdiv(N, block_n)
    block_m = max(16, next_pow2(M))
    part, count = y, y  # not read without a split
    if split > 1:
        part = torch.empty((split, tiles * block_n * block_m), dtype=torch.float32,
                           device=x.device)
        count = _counters(x.device, tiles)
    _skinny_kernel[(tiles, split)](
        x, w, y, part, count, M, N, K, k_split, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K % k_split == 0 and k_split % block_k == 0, SPLIT=split, num_warps=warps,
        num_stages=stages)
    return y


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """F.linear(x, w, bias) for x (M, K), w (N, K): through skinny_matmul when ENABLED, x is a
    CUDA tensor with LINEAR_ROWS rows and (N, K) is in TUNED (measured faster than cuBLAS
    there), else F.linear itself (cuBLAS on a GPU)."""
    lo, hi = LINEAR_ROWS
    if (ENABLED and x.is_cuda and x.dim() == 2 and lo <= x.shape[0] <= hi
            and tuple(w.shape) in TUNED and x.dtype in _DTYPES and w.dtype == x.dtype
            and x.stride(1) == 1 and w.stride(1) == 1):
        y = skinny_matmul(x, w)
        return y if bias is None else y + bias
    return F.linear(x, w, bias)
