"""Fused row softmax over the last dimension, numerically stable, one kernel launch.

    y[r, c] = exp(x[r, c] - m_r) / d_r,   m_r = max_c x[r, c],   d_r = sum_c exp(x[r, c] - m_r)

Shapes: x (..., cols), any leading dims (flattened to rows); y has x's shape and dtype.
Math runs in fp32 whatever the input dtype (fp16/bf16 are upcast on load). Subtracting the
row max first keeps every exponent <= 0, so inputs like 1e4 never overflow exp.

Two kernels, one program per row:

* Short rows (cols <= MAX_FUSED_COLS): the whole row is loaded once into registers
  (BLOCK = next power of two >= cols; padding lanes load -inf, so they add exp(-inf) = 0),
  reduced twice (max, then sum of exponentials) and written once: 1 read + 1 write, the
  fewest bytes possible. Written as separate eager ops (max, subtract, exp, sum, divide),
  the same math reads or writes the whole tensor once per op, several times over.
* Long rows: the row no longer fits in registers, so it is read in BLOCK-wide chunks with
  an ONLINE softmax (Milakov & Gimelshein, 2018): a running max m and a running sum d of
  exp(x - m). When a chunk raises the max from m_old to m_new, the sum so far is rescaled,
  d = d * exp(m_old - m_new) + sum(exp(chunk - m_new)), so max and sum come out of ONE pass.
  A second pass reads the row again and writes exp(x - m) / d. That is 2 reads + 1 write,
  against the 3 reads + 1 write of a max pass / sum pass / write pass, and the second read
  of a row a program has just streamed is mostly served from L2. (torch's CUDA softmax keeps
  a long row in shared memory when it fits and otherwise also makes several passes.)

    FLOPs = 5 * rows * cols   (max compare, subtract, exp, add, scale per element)
    bytes = 2 * rows * cols * itemsize   (fewest: read x once, write y once; the online path
            reads x twice, 3 * rows * cols * itemsize, the second read mostly from L2)
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Longest row kept whole in registers: 16384 fp32 values over 16 warps = 32 per thread.
MAX_FUSED_COLS = 16384


@triton.jit
def _softmax_row_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    """One program = one row that fits in one block: load once, reduce twice, store once."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    # Padding lanes read -inf: they never win the max and contribute exp(-inf) = 0.
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    e = tl.exp(x - m)
    d = tl.sum(e, axis=0)
    tl.store(y_ptr + row * n_cols + offs, (e / d).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_online_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr):
    """One program = one long row, in N_CHUNKS chunks: online max+sum pass, then a write pass."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    offs = tl.arange(0, BLOCK)
    m = -float("inf")  # running max of the row so far
    d = 0.0  # running sum of exp(x - m) over the row so far
    # The chunk count is a constexpr (the host knows it) rather than range(0, n_cols, BLOCK):
    # Triton 3.6's interpreter cannot loop to a runtime bound under numpy >= 2.4.
    for i in range(N_CHUNKS):
        cols = i * BLOCK + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # Rescale the old sum to the new max (exp(-inf) = 0 on the first chunk), add this chunk.
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    inv_d = 1.0 / d
    for i in range(N_CHUNKS):
        cols = i * BLOCK + offs
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_row + cols, (tl.exp(x - m) * inv_d).to(y_ptr.dtype.element_ty), mask=mask)


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """torch.softmax over the last dim, computed in fp32 and returned in x's dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def _num_warps(block: int) -> int:
    # Enough threads that each holds at most ~16-32 values of the block.
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def softmax_triton(x: torch.Tensor, *, max_block: int = MAX_FUSED_COLS) -> torch.Tensor:
    """Launch our kernels on x (..., cols). max_block caps the register block; rows longer
    than it take the online two-pass kernel (tests lower it to exercise that path)."""
    cols = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if xc.numel() == 0:
        return y
    rows = xc.numel() // cols
    if cols <= max_block:
        block = triton.next_power_of_2(cols)
        _softmax_row_kernel[(rows,)](xc, y, cols, BLOCK=block, num_warps=_num_warps(block))
    else:
        block = triton.next_power_of_2(max_block)
        if block > max_block:  # a non-power-of-two cap: round down, not up
            block //= 2
        n_chunks = triton.cdiv(cols, block)
        _softmax_online_kernel[(rows,)](
            xc, y, cols, BLOCK=block, N_CHUNKS=n_chunks, num_warps=_num_warps(block)
        )
    return y


def softmax(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Softmax over the last dim of x (..., cols) (fp16/bf16/fp32; fp32 math); same shape/dtype.

    impl: "auto" (our Triton kernel on CUDA, torch on CPU), "triton" (our kernel; on a CPU
    it runs in Triton's interpreter), or "torch" (the reference).
    """
    if x.dim() < 1:
        raise ValueError("softmax needs at least 1 dimension (..., cols), got a 0-d tensor")
    if x.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; expected one of {_DTYPES}")
    if not interpreter.use_triton(impl, x, "softmax"):
        return softmax_reference(x)
    return softmax_triton(x)
