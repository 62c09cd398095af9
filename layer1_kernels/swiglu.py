"""SiLU-and-multiply: the SwiGLU activation of a Llama MLP, fused as vLLM does it.

    y = silu(a) * b,   a = x[..., :d],  b = x[..., d:],
    silu(a) = a * sigmoid(a) = a / (1 + exp(-a))

The MLP's gate and up projections run as ONE matmul whose output x (tokens, 2d) holds the
gate half a and the up half b side by side; this kernel turns it into y (tokens, d).

Shapes: x (..., 2d) with fp16/bf16/fp32 values; y (..., d) in x's dtype. Math in fp32 and
one rounding at the end (eager bf16 torch rounds after silu and again after the multiply).

The kernel: a 2D grid, (token, block of BLOCK output columns). Each program loads BLOCK
values of a and the matching BLOCK of b from the same row, computes in registers, and
stores BLOCK outputs. Eager torch runs silu(a) and * b as two kernels, writing and
re-reading the (tokens, d) intermediate silu(a): 5 tensor-sized transfers instead of 3.

    FLOPs = 5 * tokens * d       (negate, exp, add, divide, multiply per output)
    bytes = 3 * tokens * d * itemsize   (read a and b once, write y once)
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl

from .host import cdiv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Output columns per program: 1024 (8 per thread at 4 warps) streams well and leaves
#: enough programs (tokens * d / 1024) to fill the GPU even for a single token.
BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, d, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + t * 2 * d
    a = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    # a / (1 + exp(-a)): exp overflows to inf for a << 0, giving a / inf = -0, the right limit.
    y = a / (1.0 + tl.exp(-a)) * b
    tl.store(y_ptr + t * d + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """F.silu(a) * b in fp32, returned in x's dtype (a, b = the halves of x's last dim)."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def silu_and_mul(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x (..., 2d); returns (..., d) in x's dtype.

    impl: "auto" (our Triton kernel on CUDA, torch on CPU), "triton" (our kernel; on a CPU
    it runs in Triton's interpreter), or "torch" (the reference).
    """
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be (..., 2*d) with an even last dim, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; expected one of {_DTYPES}")
    if not interpreter.use_triton(impl, x, "silu_and_mul"):
        return silu_and_mul_reference(x)
    d = x.shape[-1] // 2
    xc = x.contiguous()
    y = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    tokens = y.numel() // d
    grid = (tokens, cdiv(d, BLOCK))
    _silu_and_mul_kernel[grid](xc, y, d, BLOCK=BLOCK, num_warps=4)
    return y
