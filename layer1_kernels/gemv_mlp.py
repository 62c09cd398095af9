"""A decode step's whole MLP in one launch: y = down(silu(gate) * up) of rms_norm(x + residual).

    gemv_mlp(x, w_gate_up, w_down, norm_weight, eps, residual=None)  -> (y (M, H), h or None)

Shapes: x, residual (M <= 8, H); w_gate_up (2F, H) = [gate; up] (an nn.Linear weight, read in
place), w_down (H, F); norm_weight (H,). h = x + residual is the new residual (None without
one). fp16/bf16/fp32, fp32 accumulation.

Why one kernel. Two GEMVs in a row (gemv_rms_norm's gate_up, then gemv_silu_mul's down) each
spend ~3 us ramping up and draining: the down GEMV cannot stream its weights until the
gate_up GEMV has finished every intermediate feature. Here nothing waits for the whole grid:
program p owns BLOCK_F intermediate features [p * BLOCK_F, (p + 1) * BLOCK_F) and
  1. computes the RMSNorm statistics of h as gemv's prologue does (program 0 writes h),
  2. g, u = its BLOCK_F rows of gate and of up times n(h) (two weight streams),
  3. a = silu(g) * u, with the two-kernel path's roundings: g and u rounded to the
     activations' dtype (gemv_rms_norm's output), silu * mul in fp32 rounded once,
  4. its partial down product y_p = W_down[:, slice] @ a for every output column, tile by
     tile of BLOCK_H columns (each of W_down's rows gives BLOCK_F contiguous values), stored
     in fp32 in a workspace (P, M, H),
  5. per tile, an arrival counter: the last program to arrive sums the tile's P partials (a
     fixed order: the same bits whichever program is last), stores y and sets the counter
     back to 0 (so CUDA graphs replay it). skinny_matmul's split K does the same.
Programs visit the output tiles in a rotated order (program p starts at tile p % tiles), so
the last arrivals -- and their sums -- spread over programs instead of falling on one.

    FLOPs = 6 * M * F * H        bytes ~ 3 * F * H * w_itemsize (+ the (P, M, H) fp32 partials)
"""
from __future__ import annotations

import functools

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .gemv import (
    MAX_ROWS,
    _act_tile,
    _check,
    _first_tile,
    _mac,
    _prologue,
    _w_tile,
    gemv_rms_norm_reference,
    gemv_silu_mul_reference,
    pdl_early,
    pdl_launch,
)
from .host import cdiv, next_pow2


