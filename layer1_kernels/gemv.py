"""Skinny matrix products for decode: y = a @ W^T for a few rows (M <= 8 tokens), with the
op before the product fused into the kernel's prologue.

    gemv(x, w, bias=None)                          y = x @ w^T (+ bias)
    gemv_rms_norm(x, w, norm_w, eps, residual)     h = x + residual; y = rms_norm(h) @ w^T
                                                   returns (y, h): h is the new residual
    gemv_silu_mul(gu, w)                           y = (silu(gate) * up) @ w^T, gu = [gate | up]

Shapes: x (M, K), w (N, K) row-major (an nn.Linear weight, read in place), bias (N,),
gu (M, 2K); y (M, N) in x's dtype. fp16/bf16/fp32, fp32 accumulation.

Why a kernel of its own. At batch 1 a projection is a matrix-vector product: each weight
byte is used once, so the only goal is streaming W at copy bandwidth. That needs every SM
busy: program n owns BLOCK_N output columns (rows of W) and walks all of K in BLOCK_K steps,
each step loading a (BLOCK_N, BLOCK_K) tile of W -- wide 16-byte loads, many in flight --
and multiplying it by the activations' BLOCK_K values (which come from L2: every program
reads the same row). A fp32 (BLOCK_N, BLOCK_K) accumulator is reduced over K once at the
end. Small BLOCK_N gives N / BLOCK_N programs: 192 for Llama-3.2-1B's qkv (N = 3072) at 16.

Why fuse the prologue. The op before each projection is elementwise on the activation row
(RMSNorm with the residual add; SiLU-and-multiply), a few KB: its own launch costs more
than its bytes. Each program recomputes it for the K values it reads (the norm's
statistics need the whole row: a first pass over the row, from L2), and program 0 alone
writes the new residual h. The arithmetic matches the unfused kernels': h rounded to the
activation dtype, then round(h * rstd) * weight rounded (HF's LlamaRMSNorm); silu(g) * u in
fp32, rounded once (layer 1's silu_and_mul).

    FLOPs = 2 * M * N * K          bytes ~ N * K * w_itemsize (+ M * K activations)
"""
from __future__ import annotations

import functools

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .host import cdiv, next_pow2

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Most rows (tokens) one call takes: the register tiles hold all of them.
MAX_ROWS = 8
_NONE, _RMS, _SILU = 0, 1, 2


@triton.jit
def _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, k, rstd,
              K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              WRITE_H, OUT_TY: tl.constexpr, EVEN_K: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) activations the product needs at columns k, in fp32."""
    if EVEN_K:  # no column mask: the loads stay 16 bytes wide
        mask = m_ok[:, None]
    else:
        mask = m_ok[:, None] & (k[None, :] < K)
    if PROLOGUE == 2:  # silu(gate) * up, one rounding
        g = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
        u = tl.load(x_ptr + m[:, None] * stride_xm + K + k[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u.to(tl.float32)).to(OUT_TY).to(tl.float32)
    else:
        a = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + m[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
            a = (a.to(tl.float32) + r.to(tl.float32)).to(OUT_TY)
            if WRITE_H:
                tl.store(h_ptr + m[:, None] * K + k[None, :], a, mask=mask)
        a = a.to(tl.float32)
        if PROLOGUE == 1:
            if EVEN_K:
                nw = tl.load(nw_ptr + k).to(tl.float32)
            else:
                nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            a = (a * rstd[:, None]).to(OUT_TY).to(tl.float32) * nw[None, :]
            a = a.to(OUT_TY).to(tl.float32)
    return a


@triton.jit
def _w_tile(w_rows, k, n_ok, K: tl.constexpr, EVEN_K: tl.constexpr):
    # (one return, after an if/else: Triton's compiler does not stop at a return inside a
    # constexpr branch, the interpreter does)
    if EVEN_K:
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
    else:
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
    return w


@triton.jit
def _mac(acc, w, a, BLOCK_M: tl.constexpr):
    if BLOCK_M == 1:  # (BLOCK_N, BLOCK_K) * (1, BLOCK_K): reduced over K once, at the end
        acc = acc + w.to(tl.float32) * a
    else:
        acc = acc + tl.sum(w.to(tl.float32)[None, :, :] * a[:, None, :], 2)
    return acc


@triton.jit
def _first_tile(acc, acc2, w, w2, x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok,
                offs_k, rstd, K: tl.constexpr, PROLOGUE: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, WRITE_H, OUT_TY: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The K loop's first tile, whose weights were requested before the PDL wait: the
    activations at those columns (_act_tile), multiplied into acc by w and, where w2 is not
    None, into acc2 by w2 -> (acc, acc2). Shared by _gemv_kernel (one accumulator: w2 None,
    acc2 comes back as passed) and gemv_rope._gemv_rope_kernel (two: the low and the high
    column of each rotated pair, over the same activations), so both peel it the same way."""
    a = _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, offs_k, rstd, K,
                  PROLOGUE, HAS_RESIDUAL, WRITE_H, OUT_TY, EVEN_K)
    acc = _mac(acc, w, a, BLOCK_M)
    if w2 is not None:
        acc2 = _mac(acc2, w2, a, BLOCK_M)
    return acc, acc2


