"""Decode-batch products: y = x @ W^T for a decode step's rows (one per sequence, up to 256).

    skinny_matmul(x, w, config=None)        x (M, K), w (N, K) row-major -> y (M, N)
    skinny_linear(x, w, bias=None)          F.linear, or skinny_matmul where measured faster

Why a kernel of its own. A decode step of B sequences multiplies a (B, K) activation by each
weight matrix once: every weight byte is used B times. An H100 streams ~3.35 TB/s and
multiplies ~700 TFLOP/s (bf16, dense, in practice), ~210 FLOPs a byte, so a projection is
bound by streaming W up to B ~ 200 rows (2 B FLOPs a 2-byte weight) and only near B = 256
do the tensor cores start to matter. cuBLAS picks tiles made for square products: at the
narrow per-rank shapes tensor parallelism gives (8B at TP=4: o_proj 4096 x 1024, qkv 1536 x
4096) it launches few tiles and a split-K reduction kernel behind them, and at the 1B's
mid-sized projections (qkv 3072 x 2048, o 2048 x 2048) a few hundred rows leave its 64 x 64
tiles short of either floor.

What one program does ("swap AB"): program (m, n) owns BLOCK_N rows of W (outputs) and
BLOCK_M rows of x and walks all of K (or its split's share) in BLOCK_K steps; each step loads
a (BLOCK_N, BLOCK_K) tile of W and the (BLOCK_K, BLOCK_M) activations, and `tl.dot`
multiplies them on the tensor cores with W's rows as the MMA's long side, so BLOCK_M (>= 16,
the MMA's narrowest) pads the few rows of x instead of W's thousands. The programs of one W
tile are launched next to each other (m varies fastest), so W comes from DRAM once and from
L2 for the others. Triton pipelines the K loop (`stages` tiles in flight through shared
memory), which is what keeps enough bytes in flight per SM to stream at copy bandwidth. The
fp32 (BLOCK_N, BLOCK_M) accumulator is stored transposed, once. Split K (for the thin-N
shapes: more programs than N / BLOCK_N tiles give) sums the parts in the last program of a
tile to arrive.

    FLOPs = 2 * M * N * K          bytes ~ N * K * w_itemsize (+ M * K + M * N activations)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl

from .host import cdiv, next_pow2

_DTYPES = (torch.float16, torch.bfloat16)
#: Most rows one call takes: a decode step's batch (larger products are prefill's: cuBLAS).
MAX_ROWS = 256


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, stride_xm,
                   stride_wn, stride_ym, SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
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
    if not SPLIT_K:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:
        # Split K: each program leaves its partial tile in the workspace; the last of a
        # tile's SPLIT programs to finish (a counter per output tile) adds them in split
        # order (the same sum whichever finishes last) and resets the counter for the next
        # call. The CTA barrier orders every thread's stores before the release.
        t = pid_n * tl.num_programs(0) + pid_m
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        at = t * BLOCK_N * BLOCK_M
        stride = tl.num_programs(0) * tl.num_programs(1) * BLOCK_N * BLOCK_M
        tl.store(part_ptr + pid_k * stride + at + tile, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(part_ptr + s * stride + at + tile, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & m_ok[None, :])
            tl.store(count_ptr + t, 0)


#: Where skinny_matmul was measured faster than cuBLAS (benchmarks/decode_gemm_shapes.py on an
#: H100, CUDA graph replay, weights rotated past L2; by >= 3 %, "us vs cuBLAS's us" below):
#: (N, K) -> ((first row count, last row count, config), ...); skinny_linear takes the kernel
#: only inside those row ranges. A config is (BLOCK_N, BLOCK_M, BLOCK_K, warps, stages[, split]).
#: A range covers the rows down to the decode-graph bucket below the measured count (buckets
#: are multiples of 8) where the kernel's padded row tile makes it no slower below; the LM
#: head (streamed: its time hardly depends on the rows) also the rows down to the tile's
#: half. Everywhere else cuBLAS was as fast or faster: the 1B's qkv, o and down at every row
#: count, every projection from 129 rows on (64-128-row tiles run at 1.3-2.5x cuBLAS's time
#: there: too few programs, and split K's partial sums cost more than they win), the 8B's
#: per-rank o_proj, and its TP=4 shapes (within 1 %).
TUNED: dict[tuple[int, int], tuple[tuple[int, int, tuple[int, ...]], ...]] = {
    # Llama-3.2-1B gate_up: 32 rows 27.0 vs 28.6 us, 128 rows 30.2 vs 32.3
    (16384, 2048): ((25, 32, (128, 32, 128, 8, 3)), (121, 128, (128, 128, 128, 8, 3))),
    # Llama-3.2-1B LM head (tied): 32 rows 185 vs 198 us, 64: 192 vs 201, 96: 202 vs 209,
    # 128: 207 vs 214
    (128256, 2048): ((17, 32, (128, 32, 128, 8, 3)), (33, 64, (128, 64, 128, 8, 3)),
                     (89, 96, (128, 128, 64, 8, 3)), (121, 128, (128, 128, 64, 8, 3))),
    # Llama-3.1-8B at TP=1, 32 rows: qkv 21.7 vs 22.9 us, gate_up 84.5 vs 89.8
    (6144, 4096): ((25, 32, (64, 32, 256, 4, 3)),),
    (28672, 4096): ((25, 32, (128, 32, 128, 8, 3)),),
    # Llama-3.1-8B rank 0 at TP=2, 32 rows: qkv 13.5 vs 15.0 us, gate_up 44.8 vs 48.5, down
    # 25.5 vs 27.4 (a layer's four projections 93.3 vs 100.4)
    (3072, 4096): ((25, 32, (32, 32, 256, 4, 4)),),
    (14336, 4096): ((25, 32, (128, 32, 128, 8, 3)),),
    (4096, 7168): ((25, 32, (32, 32, 256, 4, 4)),),
}
def tuned_config(n: int, k: int, m: int) -> tuple[int, ...] | None:
    """TUNED's config for an (m, k) @ (n, k)^T product, None where cuBLAS stays."""
    for lo, hi, config in TUNED.get((n, k), ()):
        if lo <= m <= hi:
            return config
    return None