@triton.jit
def _down_tile(wd_ptr, stride_d, t, offs_h, f, f_ok, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """W_down's (BLOCK_H, BLOCK_F) tile of output tile t: rows t * BLOCK_H.., this program's
    feature columns (BLOCK_F contiguous values a row)."""
    hh = t * BLOCK_H + offs_h
    return tl.load(wd_ptr + hh.to(tl.int64)[:, None] * stride_d + f[None, :],
                   mask=(hh < K)[:, None] & f_ok[None, :], other=0.0)


@triton.jit
def _gemv_mlp_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, wgu_ptr, wd_ptr, y_ptr, part_ptr, count_ptr,
                     M, stride_xm, stride_rm, stride_gu, stride_d, stride_ym, eps,
                     K: tl.constexpr, F: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_H: tl.constexpr, TILES_H: tl.constexpr, RED_P: tl.constexpr,
                     EVEN_K: tl.constexpr, STATS_K: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    OUT_TY: tl.constexpr = x_ptr.dtype.element_ty
    f = pid * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < F
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    offs_k = tl.arange(0, BLOCK_K)
    g_rows = wgu_ptr + f.to(tl.int64)[:, None] * stride_gu
    u_rows = wgu_ptr + (f + F).to(tl.int64)[:, None] * stride_gu

    # gate_up, as gemv_rms_norm: the first tiles requested before the PDL wait
    wg = _w_tile(g_rows, offs_k, f_ok, K, EVEN_K)
    wu = _w_tile(u_rows, offs_k, f_ok, K, EVEN_K)
    rstd = _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, eps, K, 1,
                     HAS_RESIDUAL, BLOCK_M, STATS_K, OUT_TY, PDL, PDL_EARLY)
    if BLOCK_M == 1:
        acc_g = tl.zeros([BLOCK_F, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_F, BLOCK_K], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    acc_g, acc_u = _first_tile(acc_g, acc_u, wg, wu, x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm,
                               stride_rm, m, m_ok, offs_k, rstd, K, 1, HAS_RESIDUAL, pid == 0,
                               OUT_TY, EVEN_K, BLOCK_M)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        wg = _w_tile(g_rows, k, f_ok, K, EVEN_K)
        wu = _w_tile(u_rows, k, f_ok, K, EVEN_K)
        a = _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, k, rstd, K,
                      1, HAS_RESIDUAL, pid == 0, OUT_TY, EVEN_K)
        acc_g = _mac(acc_g, wg, a, BLOCK_M)
        acc_u = _mac(acc_u, wu, a, BLOCK_M)
    if PDL and not PDL_EARLY:  # the next kernel may launch (it waits for us before its reads)
        gdc_launch_dependents()
    # down's first weight tile, requested before gate_up's epilogue; each loop step below
    # requests the next tile's before it multiplies, stores and syncs the current one
    offs_h = tl.arange(0, BLOCK_H)
    wd = _down_tile(wd_ptr, stride_d, pid % TILES_H, offs_h, f, f_ok, K, BLOCK_H)
    if BLOCK_M == 1:
        g = tl.sum(acc_g, 1)[None, :]
        u = tl.sum(acc_u, 1)[None, :]
    else:
        g = acc_g
        u = acc_u
    # the two-kernel path's roundings: gate_up's output in the activations' dtype, then
    # silu(g) * u in fp32 rounded once (gemv_silu_mul's prologue); 0 past F (g = u = 0)
    g = g.to(OUT_TY).to(tl.float32)
    u = u.to(OUT_TY).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g)) * u).to(OUT_TY).to(tl.float32)  # (BLOCK_M, BLOCK_F)

    # down: this program's partial product for every output tile, the last to arrive sums
    for i in range(TILES_H):
        t = (pid + i) % TILES_H
        hh = t * BLOCK_H + offs_h
        h_ok = hh < K
        w = wd.to(tl.float32)
        # (the last step's "next" is the first tile again: a re-read from L2, never used)
        wd = _down_tile(wd_ptr, stride_d, (pid + i + 1) % TILES_H, offs_h, f, f_ok, K, BLOCK_H)
        if BLOCK_M == 1:
            yp = tl.sum(w * act, 1)[None, :]
        else:
            yp = tl.sum(w[None, :, :] * act[:, None, :], 2)  # (BLOCK_M, BLOCK_H)
        tl.store(part_ptr + (pid * M + m[:, None]) * K + hh[None, :], yp,
                 mask=m_ok[:, None] & h_ok[None, :])
        tl.debug_barrier()  # every thread's partials stored before the release
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
        if arrived == P - 1:
            total = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
            for s0 in range(0, P, RED_P):  # RED_P programs' partials a load, summed as a tree
                s = s0 + tl.arange(0, RED_P)
                blk = tl.load(part_ptr + (s[:, None, None] * M + m[None, :, None]) * K
                              + hh[None, None, :],
                              mask=(s < P)[:, None, None] & m_ok[None, :, None]
                              & h_ok[None, None, :], other=0.0, cache_modifier=".cg")
                total += tl.sum(blk, 0)
            tl.store(y_ptr + m[:, None] * stride_ym + hh[None, :],
                     total.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & h_ok[None, :])
            tl.store(count_ptr + t, 0)


# ---- workspace ----------------------------------------------------------------------------------
_WORK: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, partials: int, tiles: int):
    """(fp32 partials, int32 arrival counters) of a device, grown when needed. The counters
    are zeros that every call leaves zero, so a CUDA graph replays them; both are allocated
    on the first call (the engine warms up before it captures graphs)."""
    part, count = _WORK.get(device, (None, None))
    if part is None or part.numel() < partials or count.numel() < tiles:
        part = torch.empty(max(partials, 0 if part is None else part.numel()),
                           dtype=torch.float32, device=device)
        count = torch.zeros(max(tiles, 256), dtype=torch.int32, device=device)
        _WORK[device] = part, count
    return part, count


# ---- configs ------------------------------------------------------------------------------------
#: (BLOCK_F, BLOCK_K, BLOCK_H, warps[, stages]) per (F, H) once measured (benchmarks/
#: gemv_mlp_ab.py); untuned shapes take _default_config.
TUNED: dict[tuple[int, int], tuple[int, ...]] = {}


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_config(f: int, h: int, device: torch.device) -> tuple[int, ...]:
    if interpreter.INTERPRETED or device.type != "cuda":
        return 16, 16, 16, 1
    # one wave: the narrowest slice (>= 32 features: 64-byte rows of W_down) whose programs
    # fit on the SMs
    sms = _sms(device.index if device.index is not None else torch.cuda.current_device())
    block_f = next((b for b in (32, 64, 128) if cdiv(f, b) <= sms), 128)
    # (eight warps with a pipelined K loop (stages > 1) spill kilobytes a thread for sm_90:
    # tests/layer1/test_gemv_mlp.py compiles the 1B pick and checks ptxas's spill count)
    return block_f, min(128 if block_f <= 64 else 64, next_pow2(h)), min(256, next_pow2(h)), 8, 1


