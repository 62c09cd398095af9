"""The decode qkv projection with RoPE and the KV-cache write in its epilogue: one launch
where gemv_rms_norm + rope_cache_write took two.

    gemv_rms_norm_rope(x, w, norm_w, eps, residual, bias, cos, sin, positions,
                       k_cache, v_cache, slots, n_q_heads, n_kv_heads, head_dim)
        -> (qkv (M, N), h (M, K) or None)

qkv = rms_norm(h = x (+ residual)) @ w^T (+ bias), N = (n_q_heads + 2 n_kv_heads) * head_dim
(q heads, then k heads, then v heads, each head_dim wide: the fused qkv layout). The q and k
heads come back rotated by their token's position, and k and v are written to k_cache /
v_cache row slots[m] (the flat (slots, kv_heads, head_dim) views rope_cache_write takes).

Why it can be fused. RoPE mixes column i of a head with column i + head_dim/2, nothing else.
So the programs here own *pairs* of output columns: program p computes BLOCK_P pairs
(i, i + half) of one or more heads, with two accumulators, and rotates them in registers once
the K loop is done. The arithmetic is the unfused kernels': the product rounded to the
activation dtype (the qkv tensor), then rope.py's fp32 rotation, rounded once; so the cache
and the returned q/k match gemv_rms_norm followed by rope_cache_write bit for bit.

    bytes ~ N * K * w_itemsize (the weights; the epilogue adds a few KB)
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .gemv import (
    _RMS,
    _act_tile,
    _check,
    _first_tile,
    _mac,
    _prologue,
    _unpack,
    _w_tile,
    gemv_rms_norm_reference,
    pdl_early,
    pdl_launch,
)
from .host import cdiv, next_pow2
from .rope_kv_write import rope_cache_write_reference

#: (BLOCK_P pairs, BLOCK_K, warps[, stages]) per (N, K); else _default_config. The picks of
#: benchmarks/gemv_shapes_sweep.py on an H200 (graph replay with PDL, weights past L2) at
#: rank 0's qkv of Llama-3.1-8B at TP=1/2/4 and Llama-3.2-1B at TP=1/2, us per call, old
#: (2, 2048, 4) default -> pick: 8B TP=1 16.0 -> 15.4, TP=2 9.0 -> 8.4, TP=4 5.3 (kept: within
#: 1 %; 12.6 MB is too short for any tile, 66 % of a copy's rate); 1B TP=2 4.0 -> 3.8, TP=1
#: 5.0 (the H100 pick kept).
TUNED: dict[tuple[int, int], tuple[int, ...]] = {
    (6144, 4096): (2, 1024, 4), (3072, 4096): (2, 1024, 4), (1536, 4096): (2, 2048, 4),
    (3072, 2048): (2, 1024, 4), (1536, 2048): (1, 1024, 4),
}


def _default_config(k: int) -> tuple[int, int, int]:
    if interpreter.INTERPRETED:
        return 2, 16, 1
    return 2, min(2048, next_pow2(k)), 4


def config_for(n: int, k: int) -> tuple[int, ...]:
    """(BLOCK_P, BLOCK_K, warps[, stages]) a call with w (n, k) launches with (before the
    rows > 1 cut of BLOCK_K): TUNED's entry for the shape, else _default_config."""
    return TUNED.get((n, k)) or _default_config(k)