def default_config(n: int, k: int, m: int) -> tuple[int, ...]:
    """An untuned guess: 32-row tiles of W, x's rows in one tile up to 64 (64-row tiles
    past that), 256 columns a step, four steps in flight."""
    block_m = min(64, max(16, next_pow2(m)))
    if interpreter.INTERPRETED:
        return 16, block_m, 32, 1, 1
    return 32, block_m, min(256, max(16, next_pow2(k))), 4, 4


_COUNTS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K arrival counters of a device: zeros, left zero by every call (the last
    program of a tile resets its counter), so graphs replay them; grown when needed."""
    t = _COUNTS.get(device)
    if t is None or t.numel() < tiles:
        t = _COUNTS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return t


def skinny_matmul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T).to(x.dtype)


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, *, config=None) -> torch.Tensor:
    """y = x @ w^T: x (M, K) with 1 <= M <= MAX_ROWS, w (N, K) (an nn.Linear weight, read in
    place), both fp16 or bf16 -> y (M, N) in x's dtype, fp32 accumulation. config:
    (BLOCK_N, BLOCK_M, BLOCK_K, warps, stages[, split]): split > 1 cuts K into that many
    parts, one program each (more programs for narrow N), summed by the last to finish;
    default TUNED's entry for M rows or default_config."""
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
    config = config or tuned_config(N, K, M) or default_config(N, K, M)
    if len(config) not in (5, 6) or any(not isinstance(c, int) or c < 1 for c in config):
        raise ValueError(f"skinny_matmul: config must be (BLOCK_N, BLOCK_M, BLOCK_K, warps, "
                         f"stages[, split]) of positive ints, got {config!r}")
    block_n, block_m, block_k, warps, stages, *rest = config
    split = max(1, min(rest[0] if rest else 1, cdiv(K, block_k)))
    k_split = cdiv(cdiv(K, split), block_k) * block_k  # whole K tiles a split
    split = cdiv(K, k_split)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles_m, tiles_n = cdiv(M, block_m), cdiv(N, block_n)
    part, count = y, y  # not read without a split
    if split > 1:
        part = torch.empty((split, tiles_m * tiles_n * block_n * block_m), dtype=torch.float32,
                           device=x.device)
        count = _counters(x.device, tiles_m * tiles_n)
    _skinny_kernel[(tiles_m, tiles_n, split)](
        x, w, y, part, count, M, N, K, k_split, x.stride(0), w.stride(0), y.stride(0), split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K % k_split == 0 and k_split % block_k == 0, SPLIT_K=split > 1, num_warps=warps,
        num_stages=stages)
    return y


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """F.linear(x, w, bias) for x (M, K), w (N, K): through skinny_matmul when x is a CUDA
    tensor and TUNED has a config for (N, K) at M rows (measured faster than cuBLAS there,
    alone), else F.linear itself (cuBLAS on a GPU). The model's projections do not take it:
    end to end (the 1B engine; the 8B at TP=2/4, batch 32) it was within noise of cuBLAS."""
    if x.is_cuda and x.dim() == 2 and x.dtype in _DTYPES and w.dtype == x.dtype:
        config = tuned_config(w.shape[0], w.shape[1], x.shape[0])
        if config is not None and x.stride(1) == 1 and w.stride(1) == 1:
            y = skinny_matmul(x, w, config=config)
            return y if bias is None else y + bias
    return F.linear(x, w, bias)