def config_for(f: int, h: int, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_F, BLOCK_K, BLOCK_H, warps[, stages]) a call with F features and H columns
    launches with: TUNED's entry, else _default_config."""
    return TUNED.get((f, h)) or _default_config(f, h, device)


def _unpack(config) -> tuple[int, ...]:
    if len(config) not in (4, 5) or any(int(v) < 1 for v in config) or any(
            v & (v - 1) for v in config[:4]):
        raise ValueError(f"config must be (BLOCK_F, BLOCK_K, BLOCK_H, warps[, stages]): four "
                         f"powers of two and a stage count >= 1, got {config}")
    return (*(int(v) for v in config[:4]), int(config[4]) if len(config) == 5 else 1)


# ---- reference and public op --------------------------------------------------------------------
def gemv_mlp_reference(x, w_gate_up, w_down, norm_weight, eps, residual=None):
    """The two-kernel path's references composed: gemv_rms_norm's, then gemv_silu_mul's."""
    gu, h = gemv_rms_norm_reference(x, w_gate_up, norm_weight, eps, residual)
    return gemv_silu_mul_reference(gu, w_down), h


def gemv_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             impl: str = "auto", config: tuple[int, ...] | None = None):
    """down(silu(gate) * up) of rms_norm(h = x (+ residual)) -> (y (M, H), h or None), one
    launch. w_gate_up (2F, H) = [gate; up], w_down (H, F). config: (BLOCK_F, BLOCK_K,
    BLOCK_H, warps[, stages])."""
    H = x.shape[-1] if x.dim() == 2 else -1
    _check("gemv_mlp", x, w_gate_up, None, H)
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"gemv_mlp: w_gate_up must be (2F, H), got {tuple(w_gate_up.shape)}")
    F = w_gate_up.shape[0] // 2
    if (w_down.dim() != 2 or w_down.shape != (H, F) or w_down.dtype != x.dtype
            or w_down.device != x.device or w_down.stride(-1) != 1):
        raise ValueError(f"gemv_mlp: w_down must be ({H}, {F}) in x's dtype, device, contiguous "
                         f"last dim, got {tuple(w_down.shape)} {w_down.dtype}")
    if norm_weight.shape != (H,) or norm_weight.device != x.device:
        raise ValueError(f"gemv_mlp: norm_weight must be ({H},) on {x.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or residual.stride(-1) != 1):
        raise ValueError("gemv_mlp: residual must match x (shape, dtype, device, contiguous "
                         "last dim)")
    if not interpreter.use_triton(impl, x, "gemv_mlp"):
        return gemv_mlp_reference(x, w_gate_up, w_down, norm_weight, eps, residual)
    M = x.shape[0]
    block_f, block_k, block_h, warps, stages = _unpack(config or config_for(F, H, x.device))
    block_m = next_pow2(M)
    if block_m > 1:  # the 3D product tiles: keep them within the registers
        block_k = min(block_k, max(16, 4096 // (block_m * block_f)))
        block_h = min(block_h, max(16, 4096 // (block_m * block_f)))
    programs, tiles = cdiv(F, block_f), cdiv(H, block_h)
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    h = torch.empty((M, H), dtype=x.dtype, device=x.device) if residual is not None else None
    part, count = _workspace(x.device, programs * M * H, tiles)
    r = residual if residual is not None else x
    _gemv_mlp_kernel[(programs,)](
        x, r, x if h is None else h, norm_weight.contiguous(), w_gate_up, w_down, y, part,
        count, M, x.stride(0), r.stride(0), w_gate_up.stride(0), w_down.stride(0), y.stride(0),
        float(eps), K=H, F=F, HAS_RESIDUAL=residual is not None, BLOCK_M=block_m,
        BLOCK_F=block_f, BLOCK_K=block_k, BLOCK_H=block_h, TILES_H=tiles,
        RED_P=max(1, min(next_pow2(programs), 8192 // (block_m * block_h))),
        EVEN_K=H % block_k == 0, STATS_K=max(16, min(next_pow2(H), 8192 // block_m)),
        STAGES=stages, num_warps=warps, PDL_EARLY=pdl_early(), **pdl_launch(x.device))
    return y, h


__all__ = ["MAX_ROWS", "gemv_mlp", "gemv_mlp_reference", "config_for", "TUNED"]