@triton.jit
def _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, eps,
              K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              BLOCK_M: tl.constexpr, STATS_K: tl.constexpr, OUT_TY: tl.constexpr,
              PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    """What gemv and gemv_rope do once their first weight tiles are requested (those do not
    depend on the kernel before). Under programmatic dependent launch (PDL): let the next
    kernel launch now (PDL_EARLY: its weight prefetch overlaps ours), then wait for the
    previous kernel's results. Then the RMSNorm statistics, 1 / sqrt(mean(h^2) + eps) per row
    of h (= x, or x + residual), from a pass over the whole (L2-resident) row in STATS_K-wide
    pieces (usually one: a single round trip to L2); zeros when there is no norm."""
    if PDL:
        if PDL_EARLY:
            gdc_launch_dependents()
        gdc_wait()
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, STATS_K):
            h = _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok,
                          k0 + tl.arange(0, STATS_K), rstd, K, 0, HAS_RESIDUAL, False, OUT_TY,
                          K % STATS_K == 0)
            ss += tl.sum(h * h, 1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    return rstd


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, w_ptr, b_ptr, y_ptr,
                 M, N, stride_xm, stride_rm, stride_wn, stride_ym, eps,
                 K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STATS_K: tl.constexpr,
                 STAGES: tl.constexpr, PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    pid = tl.program_id(0)
    OUT_TY: tl.constexpr = x_ptr.dtype.element_ty  # activations' rounding (y may be fp32)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn

    # The first weight tile does not depend on the kernel before: under programmatic dependent
    # launch (PDL) it is requested before waiting for that kernel's results.
    w0 = _w_tile(w_rows, offs_k, n_ok, K, EVEN_K)
    rstd = _prologue(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, eps, K,
                     PROLOGUE, HAS_RESIDUAL, BLOCK_M, STATS_K, OUT_TY, PDL, PDL_EARLY)

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc, _ = _first_tile(acc, acc, w0, None, x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm,
                         m, m_ok, offs_k, rstd, K, PROLOGUE, HAS_RESIDUAL, pid == 0, OUT_TY,
                         EVEN_K, BLOCK_M)
    # STAGES > 1: Triton's pipeliner copies the next STAGES - 1 tiles into shared memory
    # (cp.async) while this one is multiplied: bytes in flight without holding registers
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        w = _w_tile(w_rows, k, n_ok, K, EVEN_K)
        a = _act_tile(x_ptr, r_ptr, h_ptr, nw_ptr, stride_xm, stride_rm, m, m_ok, k, rstd, K,
                      PROLOGUE, HAS_RESIDUAL, pid == 0, OUT_TY, EVEN_K)
        acc = _mac(acc, w, a, BLOCK_M)
    if PDL and not PDL_EARLY:  # the next kernel may launch (it waits for us before its reads)
        gdc_launch_dependents()
    if BLOCK_M == 1:
        out = tl.sum(acc, 1)[None, :]
    else:
        out = acc
    if HAS_BIAS:
        out += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # rounded to the activations' dtype even into a fp32 y (the logits: what .float() gives)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :],
             out.to(OUT_TY).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---- programmatic dependent launch --------------------------------------------------------------
#: Launch the decode kernels with PDL on GPUs that have it (Hopper on): each may start while
#: the kernel before it drains, loading what does not depend on it (weights), and waits
#: (griddepcontrol.wait) before reading that kernel's results. Every PDL kernel waits before it
#: exits, so the chain of dependencies stays transitive. set_pdl(False) turns it off.
#: early: the GEMVs trigger their dependents right after their first weight tile is requested
#: instead of after their K loop, so the next kernel's programs launch (and prefetch their
#: weights) while this one still streams; safe because no kernel reads anything another
#: kernel of the step writes before its own griddepcontrol.wait.
_PDL = {"on": True, "early": False}


def set_pdl(on: bool, *, early: bool | None = None) -> None:
    _PDL["on"] = bool(on)
    if early is not None:
        _PDL["early"] = bool(early)


def pdl_early() -> bool:
    """Whether the GEMVs trigger their dependents early (set_pdl's early)."""
    return _PDL["early"]


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords for a decode kernel: PDL=True plus launch_pdl where available."""
    on = (_PDL["on"] and not interpreter.INTERPRETED and device.type == "cuda"
          and _has_pdl(device.index if device.index is not None else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


# ---- configs ----------------------------------------------------------------------------------
#: (BLOCK_N, BLOCK_K, warps[, stages]) per (N, K) at batch 1, launched with PDL: the picks of
#: benchmarks/gemv_shapes_sweep.py on an H200 (CUDA-graph replay, weights rotated past L2,
#: ~28 configs a shape, each checked against the reference) at rank 0's shapes of
#: Llama-3.1-8B at TP=1/2/4 and Llama-3.2-1B at TP=1/2 (layer 5's shard: heads, FFN width and
#: vocab split). The old entry stays where it was within 1 % of the best. us per call, old
#: (4, 2048, 4) default -> pick; "% copy" = read TB/s over a D2D copy's (read + write) TB/s of
#: the same bytes:
#:   8B TP=4  gate_up 19.0 -> 16.4 (92 %), down 11.2 -> 9.2 (83 %), lm_head 69.4 -> 63.5;
#:            o_proj 3.6 (72 %) and qkv+rope 5.3 (66 %, gemv_rope) keep their tiles: too short
#:            (8-13 MB) for any tile to hide the kernel's ~2 us of launch, ramp and drain
#:   8B TP=2  gate_up 33.6 -> 30.2, down 18.5 -> 16.0, o_proj 5.5 -> 5.3, lm_head 133 -> 122
#:   8B TP=1  gate_up 62.3 -> 56.8, down 32.8 -> 29.3, o_proj 10.2 -> 9.2, lm_head 261 -> 238
#:   1B       TP=1 gate_up 19.8 -> 18.4, lm_head 148 -> 118; TP=2 gate_up 11.4 -> 10.2,
#:            down 6.6 -> 5.8
#: One layer's chain (qkv, o_proj, gate_up, down; a non-PDL kernel where TP's all-reduces
#: are), us: 8B TP=4 42.6 -> 39.3, TP=2 71.1 -> 64.5, TP=1 119.8 -> 109.9; 1B TP=2 30.3 ->
#: 27.3, TP=1 38.6 -> 37.2. Wide-N products want 4-8 rows x 1024 columns (two K steps at
#: K = 2048, four at 4096) over the old 4 x 2048; the down projections (large K) a pipelined
#: 8 x 512 tile, three stages. The 1B qkv (3072, 2048) entry is the plain GEMV's (fuse_rope
#: off), from the earlier H100 sweep (benchmarks/decode_kernels_bench.py).
TUNED: dict[tuple[int, int], tuple[int, ...]] = {
    # Llama-3.1-8B, rank 0 at TP=1 / 2 / 4: o_proj, gate_up, down, lm_head
    (4096, 4096): (1, 4096, 8), (28672, 4096): (4, 1024, 4), (4096, 14336): (8, 512, 4, 3),
    (128256, 4096): (16, 256, 4, 3),
    (4096, 2048): (2, 2048, 8), (14336, 4096): (4, 1024, 4), (4096, 7168): (8, 512, 4, 3),
    (64128, 4096): (8, 1024, 4),
    (4096, 1024): (4, 1024, 4), (7168, 4096): (4, 1024, 4), (4096, 3584): (8, 512, 4, 3),
    (32064, 4096): (4, 1024, 4),
    # Llama-3.2-1B at TP=1 / 2: (qkv without RoPE,) o_proj, gate_up, down, lm_head
    (3072, 2048): (2, 2048, 8), (2048, 2048): (2, 2048, 8), (16384, 2048): (8, 1024, 4),
    (2048, 8192): (8, 2048, 8), (128256, 2048): (8, 1024, 4),
    (2048, 1024): (2, 1024, 4), (8192, 2048): (8, 1024, 4), (2048, 4096): (4, 2048, 8),
    (64128, 2048): (8, 1024, 4),
}


def _default_config(n: int, k: int, rows: int) -> tuple[int, int, int]:
    if interpreter.INTERPRETED:
        return 4, 16, 1
    # Untuned guess. Large products (>= 16M weights): 8 rows x 1024 columns, within 3.2 % of
    # the best at every such shape swept (above) but the 1B down (12 %); smaller ones: many
    # small programs, each loading a wide K tile at once (a loop step waits for its loads:
    # few steps, many programs per SM keep enough bytes in flight).
    if n * k >= 1 << 24:
        return 8, min(1024, next_pow2(k)), 4
    return 4, min(2048, next_pow2(k)), 4


def config_for(n: int, k: int, rows: int = 1) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, warps[, stages]) a call with w (n, k) and `rows` rows launches
    with, before the rows > 1 cut of BLOCK_K: TUNED's entry for the shape, else
    _default_config."""
    return TUNED.get((n, k)) or _default_config(n, k, rows)


def _unpack(config) -> tuple[int, int, int, int]:
    """(tile, BLOCK_K, warps, stages) of a 3- or 4-entry config (stages 1 when left out)."""
    if len(config) not in (3, 4) or any(int(v) < 1 for v in config) or any(
            v & (v - 1) for v in config[:3]):
        raise ValueError(f"config must be (tile, BLOCK_K, warps[, stages]): three powers of two "
                         f"and a stage count >= 1, got {config}")
    return (*(int(v) for v in config[:3]), int(config[3]) if len(config) == 4 else 1)


def _launch(x, w, bias, prologue, *, residual=None, norm_weight=None, eps=0.0, config=None,
            out_dtype=None):
    M = x.shape[0]
    N, K = w.shape
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    h = torch.empty((M, K), dtype=x.dtype, device=x.device) if residual is not None else None
    if M == 0 or N == 0:
        return y, h
    block_n, block_k, warps, stages = _unpack(config or config_for(N, K, M))
    block_m = next_pow2(M)
    if block_m > 1:  # the 3D product tile: keep it within the registers
        block_k = min(block_k, max(16, 4096 // (block_m * block_n)))
    r = residual if residual is not None else x
    _gemv_kernel[(cdiv(N, block_n),)](
        x, r, x if h is None else h, x if norm_weight is None else norm_weight, w,
        x if bias is None else bias, y,
        M, N, x.stride(0), r.stride(0), w.stride(0), y.stride(0), float(eps),
        K=K, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        STATS_K=max(16, min(next_pow2(K), 8192 // block_m)), STAGES=stages, num_warps=warps,
        PDL_EARLY=pdl_early(),
        **pdl_launch(x.device),
    )
    return y, h


def _check(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           k: int) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{name}: x must be (M, K) and w (N, K), got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: takes 1..{MAX_ROWS} rows (decode tokens), got {x.shape[0]}; "
                         "use a matmul for more")
    if w.shape[1] != k:
        raise ValueError(f"{name}: w {tuple(w.shape)} needs K = {k} columns")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"{name}: x and w must share a dtype in {_DTYPES}, got {x.dtype} and "
                         f"{w.dtype}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"{name}: x and w must be contiguous in their last dimension")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"{name}: bias must be ({w.shape[0]},), got {tuple(bias.shape)}")
    for t in (w, bias):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: every tensor must be on {x.device}, got {t.device}")


# ---- references (the unfused ops, eager torch) ------------------------------------------------
def gemv_reference(x, w, bias=None):
    return torch.nn.functional.linear(x, w, bias)


def gemv_rms_norm_reference(x, w, norm_weight, eps, residual=None, bias=None):
    h = x if residual is None else x + residual
    hf = h.float()
    y = norm_weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = torch.nn.functional.linear(y.to(x.dtype), w, bias)
    return out, (h if residual is not None else None)


def gemv_silu_mul_reference(gu, w, bias=None):
    d = gu.shape[-1] // 2
    a = (torch.nn.functional.silu(gu[:, :d].float()) * gu[:, d:].float()).to(gu.dtype)
    return torch.nn.functional.linear(a, w, bias)


# ---- public ops ---------------------------------------------------------------------------------
def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
         impl: str = "auto", config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x (M <= 8, K) @ w (N, K)^T (+ bias) -> (M, N). config: (BLOCK_N, BLOCK_K, warps)."""
    _check("gemv", x, w, bias, x.shape[-1] if x.dim() == 2 else -1)
    if not interpreter.use_triton(impl, x, "gemv"):
        return gemv_reference(x, w, bias)
    return _launch(x, w, bias, _NONE, config=config)[0]


def gemv_rms_norm(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                  impl: str = "auto", config: tuple[int, int, int] | None = None,
                  out_dtype: torch.dtype | None = None):
    """rms_norm(h = x (+ residual)) @ w^T (+ bias) -> (y (M, N), h (M, K) or None).
    out_dtype (e.g. fp32 logits): y rounded to x's dtype, then stored as out_dtype (what
    `.to(out_dtype)` of the x-dtype result gives, without its own kernel)."""
    K = x.shape[-1] if x.dim() == 2 else -1
    _check("gemv_rms_norm", x, w, bias, K)
    if norm_weight.shape != (K,) or norm_weight.device != x.device:
        raise ValueError(f"gemv_rms_norm: norm_weight must be ({K},) on {x.device}, got "
                         f"{tuple(norm_weight.shape)} on {norm_weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or residual.stride(-1) != 1):
        raise ValueError("gemv_rms_norm: residual must match x (shape, dtype, device, "
                         "contiguous last dim)")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"gemv_rms_norm: out_dtype must be one of {_DTYPES}, got {out_dtype}")
    if not interpreter.use_triton(impl, x, "gemv_rms_norm"):
        y, h = gemv_rms_norm_reference(x, w, norm_weight, eps, residual, bias)
        return (y if out_dtype is None else y.to(out_dtype)), h
    return _launch(x, w, bias, _RMS, residual=residual,
                   norm_weight=norm_weight.contiguous(),
                   eps=eps, config=config, out_dtype=out_dtype)


def gemv_silu_mul(gu: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  impl: str = "auto", config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """(silu(gu[:, :K]) * gu[:, K:]) @ w (N, K)^T (+ bias) -> (M, N)."""
    if gu.dim() != 2 or gu.shape[-1] % 2:
        raise ValueError(f"gemv_silu_mul: gu must be (M, 2K), got {tuple(gu.shape)}")
    _check("gemv_silu_mul", gu, w, bias, gu.shape[-1] // 2)
    if not interpreter.use_triton(impl, gu, "gemv_silu_mul"):
        return gemv_silu_mul_reference(gu, w, bias)
    return _launch(gu, w, bias, _SILU, config=config)[0]
