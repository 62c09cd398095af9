"""RMSNorm and LayerNorm over the last dim, optionally fused with the residual add.

    rms_norm:   y = x / sqrt(mean(x^2) + eps) * weight                      (Llama, HF LlamaRMSNorm)
    layer_norm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      (biased variance)

Shapes: x (..., hidden), weight and bias (hidden,); y has x's shape and dtype. Statistics are
computed in fp32 whatever the input dtype. With `residual` (x's shape and dtype) the kernel
first forms h = x + residual (rounded to x's dtype, exactly as an eager `x + residual`
would), writes h -- the new residual stream of a transformer block -- normalises h, and
returns (y, h). One launch replaces the eager add + pow + mean + rsqrt + mul + mul chain.

rms_norm follows HF's LlamaRMSNorm arithmetic: x * rstd is rounded to x's dtype before
the weight multiplies it, so bf16 results match HF's eager module.

The kernel: one program per row (token). Rows up to MAX_FUSED_COLS wide sit in registers:
the row is read once, reduced, normalised and written once. Wider rows go in N_CHUNKS
chunks: a statistics pass (which also writes h), then a normalise pass that re-reads the
row (mostly from L2). LayerNorm's chunked variance uses the shifted-data formula
var = E[(x-K)^2] - E[x-K]^2 with K = the row's first element, which avoids the cancellation
of E[x^2] - E[x]^2 when |mean| >> std.

    FLOPs  rms_norm   = 4 * rows * hidden (+ rows * hidden with residual)
           layer_norm = 7 * rows * hidden (+ rows * hidden with residual)
    bytes  = (2 + 2 * has_residual) * rows * hidden * itemsize
             + (1 + has_bias) * hidden * w_itemsize
             (read x [and residual], write y [and h], read the weights once)
"""
from __future__ import annotations

import functools

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl

from .host import cdiv, next_pow2
from .inputs import check_like

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Widest row kept whole in registers (16384 fp32 over 16 warps = 32 values per thread).
MAX_FUSED_COLS = 16384


@triton.jit
def _load_row_chunk(x_ptr, r_ptr, h_ptr, base, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """Load x (and h = x + residual, which is stored) for one chunk of a row, as fp32."""
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + base + cols, mask=mask, other=0.0)
        # Round h to the activation dtype, as an eager `x + residual` would, and normalise
        # the rounded value, so the fused and unfused blocks agree exactly.
        h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + base + cols, h, mask=mask)
        x = h
    return x.to(tl.float32)