@triton.jit
def _gemv_rope_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, w_ptr, b_ptr, y_ptr,
                      cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                      M, stride_xm, stride_rm, stride_wn, stride_ym, table_stride,
                      kc_stride_s, kc_stride_h, vc_stride_s, vc_stride_h, eps,
                      K: tl.constexpr, N_PAIRS: tl.constexpr, HALF: tl.constexpr,
                      HEAD_D: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr,
                      PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STATS_K: tl.constexpr,
                      STAGES: tl.constexpr, PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    pid = tl.program_id(0)
    OUT_TY: tl.constexpr = y_ptr.dtype.element_ty
    j = pid * BLOCK_P + tl.arange(0, BLOCK_P)  # pair index over all heads
    j_ok = j < N_PAIRS
    head = j // HALF
    i = j % HALF  # the pair's first column inside its head
    n_lo = head * HEAD_D + i
    n_hi = n_lo + HALF
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    offs_k = tl.arange(0, BLOCK_K)
    lo_rows = w_ptr + n_lo.to(tl.int64)[:, None] * stride_wn
    hi_rows = w_ptr + n_hi.to(tl.int64)[:, None] * stride_wn

    # weights first (they do not depend on the kernel before), as in gemv._gemv_kernel
    w_lo = _w_tile(lo_rows, offs_k, j_ok, K, EVEN_K)
    w_hi = _w_tile(hi_rows, offs_k, j_ok, K, EVEN_K)
    # ... and the epilogue's positions, slots and cos/sin (no kernel of the step writes them:
    # loaded here, they arrive during the K loop instead of adding two round trips after it)
    mask = m_ok[:, None] & j_ok[None, :]
    pos = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + m, mask=m_ok, other=0).to(tl.int64)[:, None]
    tab = pos[:, None] * table_stride + i[None, :]
    c = tl.load(cos_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    rstd = _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, eps, K,
                     PROLOGUE, HAS_RESIDUAL, BLOCK_M, STATS_K, OUT_TY, PDL, PDL_EARLY)

    if BLOCK_M == 1:
        acc_lo = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    else:
        acc_lo = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    acc_lo, acc_hi = _first_tile(acc_lo, acc_hi, w_lo, w_hi, x_ptr, r_ptr, h_ptr, nw_ptr,
                                 stride_xm, stride_rm, m, m_ok, offs_k, rstd, K, PROLOGUE,
                                 HAS_RESIDUAL, pid == 0, OUT_TY, EVEN_K, BLOCK_M)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):  # as in _gemv_kernel
        k = k0 + offs_k
        w_lo = _w_tile(lo_rows, k, j_ok, K, EVEN_K)
        w_hi = _w_tile(hi_rows, k, j_ok, K, EVEN_K)
        a = _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, k, rstd, K,
                      PROLOGUE, HAS_RESIDUAL, pid == 0, OUT_TY, EVEN_K)
        acc_lo = _mac(acc_lo, w_lo, a, BLOCK_M)
        acc_hi = _mac(acc_hi, w_hi, a, BLOCK_M)
    if PDL and not PDL_EARLY:
        gdc_launch_dependents()
    if BLOCK_M == 1:
        lo = tl.sum(acc_lo, 1)[None, :]
        hi = tl.sum(acc_hi, 1)[None, :]
    else:
        lo = acc_lo
        hi = acc_hi
    if HAS_BIAS:
        lo += tl.load(b_ptr + n_lo, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        hi += tl.load(b_ptr + n_hi, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    # the qkv row as the unfused GEMV stores it, then rope.py's fp32 rotation of q and k heads
    lo = lo.to(OUT_TY).to(tl.float32)
    hi = hi.to(OUT_TY).to(tl.float32)
    rot = (head < NQ + NKV)[None, :]
    o_lo = tl.where(rot, lo * c - hi * s, lo).to(OUT_TY)
    o_hi = tl.where(rot, hi * c + lo * s, hi).to(OUT_TY)
    y_row = y_ptr + m[:, None] * stride_ym
    tl.store(y_row + n_lo[None, :], o_lo, mask=mask)
    tl.store(y_row + n_hi[None, :], o_hi, mask=mask)
    # k heads to k_cache, v heads to v_cache, at the token's slot
    is_k = ((head >= NQ) & (head < NQ + NKV))[None, :]
    kdst = kc_ptr + slot * kc_stride_s + (head - NQ)[None, :] * kc_stride_h + i[None, :]
    tl.store(kdst, o_lo, mask=mask & is_k)
    tl.store(kdst + HALF, o_hi, mask=mask & is_k)
    is_v = (head >= NQ + NKV)[None, :]
    vdst = vc_ptr + slot * vc_stride_s + (head - NQ - NKV)[None, :] * vc_stride_h + i[None, :]
    tl.store(vdst, o_lo, mask=mask & is_v)
    tl.store(vdst + HALF, o_hi, mask=mask & is_v)


def gemv_rms_norm_rope_reference(x, w, norm_weight, eps, residual, bias, cos, sin, positions,
                                 k_cache, v_cache, slots, n_q_heads, n_kv_heads, head_dim):
    """The unfused ops: gemv_rms_norm's reference, then rope_cache_write's on its views."""
    y, h = gemv_rms_norm_reference(x, w, norm_weight, eps, residual, bias)
    q, k, v = _heads(y, n_q_heads, n_kv_heads, head_dim)
    rope_cache_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    return y, h


def _heads(y, n_q, n_kv, d):
    T = y.shape[0]
    q, k, v = y.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    return q.view(T, n_q, d), k.view(T, n_kv, d), v.view(T, n_kv, d)


def gemv_rms_norm_rope(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None, bias: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       n_q_heads: int, n_kv_heads: int, head_dim: int, *, impl: str = "auto",
                       config: tuple[int, int, int] | None = None):
    """rms_norm(h = x (+ residual)) @ w^T (+ bias) with RoPE on its q/k heads and k, v written
    to the cache rows `slots` -> (qkv (M, N), h or None). config: (BLOCK_P, BLOCK_K, warps)."""
    name = "gemv_rms_norm_rope"
    M, K = x.shape if x.dim() == 2 else (-1, -1)
    _check(name, x, w, bias, K)
    N = (n_q_heads + 2 * n_kv_heads) * head_dim
    if n_q_heads < 1 or n_kv_heads < 1 or head_dim < 2 or head_dim % 2 or w.shape[0] != N:
        raise ValueError(f"{name}: w {tuple(w.shape)} must have (n_q_heads "
                         f"{n_q_heads} + 2 * n_kv_heads {n_kv_heads}) * head_dim {head_dim} "
                         "rows, head_dim even")
    if norm_weight.shape != (K,) or norm_weight.device != x.device:
        raise ValueError(f"{name}: norm_weight must be ({K},) on {x.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or residual.stride(-1) != 1):
        raise ValueError(f"{name}: residual must match x (shape, dtype, device, "
                         "contiguous last dim)")
    half = head_dim // 2
    if cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(f"{name}: cos and sin must be (max_pos, {half}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    for what, t in (("positions", positions), ("slots", slots)):
        if t.shape != (M,) or t.dtype not in (torch.int32, torch.int64) or t.device != x.device:
            raise ValueError(f"{name}: {what} must be int32/int64 ({M},) on "
                             f"{x.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    for what, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (c.dim() != 3 or c.shape[1:] != (n_kv_heads, head_dim) or c.dtype != x.dtype
                or c.stride(-1) != 1 or c.device != x.device):
            raise ValueError(f"{name}: {what} must be (slots, {n_kv_heads}, {head_dim}) "
                             f"{x.dtype} on {x.device}, contiguous last dim; got "
                             f"{tuple(c.shape)} {c.dtype} on {c.device}")
    if config is not None:
        try:
            _unpack(config)
        except ValueError:
            raise ValueError(f"{name}: config (BLOCK_P, BLOCK_K, warps[, stages]) "
                             f"must be three powers of two and a stage count, got {config}"
                             ) from None
    if not interpreter.use_triton(impl, x, name):
        return gemv_rms_norm_rope_reference(x, w, norm_weight, eps, residual, bias, cos, sin,
                                            positions, k_cache, v_cache, slots, n_q_heads,
                                            n_kv_heads, head_dim)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    block_p, block_k, warps, stages = _unpack(config or config_for(N, K))
    block_m = next_pow2(M)
    if block_m > 1:  # the 3D product tiles (two of them): keep them within the registers
        block_k = min(block_k, max(16, 2048 // (block_m * block_p)))
    r = residual if residual is not None else x
    cos_c, sin_c = cos.contiguous(), sin.contiguous()
    _gemv_rope_kernel[(cdiv(N // 2, block_p),)](
        x, r, x if h is None else h, norm_weight.contiguous(), w,
        x if bias is None else bias, y, cos_c, sin_c, positions, slots, k_cache, v_cache,
        M, x.stride(0), r.stride(0), w.stride(0), y.stride(0), cos_c.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), float(eps),
        K=K, N_PAIRS=N // 2, HALF=half, HEAD_D=head_dim, NQ=n_q_heads, NKV=n_kv_heads,
        PROLOGUE=_RMS, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        STATS_K=max(16, min(next_pow2(K), 8192 // block_m)), STAGES=stages, num_warps=warps,
        PDL_EARLY=pdl_early(), **pdl_launch(x.device),
    )
    return y, h
