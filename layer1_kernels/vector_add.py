"""Vector add: the "hello world" of Triton, and the shape of every memory-bound kernel.

    out[i] = x[i] + y[i]        for i in 0 .. n-1   (any shape, treated as flat)

The kernel. The flat index space is cut into blocks of BLOCK elements; program `pid` owns
elements [pid*BLOCK, pid*BLOCK + BLOCK). It loads its slice of x and of y, adds them and
stores the sum. n need not be a multiple of BLOCK: the last program's loads and stores
carry a mask `offs < n`, so lanes past the end neither read nor write memory.

Why it is fast, and how fast it can be. Each element is read twice (x, y) and written once,
and costs one add: 1 FLOP per 3 * itemsize bytes (1/12 FLOP/byte in fp32). Every GPU runs
out of memory bandwidth long before it runs out of adders, so the only goal is to stream
bytes at the copy bandwidth layer 0 measured: contiguous blocks give coalesced, vectorised
(128-bit) loads, and enough programs in flight hide DRAM latency.

    FLOPs = n                   bytes = 3 * n * itemsize   (read x, read y, write out)
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)
from .inputs import check_like, check_operand_pair

# isort: split
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Elements per program: 1024 fp32 = 4 KiB per operand, 8 per thread at 4 warps (two
#: 128-bit loads each), enough work per program to amortise its index arithmetic.
BLOCK = 1024


@triton.jit
def _vector_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    # int64 so that tensors over 2**31 elements index correctly.
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n  # the tail block: lanes past the end touch no memory
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    # Adding in fp32 and rounding once gives the correctly rounded fp16/bf16 sum (what torch
    # computes); it also sidesteps the interpreter, whose numpy has no native bf16 add.
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def vector_add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """torch's elementwise add, the reference: x + y (same shapes, same dtype)."""
    return x + y


def _check(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same shape, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    check_operand_pair("x", x, "y", y, _DTYPES)
    if out is not None:
        check_like("out", out, x)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")


def vector_add(
    x: torch.Tensor, y: torch.Tensor, *, out: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """x + y elementwise. x, y: same shape and float dtype; returns that shape (into `out` if
    given).

    impl: "auto" (our Triton kernel on CUDA, torch on CPU), "triton" (our kernel; on a CPU
    it runs in Triton's interpreter), or "torch" (the reference).
    """
    _check(x, y, out)
    if not interpreter.use_triton(impl, x, "vector_add"):
        if out is None:
            return vector_add_reference(x, y)
        return torch.add(x, y, out=out)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.numel()
    if n == 0:
        return out
    # Non-contiguous inputs are copied once so the kernel can stream flat memory.
    xc, yc = x.contiguous(), y.contiguous()
    grid = (triton.cdiv(n, BLOCK),)
    _vector_add_kernel[grid](xc, yc, out, n, BLOCK=BLOCK, num_warps=4)
    return out