@triton.jit
def _normalise_store(x, rstd, mean, w_ptr, b_ptr, y_ptr, base, cols, mask,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        # HF LlamaRMSNorm: round x * rstd to the activation dtype, then scale by the weight.
        y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        y = (x - mean) * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_kernel(x_ptr, r_ptr, h_ptr, w_ptr, b_ptr, y_ptr, n_cols, eps,
                 IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    offs = tl.arange(0, BLOCK)
    if N_CHUNKS == 1:
        # The whole row in registers: read once, two exact reductions, write once.
        mask = offs < n_cols
        x = _load_row_chunk(x_ptr, r_ptr, h_ptr, base, offs, mask, HAS_RESIDUAL)
        if IS_RMS:
            mean = 0.0
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        else:
            mean = tl.sum(x, axis=0) / n_cols
            xc = tl.where(mask, x - mean, 0.0)  # padding lanes must not add (0 - mean)^2
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        _normalise_store(x, rstd, mean, w_ptr, b_ptr, y_ptr, base, offs, mask, IS_RMS, HAS_BIAS)
    else:
        # Pass 1: statistics (and h), accumulated lane-wise and reduced once at the end.
        if IS_RMS:
            shift = 0.0
        elif HAS_RESIDUAL:
            shift = tl.load(x_ptr + base).to(tl.float32) + tl.load(r_ptr + base).to(tl.float32)
            shift = shift.to(h_ptr.dtype.element_ty).to(tl.float32)  # h[0], rounded like h
        else:
            shift = tl.load(x_ptr + base).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
        # Constexpr trip count: Triton 3.6's interpreter cannot loop to a runtime bound
        # under numpy >= 2.4.
        for i in range(N_CHUNKS):
            cols = i * BLOCK + offs
            mask = cols < n_cols
            x = _load_row_chunk(x_ptr, r_ptr, h_ptr, base, cols, mask, HAS_RESIDUAL)
            xs = tl.where(mask, x - shift, 0.0)
            acc += xs
            acc_sq += xs * xs
        if IS_RMS:
            mean = 0.0
            rstd = 1.0 / tl.sqrt(tl.sum(acc_sq, axis=0) / n_cols + eps)
        else:
            mean_s = tl.sum(acc, axis=0) / n_cols  # mean of x - shift
            var = tl.maximum(tl.sum(acc_sq, axis=0) / n_cols - mean_s * mean_s, 0.0)
            rstd = 1.0 / tl.sqrt(var + eps)
            mean = mean_s + shift
        # Make this program's h stores visible to all its threads before re-reading h.
        tl.debug_barrier()
        src_ptr = h_ptr if HAS_RESIDUAL else x_ptr
        for i in range(N_CHUNKS):
            cols = i * BLOCK + offs
            mask = cols < n_cols
            x = tl.load(src_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            _normalise_store(x, rstd, mean, w_ptr, b_ptr, y_ptr, base, cols, mask, IS_RMS, HAS_BIAS)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Eager torch, HF LlamaRMSNorm arithmetic: fp32 statistics, x*rstd rounded, times weight."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = (weight * normed).to(x.dtype)  # HF: weight * normed in the weight's dtype
    return y if residual is None else (y, h)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    eps: float = 1e-5, residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch.nn.functional.layer_norm on h = x (+ residual), in fp32, returned in x's dtype."""
    h = x if residual is None else x + residual
    b = None if bias is None else bias.float()
    y = torch.nn.functional.layer_norm(h.float(), (h.shape[-1],), weight.float(), b, eps)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def _check(name: str, x: torch.Tensor, params: dict[str, torch.Tensor | None],
           residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name}: x must be (..., hidden) with hidden >= 1, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}: unsupported dtype {x.dtype}; expected one of {_DTYPES}")
    for pname, p in params.items():
        if p is None:
            continue
        if p.shape != (x.shape[-1],):
            raise ValueError(f"{name}: {pname} must have shape ({x.shape[-1]},), got "
                             f"{tuple(p.shape)}")
        if not p.is_floating_point():
            raise ValueError(f"{name}: {pname} must be a float tensor, got {p.dtype}")
        if p.device != x.device:
            raise ValueError(f"{name}: {pname} is on {p.device} but x is on {x.device}")
    if residual is not None:
        check_like(f"{name}: residual", residual, x)


@functools.cache
def _launch_config(hidden: int, max_block: int) -> tuple[int, int, int]:
    """(BLOCK, N_CHUNKS, num_warps) for rows of `hidden` (computed once per width)."""
    block = min(next_pow2(hidden), next_pow2(max_block))
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, cdiv(hidden, block), num_warps


def _norm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None, is_rms: bool, max_block: int = MAX_FUSED_COLS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch the norm kernel; rows wider than max_block take the chunked two-pass path."""
    hidden = x.shape[-1]
    xc = x.contiguous()
    rc = None if residual is None else residual.contiguous()
    y = torch.empty_like(xc)
    h = None if residual is None else torch.empty_like(xc)
    rows = xc.numel() // hidden
    if rows > 0:
        block, n_chunks, num_warps = _launch_config(hidden, max_block)
        # Absent optional tensors: pass x, never dereferenced (the constexpr flags prune them).
        _norm_kernel[(rows,)](
            xc, xc if rc is None else rc, xc if h is None else h, weight.contiguous(),
            xc if bias is None else bias.contiguous(), y, hidden, eps,
            IS_RMS=is_rms, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            BLOCK=block, N_CHUNKS=n_chunks, num_warps=num_warps,
        )
    return y if h is None else (y, h)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
    residual: torch.Tensor | None = None, impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (..., hidden) with weight (hidden,); returns y, or (y, h = x + residual).

    impl: "auto" (our Triton kernel on CUDA, torch on CPU), "triton" (our kernel; on a CPU
    it runs in Triton's interpreter), or "torch" (the reference).
    """
    _check("rms_norm", x, {"weight": weight}, residual)
    if not interpreter.use_triton(impl, x, "rms_norm"):
        return rms_norm_reference(x, weight, eps=eps, residual=residual)
    return _norm_triton(x, weight, None, eps, residual, is_rms=True)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    eps: float = 1e-5, residual: torch.Tensor | None = None, impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of x (..., hidden) with weight and optional bias (hidden,); returns y, or
    (y, h = x + residual). impl: "auto", "triton" or "torch" as for rms_norm."""
    _check("layer_norm", x, {"weight": weight, "bias": bias}, residual)
    if not interpreter.use_triton(impl, x, "layer_norm"):
        return layer_norm_reference(x, weight, bias, eps=eps, residual=residual)
    return _norm_triton(x, weight, bias, eps, residual, is_rms=False)
